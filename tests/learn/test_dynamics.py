"""Learning from dynamics (issue 48): NVE segments against the harmonic
oscillator's exact motion, the Green-Kubo and Einstein estimators against
hand-made series, the exact gradient of a diffusion loss against central
finite differences on a Lennard-Jones liquid (common start states), and the
reweighting loop learning a spring constant from a velocity
autocorrelation curve whose canonical average is known in closed form."""
import functools

import chemtrain  # noqa: F401  (before jax_md)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_md import partition, simulate, space

from chemtrain.learn import ReuseRule, simulation_functions
from chemtrain.learn import dynamics as dyn
from chemtrain.learn.dynamics_objective import dynamics_objective
from chemtrain.models.pair import lennard_jones_template
from chemtrain.quantity import dynamics as dq
from chemtrain.simulate import process_printouts
from chemtrain.trainers import Reweighting


def test_segment_follows_the_harmonic_oscillator():
    """One particle in k/2 |r|^2 from the origin with velocity v0: v(t) = v0
    cos(wt), so <v0.v(t)> = |v0|^2 cos(wt) and the displacement's square is
    |v0|^2 sin(wt)^2 / w^2 (velocity Verlet's error at dt = 1 fs is ~1e-7)."""
    k, m, dt, n = 50.0, 10.0, 0.001, 400
    template = lambda p: (lambda R, neighbor=None, **kw: 0.5 * p["k"] * jnp.sum(R ** 2))  # noqa
    with jax.enable_x64(True):
        segment = dyn.make_segment(template, space.free()[1], dt, n)
        v0 = np.array([[1.0, 2.0, -1.0]])
        series, overflow = jax.jit(segment)({"k": jnp.asarray(k)}, jnp.zeros((1, 3)),
                                            jnp.asarray(v0 * m), m, None, {})
    w, t = np.sqrt(k / m), dt * np.arange(n + 1)
    assert segment.block == 20 and not bool(overflow)
    np.testing.assert_allclose(series["vacf"], 6.0 * np.cos(w * t), atol=1e-5)
    np.testing.assert_allclose(series["msd"], 6.0 * np.sin(w * t) ** 2 / w ** 2, atol=1e-5)
    with pytest.raises(ValueError, match="block must be a positive divisor of n_steps=400"):
        dyn.make_segment(template, space.free()[1], dt, n, block=7)


def test_green_kubo_and_einstein_estimators():
    dt, tau, a = 0.01, 0.3, 0.75
    t = dt * np.arange(401)
    vacf = a * np.exp(-t / tau)
    assert float(dq.green_kubo_diffusion(vacf, dt)) == pytest.approx(
        np.trapezoid(vacf, t) / 3, rel=1e-12)
    assert float(dq.green_kubo_diffusion(vacf, dt)) == pytest.approx(a * tau / 3, rel=1e-3)
    msd = 6 * 2.4e-3 * t + 0.01 * (1 - np.exp(-t / 0.05))   # diffusive after a short start
    assert float(dq.einstein_diffusion(msd, dt)) == pytest.approx(2.4e-3, rel=1e-6)
    assert dq.NM2_PER_PS_TO_M2_PER_S * 2.36e-3 == pytest.approx(2.36e-9)


def _lj_liquid():
    """27 Lennard-Jones atoms at liquid density: 4 start states 0.5 ps apart
    from an NVT run, their reference energies and the neighbor list."""
    box = 1.05
    disp, shift = space.periodic(box)
    g = (np.arange(3) + 0.5) / 3 * box
    R = jnp.asarray(np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3))
    template = lennard_jones_template(disp, 0.5)
    nbr_fn = partition.neighbor_list(disp, box, 0.5, dr_threshold=0.05, capacity_multiplier=1.5,
                                     format=partition.NeighborListFormat.Dense)
    p0 = {"sigma": jnp.asarray(0.3), "epsilon": jnp.asarray(1.0)}
    nbrs = nbr_fn.allocate(R)
    init, apply = simulate.nvt_langevin(template(p0), shift, 0.005, 1.0, gamma=1.0)
    state = init(jax.random.PRNGKey(0), R, mass=40.0, neighbor=nbrs)

    @jax.jit
    def run(state, nbrs):
        def body(c, _):
            s, nb = c
            s = apply(s, neighbor=nb)
            return (s, nb.update(s.position)), None
        return jax.lax.scan(body, (state, nbrs), None, length=100)[0]
    snaps = []
    for i in range(6):
        state, nbrs = run(state, nbrs)
        if i >= 2:
            snaps.append(state)
    assert not bool(nbrs.did_buffer_overflow)
    U_ref = jnp.stack([template(p0)(s.position, neighbor=nbrs.update(s.position)) for s in snaps])
    snapshots = jax.tree.map(lambda *x: jnp.stack(x), *snaps)
    return template, shift, [(snapshots, nbrs)], U_ref


def test_diffusion_loss_gradient_equals_central_differences():
    """Both parts of the gradient (the start states' weights and the
    segments) against central differences of the same estimator on the same
    start states, with parameters away from those that sampled them."""
    with jax.enable_x64(True):
        template, shift, chains, U_ref = _lj_liquid()
        segment = dyn.make_segment(template, shift, 0.005, 100)
        value_and_grad = jax.jit(dyn.make_value_and_grad(
            template, segment, {"D": dyn.diffusion()}, dyn.squared_error()))
        kw = {"kT": jnp.asarray(1.0), "mass": jnp.asarray(40.0)}
        target = {"D": jnp.asarray(0.01)}
        params = {"sigma": jnp.asarray(0.31), "epsilon": jnp.asarray(0.95)}
        (loss, aux), grad = value_and_grad(params, chains, U_ref, target, kw)
        assert int(aux["nbr_overflow"]) == 0 and 1.0 < float(aux["n_eff"]) < 4.0
        per = np.asarray(aux["per_start"]["D"])
        w = np.asarray(aux["weights"])
        assert float(aux["predictions"]["D"]) == pytest.approx(float(w @ per), rel=1e-12)

        def loss_at(p):
            return float(value_and_grad(p, chains, U_ref, target, kw)[0][0])
        for name in params:
            h = 1e-5 * float(params[name])
            up, down = dict(params), dict(params)
            up[name], down[name] = params[name] + h, params[name] - h
            fd = (loss_at(up) - loss_at(down)) / (2 * h)
            assert abs(float(grad[name]) - fd) <= 0.05 * abs(fd), (name, float(grad[name]), fd)


def test_reweighting_loop_learns_a_spring_constant_from_a_velocity_autocorrelation(tmp_path):
    """27 particles, each in a harmonic well k/2 |r - site|^2 (mass m, kT):
    the canonical average of the normalised <v(0).v(t)> is cos(t sqrt(k/m))
    exactly. From k = 300 the loop reaches the k = 400 of that curve (1 ps
    segments from the 16 snapshots of each trajectory). The noise floor:
    a start state's curve is cos(wt) - w (r0.v0 / v0.v0) sin(wt), and the
    sine term of 16 x 27 particles moves the fitted k by about 2.5 % from one
    trajectory to the next (measured: the end value over runs was 4.05-4.10
    after decaying steps), so the check is 4 %."""
    L, kT, m, dt = 3.0, 2.5, 10.0, 0.005
    disp, shift = space.periodic(L)
    g = (np.arange(3) + 0.5) * (L / 3)
    sites = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)

    def template(p):
        def energy(R, neighbor=None, **kw):
            d = jax.vmap(disp)(R, jnp.asarray(sites, R.dtype))
            return 0.5 * 100.0 * p["scaled_k"] * jnp.sum(d ** 2)
        return energy
    t = dt * np.arange(201)
    target = np.cos(np.sqrt(400.0 / m) * t)
    with jax.enable_x64(True):
        tr = Reweighting(dynamics_objective(), 0, {"scaled_k": jnp.asarray(3.0)},
                         optax.adam(optax.cosine_decay_schedule(0.08, 40)),
                         reuse=ReuseRule(pool=1), progress=False,
                         checkpoint_path=str(tmp_path))
        fns = simulation_functions(template, functools.partial(
            simulate.nvt_langevin, shift_fn=shift, dt=dt, kT=kT, gamma=2.0),
            partition.neighbor_list(disp, L, 0.3, format=partition.NeighborListFormat.Dense),
            process_printouts(dt, 6.0, 2.0, 0.25), None)
        spec = {"segment": dyn.make_segment(template, shift, dt, 200),
                "functionals": {"vacf": lambda series, dt: series["vacf"] / series["vacf"][0]},
                "targets": {"vacf": {"gamma": 10.0}}}
        tr.add(fns, {"kT": kT, "mass": m}, sites, targets=spec["targets"],
               target_values={"vacf": target}, n_snapshots=16, spec=spec)
        tr.initialize_trajstates()
        ks = []
        tr.on_update = lambda rec: ks.append(100 * float(rec["params_after"]["scaled_k"]))
        tr.train(40)
    assert abs(np.mean(ks[-5:]) - 400.0) < 0.04 * 400.0, ks[-10:]
    assert ks[0] < 310.0 and abs(ks[-1] - 400.0) < abs(ks[0] - 400.0) / 5
    rec = tr.history[-1]["statepoints"][0]
    assert len(rec["predictions"]["vacf"]) == 201 and rec["parts"]["vacf"] >= 0.0
