"""DiffTRe reweighting, loss and gradient as pure functions (chemtrain.learn.reweighting).

Snapshots come from a plain jax-md Langevin run of a 128-particle argon-like
Lennard-Jones fluid written here (not chemtrain's trajectory generator), and
their reference energies from the same jax-md energy function, so nothing
under test produces its own expected values.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_md import partition, simulate, space

from chemtrain.learn import reweighting as dt
from chemtrain.models.pair import lennard_jones_template
from chemtrain.neighbors import neighbor_pairs
from chemtrain.units import kT as kT_of

N, DENSITY, R_CUT = 128, 21.0, 0.9
SIGMA, EPSILON, MASS = 0.34, 0.99, 39.95
KT = kT_of(120.0)
BOX = (N / DENSITY) ** (1 / 3)
BINS = jnp.linspace(0.25, 0.85, 25)


def log_template(displacement):
    """LJ parametrised by log sigma and log epsilon."""
    base = lennard_jones_template(displacement, R_CUT)
    return lambda p: base({"sigma": jnp.exp(p["log_sigma"]), "epsilon": jnp.exp(p["log_epsilon"])})


def log_params(sigma, epsilon):
    return {"log_sigma": jnp.log(jnp.asarray(sigma, jnp.float64)),
            "log_epsilon": jnp.log(jnp.asarray(epsilon, jnp.float64))}


def smoothed_pair_histogram(displacement):
    """A parameter-independent vector quantity: Gaussian-smoothed histogram
    of neighbor-list pair distances (per pair)."""
    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        R = state.position
        i, j, _ = neighbor_pairs(neighbor, R.shape[0])
        real = (i < R.shape[0]) & (j < R.shape[0])
        dr = jax.vmap(displacement)(R[jnp.minimum(i, R.shape[0] - 1)], R[jnp.minimum(j, R.shape[0] - 1)])
        r = jnp.sqrt(jnp.sum(dr ** 2, -1) + 1e-12)
        g = jnp.exp(-((r[:, None] - BINS) / 0.02) ** 2) * real[:, None]
        return jnp.sum(g, 0) / R.shape[0]
    return fn


def energy_per_particle(state, neighbor=None, energy_fn=None, **kwargs):
    """A parameter-dependent scalar quantity."""
    return energy_fn(state.position, neighbor=neighbor) / state.position.shape[0]


@functools.lru_cache(maxsize=None)
def snapshots(n_snapshots=40, seed=0):
    """Plain jax-md: Langevin at the true parameters; returns the stacked
    snapshot states, the final neighbor list, the energies of the snapshots
    and the displacement function."""
    displacement, shift = space.periodic(BOX)
    energy_fn = log_template(displacement)(log_params(SIGMA, EPSILON))
    neighbor_fn = partition.neighbor_list(displacement, BOX, R_CUT, dr_threshold=0.05,
                                          capacity_multiplier=1.5,
                                          format=partition.NeighborListFormat.Sparse)
    per_side = int(np.ceil(N ** (1 / 3)))
    grid = (np.stack(np.meshgrid(*[np.arange(per_side)] * 3, indexing="ij"), -1)
            .reshape(-1, 3)[:N] + 0.5) * BOX / per_side
    R0 = jnp.asarray(grid, jnp.float64)
    nbrs = neighbor_fn.allocate(R0)
    init, apply = simulate.nvt_langevin(energy_fn, shift, dt=0.01, kT=KT, gamma=5.0)
    state = init(jax.random.PRNGKey(seed), R0, mass=MASS, neighbor=nbrs)

    @functools.partial(jax.jit, static_argnums=2)
    def run(state, nbrs, steps):
        def body(carry, _):
            s, nb = carry
            s = apply(s, neighbor=nb)
            nb = nb.update(s.position)
            return (s, nb), None
        return jax.lax.scan(body, (state, nbrs), None, length=steps)[0]

    state, nbrs = run(state, nbrs, 500)
    states = []
    for _ in range(n_snapshots):
        state, nbrs = run(state, nbrs, 10)
        assert not bool(nbrs.did_buffer_overflow)
        states.append(state)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    U_ref = np.asarray(jax.jit(jax.vmap(lambda R: energy_fn(R, neighbor=nbrs.update(R))))(
        stacked.position))
    return stacked, nbrs, U_ref, displacement


@pytest.fixture(scope="module")
def system():
    stacked, nbrs, U_ref, displacement = snapshots()
    quantities = {"hist": smoothed_pair_histogram(displacement), "u": energy_per_particle}
    return dict(chains=[(stacked, nbrs)], U_ref=jnp.asarray(U_ref), template=log_template(displacement),
                quantities=quantities, displacement=displacement)


# -- weights and N_eff by hand ---------------------------------------------
def test_weights_by_hand_and_stability():
    kT = 2.5
    w = np.asarray(dt.reweighting_weights(jnp.array([1.0, 1.0 + kT * np.log(2.0)]), jnp.zeros(2), kT))
    np.testing.assert_allclose(w, [2 / 3, 1 / 3], rtol=1e-12)
    # energy differences of 1e5 kT neither overflow nor give all zeros
    w = np.asarray(dt.reweighting_weights(jnp.array([-1e5, 0.0, 1e5]) * kT, jnp.zeros(3), kT))
    assert np.all(np.isfinite(w))
    np.testing.assert_allclose(w, [1.0, 0.0, 0.0], atol=1e-300)
    with pytest.raises(ValueError, match="one energy per snapshot"):
        dt.reweighting_weights(jnp.zeros(3), jnp.zeros(4), kT)


def test_effective_sample_size_by_hand():
    assert float(dt.effective_sample_size(jnp.full(50, 1 / 50))) == pytest.approx(50, rel=1e-12)
    assert float(dt.effective_sample_size(jnp.array([1.0, 0.0, 0.0]))) == pytest.approx(1.0, rel=1e-12)
    w = np.array([0.5, 0.25, 0.25])
    expected = np.exp(-(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25)))
    assert float(dt.effective_sample_size(jnp.asarray(w))) == pytest.approx(expected, rel=1e-12)


def test_needs_recompute_is_a_strict_threshold():
    assert not dt.needs_recompute(90.0, 100, 0.9)
    assert dt.needs_recompute(89.999, 100, 0.9)
    assert not dt.needs_recompute(100.0, 100, 0.9)


# -- on real snapshots ------------------------------------------------------
def test_reference_parameters_give_uniform_weights(system):
    evaluate = dt.make_snapshot_evaluator(system["template"], system["quantities"])
    U, qs, n_overflow = evaluate(log_params(SIGMA, EPSILON), system["chains"], {"kT": KT})
    assert int(n_overflow) == 0
    w = dt.reweighting_weights(U, system["U_ref"], KT)
    n = len(system["U_ref"])
    assert float(dt.effective_sample_size(w)) == pytest.approx(n, abs=1e-6)
    for name in ("hist", "u"):
        plain = np.mean(np.asarray(qs[name]), axis=0)
        np.testing.assert_allclose(np.asarray(dt.weighted_mean(qs[name], w)), plain, rtol=0,
                                   atol=1e-12 * max(1.0, float(np.max(np.abs(plain)))))


def test_neff_falls_as_parameters_move(system):
    n_eff = jax.jit(dt.make_neff_fn(system["template"]))
    values = [float(n_eff(log_params(SIGMA * f, EPSILON), system["chains"], system["U_ref"], {"kT": KT}))
              for f in (1.0, 1.003, 1.01, 1.03)]
    assert values[0] == pytest.approx(len(system["U_ref"]), abs=1e-6)
    assert all(a > b for a, b in zip(values, values[1:])), values
    assert values[-1] < 0.5 * values[0]


def _loss(system, **kwargs):
    targets = {"hist": {"target": jnp.full(BINS.shape, 0.3), "gamma": 1.0},
               "u": {"target": jnp.asarray(-5.0), "gamma": 0.1}}
    loss = dt.make_statepoint_loss(system["template"], system["quantities"], targets, **kwargs)
    values = {k: v["target"] for k, v in targets.items()}
    return lambda p: loss(p, system["chains"], system["U_ref"], values, {"kT": KT})


def test_gradient_matches_central_finite_difference(system):
    """Through the weights and the parameter-dependent quantity: away from
    the reference parameters, h = 1e-4 in log parameters."""
    loss = _loss(system)
    p0 = log_params(SIGMA * 1.01, EPSILON * 0.95)
    (value, aux), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(p0)
    n = len(system["U_ref"])
    assert 0.3 * n < float(aux["n_eff"]) < 0.99 * n  # the weights matter here
    f = jax.jit(lambda p: loss(p)[0])
    h = 1e-4
    for name in p0:
        plus = dict(p0, **{name: p0[name] + h})
        minus = dict(p0, **{name: p0[name] - h})
        fd = (float(f(plus)) - float(f(minus))) / (2 * h)
        assert float(grad[name]) == pytest.approx(fd, rel=1e-3), name


def test_gradient_flows_through_weights_and_quantities(system):
    """A parameter-independent quantity still has a gradient (weights only);
    at the reference parameters a weighted mean's gradient is the covariance
    formula -<(dU - <dU>) q>/kT, computed here independently."""
    stacked, nbrs = system["chains"][0]
    hist = system["quantities"]["hist"]
    targets = {"hist": {"target": jnp.zeros(BINS.shape), "gamma": 1.0}}
    loss = dt.make_statepoint_loss(system["template"], {"hist": hist}, targets,
                                   loss_fn=lambda pred, tgt: jnp.sum(pred["hist"]))
    p0 = log_params(SIGMA, EPSILON)
    g = jax.grad(lambda p: loss(p, system["chains"], system["U_ref"],
                                {"hist": targets["hist"]["target"]}, {"kT": KT})[0])(p0)
    energy = system["template"]

    @jax.jit
    @jax.vmap
    def per_snapshot(s):
        nb = nbrs.update(s.position)
        dU = jax.grad(lambda p: energy(p)(s.position, neighbor=nb))(p0)["log_sigma"]
        return dU, jnp.sum(hist(s, neighbor=nb))

    dU, q = (np.asarray(x) for x in per_snapshot(stacked))
    expected = -np.mean((dU - dU.mean()) * (q - q.mean())) / KT
    assert float(g["log_sigma"]) == pytest.approx(expected, rel=1e-8)


def test_step_size_search_keeps_neff(system):
    n_eff = jax.jit(dt.make_neff_fn(system["template"]))
    p0 = log_params(SIGMA * 1.005, EPSILON)
    now = float(n_eff(p0, system["chains"], system["U_ref"], {"kT": KT}))
    update = {"log_sigma": jnp.asarray(0.05), "log_epsilon": jnp.asarray(0.0)}
    alphas = dt.step_size_candidates(8)
    table = np.array([[float(n_eff(dt.scaled_params(p0, update, a), system["chains"],
                                   system["U_ref"], {"kT": KT})) for a in alphas]])
    violations = dt.step_size_violations(table, [now], 0.5)
    alpha, found = dt.choose_step_size(alphas, violations)
    assert found and 0 < alpha < 1  # the full step would lose too much, a smaller one not
    after = float(n_eff(dt.scaled_params(p0, update, alpha), system["chains"], system["U_ref"], {"kT": KT}))
    assert after >= 0.5 * now
    assert float(n_eff(dt.scaled_params(p0, update, 2 * alpha), system["chains"],
                       system["U_ref"], {"kT": KT})) < 0.5 * now
    assert dt.choose_step_size([1.0, 0.5], [1, 2]) == (0.5, False)


# -- targets, batches, keys -----------------------------------------------
def test_target_without_observable_is_an_error():
    q = {"rdf": lambda s, **k: s.position}
    with pytest.raises(ValueError, match="Target 'pressure' has no observable"):
        dt.resolve_observables({"pressure": {"target": 1.0}}, q, None)
    with pytest.raises(ValueError, match="'target' array"):
        dt.resolve_observables({"rdf": {"gamma": 1.0}}, q, None)
    with pytest.raises(ValueError, match="unknown keys"):
        dt.resolve_observables({"rdf": {"target": 1.0, "weight": 2}}, q, None)
    with pytest.raises(TypeError, match="observables\\['p'\\]"):
        dt.resolve_observables({"rdf": {"target": 1.0}}, q, {"p": 3})
    obs = dt.resolve_observables({"rdf": {"target": 1.0}, "p": {"target": 0.0}}, q,
                                 {"p": lambda qs, w: 0.0})
    assert set(obs) == {"rdf", "p"}


def test_statepoint_batches_fold_the_remainder():
    assert dt.statepoint_batches(7, 3) == [[0, 1, 2], [3, 4, 5, 6]]
    assert dt.statepoint_batches(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert dt.statepoint_batches(5, -1) == [[0, 1, 2, 3, 4]]
    assert dt.statepoint_batches(3, 1) == [[0], [1], [2]]
    assert dt.statepoint_batches(2, 2) == [[0, 1]]
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="sim_batch_size"):
            dt.statepoint_batches(4, bad)
    with pytest.raises(ValueError, match="larger than the number of state points"):
        dt.statepoint_batches(2, 3)


def test_statepoint_keys_depend_on_index_and_update_only():
    base = jax.random.PRNGKey(3)
    k = lambda *a: np.asarray(jax.random.key_data(dt.statepoint_key(base, *a))
                              if jnp.issubdtype(base.dtype, jax.dtypes.prng_key)
                              else dt.statepoint_key(base, *a))
    assert np.array_equal(k(2, 5), k(2, 5))
    seen = {k(i, u, c).tobytes() for i in range(3) for u in range(3) for c in range(2)}
    assert len(seen) == 18


def test_potential_independent_quantities_are_found_and_reused(system):
    """The histogram ignores the potential, the energy does not; a loss that
    takes the histogram's stored values equals the one that evaluates it."""
    stacked, nbrs = system["chains"][0]
    first = jax.tree.map(lambda x: x[0], stacked)
    dependent = dt.potential_dependent(system["quantities"], first, nbrs, {"kT": KT})
    assert dependent == {"u"}
    targets = {"hist": {"gamma": 1.0}, "u": {"gamma": 0.1}}
    values = {"hist": jnp.full(BINS.shape, 0.3), "u": jnp.asarray(-5.0)}
    p0 = log_params(SIGMA * 1.01, EPSILON * 0.95)
    args = (system["chains"], system["U_ref"], values, {"kT": KT})
    full = dt.make_statepoint_loss(system["template"], system["quantities"], targets)
    split = dt.make_statepoint_loss(system["template"], system["quantities"], targets,
                                    fixed=("hist",))
    _, stored, _ = dt.make_snapshot_evaluator(None, {"hist": system["quantities"]["hist"]})(
        p0, system["chains"], {"kT": KT})
    (a, _), ga = jax.value_and_grad(full, has_aux=True)(p0, *args)
    (b, _), gb = jax.value_and_grad(split, has_aux=True)(p0, *args, stored)
    assert float(a) == pytest.approx(float(b), rel=1e-12)
    for k in p0:
        assert float(ga[k]) == pytest.approx(float(gb[k]), rel=1e-10)


@pytest.mark.parametrize("vmap_batch", [3, None])
def test_two_pass_gradient_equals_the_direct_one(system, vmap_batch):
    """chemtrain.learn.difftre_grad: the chunked vector-Jacobian products
    (padded last chunk with vmap_batch 3) give the direct gradient, with a
    fixed and a potential-dependent quantity, over two chains."""
    from chemtrain.learn.difftre_grad import make_value_and_grad
    targets = {"hist": {"gamma": 1.0}, "u": {"gamma": 0.1}}
    values = {"hist": jnp.full(BINS.shape, 0.3), "u": jnp.asarray(-5.0)}
    p0 = log_params(SIGMA * 1.01, EPSILON * 0.95)
    chains = system["chains"] * 2
    U_ref = jnp.concatenate([system["U_ref"]] * 2)
    _, stored, _ = dt.make_snapshot_evaluator(None, {"hist": system["quantities"]["hist"]})(
        p0, chains, {"kT": KT})
    args = (p0, chains, U_ref, values, {"kT": KT}, stored)
    kw = dict(vmap_batch=vmap_batch, fixed=("hist",))
    direct = jax.value_and_grad(dt.make_statepoint_loss(system["template"], system["quantities"],
                                                        targets, **kw), has_aux=True)
    (a, aux_a), ga = jax.jit(direct)(*args)
    (b, aux_b), gb = jax.jit(make_value_and_grad(system["template"], system["quantities"],
                                                 targets, **kw))(*args)
    assert float(a) == float(b)
    assert float(aux_a["n_eff"]) == float(aux_b["n_eff"])
    for k in p0:
        assert float(gb[k]) == pytest.approx(float(ga[k]), rel=1e-10), k
