"""Learning from dynamics (issue 48): NVE segments against the harmonic
oscillator's exact motion, the Green-Kubo and Einstein estimators against
hand-made series, the exact gradient of a diffusion loss against central
finite differences on a Lennard-Jones liquid (common start states), and the
reweighting loop learning a spring constant from a velocity
autocorrelation curve whose canonical average is known in closed form."""
import json
import os

import chemtrain  # noqa: F401  (before jax_md)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_md import partition, simulate, space

import mp
from chemtrain.learn import dynamics as dyn
from chemtrain.models.pair import lennard_jones_template
from chemtrain.quantity import dynamics as dq
from mp_dynamics import K_TRUE, wells_trainer


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


def test_truncated_backpropagation_holds_the_state_after_every_window():
    """``backprop_steps``: the oscillator's v(t) = v_c cos(w tau) - x_c w
    sin(w tau) from the state (x_c, v_c) at the window's start, tau = t -
    t_c. Holding that state constant, d v(t)/dw = -v_c tau sin(w tau) - x_c
    sin(w tau) - x_c w tau cos(w tau), and dw/dk = 1/(2 m w); the exact
    gradient (None) is d/dk of v0 cos(w t). Both against the reverse pass of
    each step's v0.v(t) (velocity Verlet's error at 1 fs is ~1e-7)."""
    k, m, dt, n, window = 50.0, 10.0, 0.001, 400, 100
    template = lambda p: (lambda R, neighbor=None, **kw: 0.5 * p["k"] * jnp.sum(R ** 2))  # noqa
    v0 = np.array([[1.0, 2.0, -1.0]])
    w, t = np.sqrt(k / m), dt * np.arange(n + 1)
    t_c = dt * window * (np.maximum(np.arange(n + 1) - 1, 0) // window)
    x_c, v_c, tau = np.sin(w * t_c) / w, np.cos(w * t_c), t - t_c   # times v0
    truncated = (-v_c * tau * np.sin(w * tau) - x_c * np.sin(w * tau)
                 - x_c * w * tau * np.cos(w * tau)) * 6.0 / (2 * m * w)
    exact = -t * np.sin(w * t) * 6.0 / (2 * m * w)
    with jax.enable_x64(True):
        for steps, expected in ((window, truncated), (None, exact)):
            segment = dyn.make_segment(template, space.free()[1], dt, n, backprop_steps=steps)
            vacf = lambda kk: segment({"k": kk}, jnp.zeros((1, 3)), jnp.asarray(v0 * m), m,  # noqa
                                      None, {})[0]["vacf"]
            grad = jax.jit(jax.jacrev(vacf))(jnp.asarray(k))
            np.testing.assert_allclose(grad, expected, atol=1e-4 * np.abs(expected).max())
    assert segment.block == 20 and np.abs(truncated - exact).max() > 0.5 * np.abs(exact).max()
    # the block divides both: 25 (400/25 + 25 states kept) before 5 (400/5 + 5)
    assert dyn.make_segment(template, space.free()[1], dt, n, backprop_steps=25).block == 25
    with pytest.raises(ValueError, match="and of backprop_steps=100, got 40"):
        dyn.make_segment(template, space.free()[1], dt, n, block=40, backprop_steps=100)
    with pytest.raises(ValueError, match="backprop_steps must be None"):
        dyn.make_segment(template, space.free()[1], dt, n, backprop_steps=0)


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
    sacf = 4.0 * np.exp(-t / tau)           # (kJ/mol/nm^3)^2
    assert float(dq.green_kubo_viscosity(sacf, dt, 27.0, 2.5)) == pytest.approx(
        27.0 / 2.5 * np.trapezoid(sacf, t), rel=1e-12)
    # 1 kJ/mol/nm^3 = 1e3 J / N_A / 1e-27 m^3, times 1 ps, in mPa s
    assert dq.KJ_PER_MOL_NM3_PS_TO_MPA_S == pytest.approx(1e3 / 6.02214076e23 / 1e-27 * 1e-12
                                                          * 1e3, rel=1e-9)


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


def _check_central_differences(loss_at, params, grad, rel=1e-5, tol=0.05):
    """Each parameter's gradient within ``tol`` of the central difference of
    ``loss_at`` with a step of ``rel`` of its value."""
    for name in params:
        h = rel * float(params[name])
        up, down = dict(params), dict(params)
        up[name], down[name] = params[name] + h, params[name] - h
        fd = (loss_at(up) - loss_at(down)) / (2 * h)
        assert abs(float(grad[name]) - fd) <= tol * abs(fd), (name, float(grad[name]), fd)


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
        _check_central_differences(
            lambda p: float(value_and_grad(p, chains, U_ref, target, kw)[0][0]), params, grad)
        # segments vmapped 3 at a time (the 4 start states as 3 + 1 padded
        # with weight 0): the same numbers up to rounding
        batched = jax.jit(dyn.make_value_and_grad(
            template, segment, {"D": dyn.diffusion()}, dyn.squared_error(), segment_batch=3))
        (loss_b, aux_b), grad_b = batched(params, chains, U_ref, target, kw)
        np.testing.assert_allclose(float(loss_b), float(loss), rtol=1e-10)
        np.testing.assert_allclose(aux_b["per_start"]["D"], per, rtol=1e-10)
        for name in params:
            np.testing.assert_allclose(float(grad_b[name]), float(grad[name]), rtol=1e-9)
    with pytest.raises(ValueError, match="segment_batch must be a positive whole number"):
        dyn.make_value_and_grad(template, segment, {"D": dyn.diffusion()}, dyn.squared_error(),
                                segment_batch=0)


def test_segment_without_a_neighbor_list_on_all_pairs():
    """``neighbors=False`` with the all-pairs Lennard-Jones gives the series
    of the listed potential on the same start; a listed potential given no
    list is refused by name."""
    template, shift, chains, _ = _lj_liquid()
    snapshots, nbrs = chains[0]
    R, P = snapshots.position[0], snapshots.momentum[0]
    params = {"sigma": jnp.asarray(0.3), "epsilon": jnp.asarray(1.0)}
    listed, over = jax.jit(dyn.make_segment(template, shift, 0.005, 20))(
        params, R, P, 40.0, nbrs.update(R), {})
    disp, _ = space.periodic(1.05)
    pairs = dyn.make_segment(lennard_jones_template(disp, 0.5, all_pairs=True), shift, 0.005, 20,
                             neighbors=False)
    unlisted, _ = jax.jit(pairs)(params, R, P, 40.0, nbrs.update(R), {})
    assert not bool(over)
    np.testing.assert_allclose(unlisted["vacf"], listed["vacf"], rtol=1e-4)
    np.testing.assert_allclose(unlisted["msd"], listed["msd"], rtol=1e-4, atol=1e-9)
    no_list = dyn.make_segment(template, shift, 0.005, 20, neighbors=False)
    with pytest.raises(ValueError, match="neighbor list or graph, but none was given"):
        no_list(params, R, P, 40.0, nbrs, {})


def test_stress_series_and_viscosity_gradient_on_the_liquid():
    """The segment's stress at its start equals jax-md's own stress of that
    state (kinetic plus virial); the gradient of a Green-Kubo viscosity loss
    (a derivative through the strain derivative of the forces) equals
    central differences, and Einstein's D of the same segments is finite
    and positive."""
    from jax_md import quantity
    with jax.enable_x64(True):
        template, shift, chains, U_ref = _lj_liquid()
        box, kw = 1.05, {"kT": jnp.asarray(1.0), "mass": jnp.asarray(40.0)}
        segment = dyn.make_segment(template, shift, 0.005, 40, stress_box=box)
        snapshots, nbrs = chains[0]
        R, P = snapshots.position[0], snapshots.momentum[0]
        series, _ = jax.jit(segment)({"sigma": jnp.asarray(0.3), "epsilon": jnp.asarray(1.0)},
                                     R, P, 40.0, nbrs.update(R), {})
        full = quantity.stress(template({"sigma": 0.3, "epsilon": 1.0}), R, box, mass=40.0,
                               velocity=P / 40.0, neighbor=nbrs.update(R))
        np.testing.assert_allclose(series["stress"][0], [full[0, 1], full[0, 2], full[1, 2]],
                                   rtol=1e-9, atol=1e-9)
        assert series["stress"].shape == (41, 3)
        value_and_grad = jax.jit(dyn.make_value_and_grad(
            template, segment, {"eta": dyn.shear_viscosity(box, 1.0),
                                "D": dyn.diffusion(method="einstein")},
            dyn.squared_error({"D": 0.0})))
        params = {"sigma": jnp.asarray(0.31), "epsilon": jnp.asarray(0.95)}
        target = {"eta": jnp.asarray(0.0), "D": jnp.asarray(0.0)}
        (_, aux), grad = value_and_grad(params, chains, U_ref, target, kw)
        assert float(aux["predictions"]["D"]) > 0.0
        _check_central_differences(
            lambda p: float(value_and_grad(p, chains, U_ref, target, kw)[0][0]), params, grad)


def test_reweighting_loop_learns_a_spring_constant_from_a_velocity_autocorrelation(tmp_path):
    """27 particles, each in a harmonic well k/2 |r - site|^2 (mass m, kT):
    the canonical average of the normalised <v(0).v(t)> is cos(t sqrt(k/m))
    exactly. From k = 300 the loop reaches the k = 400 of that curve (1 ps
    segments from the 16 snapshots of each trajectory). The noise floor:
    a start state's curve is cos(wt) - w (r0.v0 / v0.v0) sin(wt), and the
    sine term of 16 x 27 particles moves the fitted k by about 2.5 % from one
    trajectory to the next (measured: the end value over runs was 4.05-4.10
    after decaying steps), so the check is 4 %."""
    with jax.enable_x64(True):
        tr = wells_trainer(str(tmp_path))
        tr.initialize_trajstates()
        ks = []
        tr.on_update = lambda rec: ks.append(100 * float(rec["params_after"]["scaled_k"]))
        tr.train(40)
    assert abs(np.mean(ks[-5:]) - K_TRUE) < 0.04 * K_TRUE, ks[-10:]
    assert ks[0] < 310.0 and abs(ks[-1] - K_TRUE) < abs(ks[0] - K_TRUE) / 5
    rec = tr.history[-1]["statepoints"][0]
    assert len(rec["predictions"]["vacf"]) == 201 and rec["parts"]["vacf"] >= 0.0


def test_static_and_dynamic_targets_in_one_loss_with_a_prior(tmp_path):
    """The same wells as a fixed prior of k = 150 plus trained wells, with a
    static target beside the curve: the mean squared distance from the
    site, 3 kT / k (DiffTRe's reweighted average). Both are met at k = 400,
    so the trained part ends near scaled_k = 2.5; the records hold both
    targets' parts and predictions."""
    with jax.enable_x64(True):
        tr = wells_trainer(str(tmp_path), prior_k=150.0, static=True)
        tr.initialize_trajstates()
        ks = []
        tr.on_update = lambda rec: ks.append(
            150.0 + 100 * float(rec["params_after"]["wells"]["scaled_k"]))
        tr.train(40)
    rec = tr.history[-1]["statepoints"][0]
    assert set(rec["parts"]) == {"vacf", "r2"} and set(rec["predictions"]) == {"vacf", "r2"}
    assert abs(rec["predictions"]["r2"] / (3 * 2.5 / K_TRUE) - 1) < 0.1, rec["predictions"]["r2"]
    assert abs(np.mean(ks[-5:]) - K_TRUE) < 0.04 * K_TRUE, ks[-10:]
    assert ks[0] < 460.0 and abs(ks[-1] - K_TRUE) < abs(ks[0] - K_TRUE) / 3


def test_dynamics_run_resumes_bitwise_and_two_ranks_equal_one_process(tmp_path):
    """The dynamics objective on the loop's checkpoints and MPI: a run
    stopped after 2 epochs and restored continues to the parameters of one
    that never stopped; two state points on two ranks give one process's
    parameters and losses."""
    with jax.enable_x64(True):
        full = wells_trainer(str(tmp_path / "full"), kTs=(2.5, 3.5), sim_batch_size=-1)
        full.initialize_trajstates()
        full.train(3, checkpoint_freq=2)
        resumed = wells_trainer(str(tmp_path / "resumed"), kTs=(2.5, 3.5), sim_batch_size=-1)
        resumed.restore(full.store.epoch_path(2))
        resumed.train(1)
    assert float(resumed.params["scaled_k"]) == float(full.params["scaled_k"])
    assert resumed.update_losses == full.update_losses
    out = tmp_path / "mpi"
    out.mkdir()
    rc, log, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_dynamics.py"), "--out", str(out)],
                           timeout=600)
    assert rc == 0, log[-4000:]
    for rank in range(2):
        got = json.loads((out / f"result_{rank}.json").read_text())
        np.testing.assert_allclose(got["k"], float(full.params["scaled_k"]), rtol=1e-9)
        np.testing.assert_allclose(got["losses"], full.update_losses, rtol=1e-9)
