"""The pooled estimator (chemtrain.learn.pool) against a direct numpy
computation, its layout, and the reuse rule that sizes it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chemtrain.learn import ReuseRule
from chemtrain.learn.pool import pooled, pooled_weights
from chemtrain.simulate import TrajState, process_printouts


def _numpy_pool(U, U_ref, kT):
    """Each filled slot's softmax over its snapshots of all chains, mixed
    with coefficients proportional to each slot's entropy N_eff."""
    C, K, n = U_ref.shape
    w, neffs = np.zeros((C, K, n)), np.zeros(K)
    for k in range(K):
        if not np.all(np.isfinite(U_ref[:, k])):
            continue
        x = -(U[:, k] - U_ref[:, k]) / kT
        p = np.exp(x - x.max())
        p /= p.sum()
        w[:, k] = p
        neffs[k] = np.exp(-np.sum(p * np.log(p)))
    c = neffs / neffs.sum()
    return (w * c[None, :, None]).ravel(), neffs


@pytest.fixture
def energies():
    rng = np.random.default_rng(0)
    C, K, n = 2, 3, 7
    U_ref = rng.normal(size=(C, K, n)) * 3.0
    U = U_ref + rng.normal(size=(C, K, n)) * 2.0 + np.array([0.0, 1.0, 4.0])[None, :, None]
    U_ref[:, 0] = np.inf          # slot 0 empty
    return U.ravel(), U_ref, 2.5


def test_pooled_weights_match_a_direct_computation(energies):
    U, U_ref, kT = energies
    with jax.enable_x64(True):
        w, neffs = pooled_weights(jnp.asarray(U), jnp.asarray(U_ref), kT)
    want_w, want_neffs = _numpy_pool(U.reshape(U_ref.shape), U_ref, kT)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(neffs), want_neffs, rtol=1e-12)
    assert float(np.sum(w)) == pytest.approx(1.0, abs=1e-12)
    assert np.all(np.asarray(w).reshape(U_ref.shape)[:, 0] == 0.0)   # the empty slot
    assert neffs[0] == 0.0 and 1.0 < neffs[1] < 2 * 7


def test_one_filled_slot_is_plain_reweighting(energies):
    U, U_ref, kT = energies
    U_ref = U_ref.copy()
    U_ref[:, 1] = np.inf
    with jax.enable_x64(True):
        w, _ = pooled_weights(jnp.asarray(U), jnp.asarray(U_ref), kT)
    x = -(U.reshape(U_ref.shape)[:, 2] - U_ref[:, 2]) / kT
    p = np.exp(x - x.max())
    np.testing.assert_allclose(np.asarray(w).reshape(U_ref.shape)[:, 2], p / p.sum(), rtol=1e-12)


def test_gradient_holds_the_mixing_coefficients_constant(energies):
    """d(sum_i w_i q_i)/dU = sum_k c_k d(slot k's own estimate)/dU."""
    U, U_ref, kT = energies
    q = np.random.default_rng(1).normal(size=U.shape)
    with jax.enable_x64(True):
        grad = jax.grad(lambda u: jnp.dot(pooled_weights(u, jnp.asarray(U_ref), kT)[0], q))(
            jnp.asarray(U))
    _, neffs = _numpy_pool(U.reshape(U_ref.shape), U_ref, kT)
    c = neffs / neffs.sum()
    want = np.zeros(U_ref.shape)
    Q = q.reshape(U_ref.shape)
    for k in (1, 2):    # d/dU_i of sum_j p_j q_j = -p_i (q_i - <q>) / kT
        x = -(U.reshape(U_ref.shape)[:, k] - U_ref[:, k]) / kT
        p = np.exp(x - x.max())
        p /= p.sum()
        want[:, k] = -c[k] * p * (Q[:, k] - np.sum(p * Q[:, k])) / kT
    np.testing.assert_allclose(np.asarray(grad).reshape(U_ref.shape), want, rtol=1e-10,
                               atol=1e-14)


def _traj(tag, n=4):
    snaps = {"position": jnp.full((n, 2, 3), float(tag))}
    return TrajState(sim_state=tag, nbrs=f"nbrs{tag}", last_valid_position=None,
                     snapshots=snaps, U_ref=jnp.arange(n) + 10.0 * tag, overflow=False,
                     nonfinite=False, last_valid_state=None, last_valid_step=0,
                     energy_params=None)


def test_pool_layout_oldest_first_with_empty_slots_in_front():
    older = [[_traj(1), _traj(11)], [_traj(2), _traj(12)]]
    newest = [_traj(3), _traj(13)]
    chains = pooled(older, newest, 4)
    assert len(chains) == 2
    first = chains[0]
    assert first.sim_state == 3 and first.nbrs == "nbrs3"          # the newest's state
    assert first.snapshots["position"].shape == (16, 2, 3)
    np.testing.assert_array_equal(first.snapshots["position"][::4, 0, 0], [3, 1, 2, 3])
    assert first.U_ref.shape == (4, 4)
    assert np.all(np.isinf(first.U_ref[0]))
    np.testing.assert_array_equal(first.U_ref[1:, 0], [10.0, 20.0, 30.0])
    np.testing.assert_array_equal(chains[1].U_ref[1:, 0], [110.0, 120.0, 130.0])
    assert pooled(older, newest, 1) is newest
    # more earlier trajectories than slots: the oldest leave
    np.testing.assert_array_equal(pooled(older, newest, 2)[0].U_ref[:, 0], [20.0, 30.0])


def test_reuse_rule_sizes_and_checks():
    toy = process_printouts(0.01, 1100, 100, 1.0)     # 110,000 steps, 1,000 snapshots
    assert ReuseRule().pool_size(toy) == 18           # 110000 // 6000
    assert ReuseRule().pool_size(process_printouts(0.01, 2e3, 0, 2.0)) == 20    # 33: at most 20
    assert ReuseRule().pool_size(process_printouts(0.01, 0.6, 0.1, 0.05)) == 1  # 60 / 10: few steps
    assert ReuseRule().pool_size(process_printouts(0.01, 1.0, 0.5, 0.1)) == 1   # 3: below 4
    assert ReuseRule().pool_size(process_printouts(0.01, 0.96, 0.0, 0.24)) == 4  # 96 // (6 * 4)
    assert ReuseRule(pool=3).pool_size(toy) == 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="pool must be a whole number"):
            ReuseRule(pool=bad)
    with pytest.raises(ValueError, match="max_reuses"):
        ReuseRule(max_reuses=-1)
    with pytest.raises(ValueError, match="max_reuse_se"):
        ReuseRule(max_reuse_se=0)
    rule = ReuseRule(max_reuses=4, max_reuse_se=0.2)
    # one trajectory: moved 0.5 standard errors (N_eff 99.9 of 100, 200 samples) -> recompute
    assert rule.recompute(99.9, 100, 0.9, 200, 0, pool=1)
    # a pool averages that error: only the overlap and the count apply
    assert not rule.recompute(99.9, 100, 0.9, 200, 0, pool=5)
    assert rule.recompute(89.0, 100, 0.9, 200, 0, pool=5)
    assert rule.recompute(99.9, 100, 0.9, 200, 4, pool=5)


def test_store_rotates_pools_and_resizes_them():
    from chemtrain.trainers.trajectories import TrajectoryStore
    store = TrajectoryStore(strategy=None, restart=None)
    store.pools[0] = 3
    store.replace({0: [_traj(1)]})
    for tag in (2, 3, 4):
        store.put({0: [_traj(tag)]})
    assert [t[0].sim_state for t in store.older[0]] == [2, 3]     # 1 left the pool of 3
    np.testing.assert_array_equal(store.sample(0)[0].U_ref[:, 0], [20.0, 30.0, 40.0])
    # with a new trajectory: the pool it would give, nothing changed yet
    np.testing.assert_array_equal(store.sample(0, [_traj(5)])[0].U_ref[:, 0], [30.0, 40.0, 50.0])
    assert store.states[0][0].sim_state == 4
    store.set_pools({0: 2})          # e.g. a restored run written with pools of 2
    assert [t[0].sim_state for t in store.older[0]] == [3]
    np.testing.assert_array_equal(store.sample(0)[0].U_ref[:, 0], [30.0, 40.0])
    store.replace({0: [_traj(7)]}, {0: [[_traj(5)], [_traj(6)]]})   # loaded: the newest fit
    assert [t[0].sim_state for t in store.older[0]] == [6]
    store.set_pools({0: 1})
    assert store.older[0] == [] and store.sample(0)[0].sim_state == 7


def test_store_keeps_what_a_recompute_derived():
    """A recompute's derive of its new pool is committed with it (issue 47:
    it was computed again at the next update); anything else put is derived
    once on demand, and a put without it drops the old value."""
    from chemtrain.trainers.trajectories import TrajectoryStore
    calls = []

    class Objective:
        @staticmethod
        def derive(sp, params, trajs):
            calls.append(trajs[0].sim_state)
            return "derived from %s" % trajs[0].sim_state

    sp = type("SP", (), {"index": 0})()
    store = TrajectoryStore(strategy=None, restart=None)
    store.replace({0: [_traj(1)]})
    assert store.derived_of(Objective, sp, None) == "derived from 1" and calls == [1]
    store.put({0: [_traj(2)]}, {0: "given with 2"})
    assert store.derived_of(Objective, sp, None) == "given with 2" and calls == [1]
    store.put({0: [_traj(3)]}, {1: "another state point's"})
    assert store.derived_of(Objective, sp, None) == "derived from 3" and calls == [1, 3]
    assert store.derived_of(Objective, sp, None) == "derived from 3" and calls == [1, 3]


def test_each_trajectory_of_a_pool_is_derived_once():
    """With an objective that joins its trajectories' own derives
    (derive_pool, DiffTRe's fixed quantities), a pool that rotates derives
    only its new trajectory; the joined value lists the slots oldest first,
    the empty ones repeating the newest (the pool's layout)."""
    from chemtrain.learn.objective import Objective
    from chemtrain.trainers.trajectories import TrajectoryStore
    calls = []

    def derive(sp, params, trajs):
        calls.append(trajs[0].sim_state)
        return trajs[0].sim_state

    objective = Objective("test", result=None, derive=derive,
                          derive_pool=lambda sp, parts, size: [parts[-1]] * (size - len(parts))
                          + list(parts))
    sp = type("SP", (), {"index": 0})()
    store = TrajectoryStore(strategy=None, restart=None)
    store.pools[0] = 3
    store.replace({0: [_traj(1)]})
    assert store.derived_of(objective, sp, None) == [1, 1, 1] and calls == [1]
    new = [_traj(2)]
    assert store.derived_of(objective, sp, None, new) == [2, 1, 2] and calls == [1, 2]
    store.put({0: new})
    assert store.derived_of(objective, sp, None) == [2, 1, 2] and calls == [1, 2]
    for tag in (3, 4):
        store.put({0: [_traj(tag)]})
    assert store.derived_of(objective, sp, None) == [2, 3, 4] and calls == [1, 2, 3, 4]
    assert sorted(t[0][0].sim_state for t in store._parts.values()) == [2, 3, 4]  # 1 left
