"""DiffTRe trajectories (chemtrain.simulate.trajectory): timings, continuation
with recomputed forces, snapshots and their energies, neighbor-list overflow
restart from the last valid positions, and the errors.

The fluid is the issue's argon-like Lennard-Jones system (21 nm^-3, 120 K,
sigma 0.34 nm, epsilon 0.99 kJ/mol, mass 39.95, Langevin dt 0.01 ps) with 125
particles on a simple cubic lattice (so that every particle starts with the
same number of neighbors) and a 0.75 nm cutoff (the 1.81 nm box leaves room
for a 0.05 nm neighbor-list skin)."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_md import partition, simulate, space

from chemtrain.models.pair import lennard_jones_template
from chemtrain.simulate import (NeighborListOverflowError, SimulationError, make_trajectory,
                                process_printouts, restart_state, run_with_restart)
from chemtrain.units import kT as thermal_energy

N_SIDE, DENSITY, MASS, DT, R_CUT = 5, 21.0, 39.95, 0.01, 0.75
N = N_SIDE ** 3
BOX = (N / DENSITY) ** (1.0 / 3.0)
KT = thermal_energy(120.0)
PARAMS = {"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(0.99)}


@pytest.fixture(scope="module")
def system():
    displacement, shift = space.periodic(BOX)
    grid = np.stack(np.meshgrid(*[np.arange(N_SIDE)] * 3, indexing="ij"), -1).reshape(-1, 3)
    R0 = jnp.asarray((grid + 0.5) * BOX / N_SIDE)
    template = lennard_jones_template(displacement, R_CUT)
    langevin = partial(simulate.nvt_langevin, shift_fn=shift, dt=DT, kT=KT, gamma=4.0)
    return displacement, shift, R0, template, langevin


def _neighbor_fn(displacement, capacity_multiplier=2.5):
    # The lattice has 32 neighbors within 0.8 nm per particle, the fluid about
    # 45 on average: 2.5 x 32 leaves room for the fluid's fluctuations.
    return partition.neighbor_list(displacement, BOX, R_CUT, dr_threshold=0.05,
                                   capacity_multiplier=capacity_multiplier,
                                   format=partition.Dense)


# -- timings -------------------------------------------------------------------


def test_timings_round_and_allow_zero_equilibration():
    t = process_printouts(time_step=0.1, total_time=1.2, t_equilib=0.3, print_every=0.3)
    # 0.3 / 0.1 = 2.9999999999999996: truncation would give 2
    assert (t.steps_per_printout, t.n_equilibration_steps, t.n_snapshots) == (3, 3, 3)
    assert t.n_production_steps == 9 and t.n_steps == 12
    np.testing.assert_allclose(t.t_snapshots, [0.6, 0.9, 1.2])
    t = process_printouts(jnp.float32(0.01), 1.0, 0, np.float64(0.1), t_start=5.0)
    assert (t.n_equilibration_steps, t.n_snapshots, t.steps_per_printout) == (0, 10, 10)
    np.testing.assert_allclose(t.t_snapshots, 5.0 + 0.1 * np.arange(1, 11))


@pytest.mark.parametrize("args, match", [
    ((0.01, 1.0, 1.0, 0.1), "not shorter than the total time"),
    ((0.01, 1.0, 2.0, 0.1), "not shorter than the total time"),
    ((0.01, 1.0, 0.0, 0.015), "multiple of the time step"),
    ((0.01, 1.0, 0.005, 0.1), "multiple of the time step"),
    ((0.01, 1.0, 0.0, 0.3), "multiple of the print interval"),
    ((0.0, 1.0, 0.0, 0.1), "time_step must be a positive"),
    ((0.01, 1.0, -0.1, 0.1), "t_equilib must be zero or positive"),
    ((0.01, "long", 0.0, 0.1), "total_time must be a number"),
])
def test_timings_errors(args, match):
    with pytest.raises(ValueError, match=match):
        process_printouts(*args)


# -- runs ----------------------------------------------------------------------


def test_continuation_recomputes_forces(system):
    """The first step of a trajectory continued with new parameters uses the
    force of the NEW energy: with gamma = 0 Langevin is deterministic and one
    step moves R0 by dt (p0 + dt/2 F(R0)) / m."""
    displacement, shift, R0, template, _ = system
    nf = _neighbor_fn(displacement)
    deterministic = partial(simulate.nvt_langevin, shift_fn=shift, dt=DT, kT=KT, gamma=0.0)
    init_fn, run_fn = make_trajectory(deterministic, template, nf,
                                      process_printouts(DT, DT, 0.0, DT))
    R_start = R0 + 0.02 * jax.random.normal(jax.random.PRNGKey(5), R0.shape)
    old = init_fn(PARAMS, jax.random.PRNGKey(0), R_start, kT=KT, mass=MASS)
    new_params = {"sigma": jnp.asarray(0.36), "epsilon": jnp.asarray(1.3)}
    out = run_fn(new_params, old, jax.random.PRNGKey(1), kT=KT)

    nb = nf.allocate(R_start)
    force = jax.jit(lambda params: -jax.grad(lambda R: template(params)(R, neighbor=nb))(R_start))
    F_new, F_old = force(new_params), force(PARAMS)
    np.testing.assert_allclose(old.sim_state.force, F_old, rtol=1e-10)   # init: old params
    p0 = old.sim_state.momentum

    def one_step(F):
        return shift(R_start, DT * (p0 + 0.5 * DT * F) / MASS)

    moved = out.snapshots.position[0]
    np.testing.assert_allclose(moved, one_step(F_new), rtol=0, atol=1e-12)
    assert float(jnp.max(jnp.abs(one_step(F_old) - one_step(F_new)))) > 1e-6   # test can fail
    assert out.energy_params is new_params
    # the stored U_ref is the energy of the snapshot under the generating params
    energy = jax.jit(lambda R, nb: template(new_params)(R, neighbor=nb))
    assert float(out.U_ref[0]) == pytest.approx(float(energy(moved, nf.allocate(moved))),
                                                rel=1e-12)


@pytest.fixture(scope="module")
def short_run(system):
    displacement, _, R0, template, langevin = system
    nf = _neighbor_fn(displacement)
    timings = process_printouts(DT, 0.6, 0.2, 0.05)
    init_fn, run_fn = make_trajectory(langevin, template, nf, timings)
    start = init_fn(PARAMS, jax.random.PRNGKey(0), R0, kT=KT, mass=MASS)
    first = run_with_restart(run_fn, nf, PARAMS, start, jax.random.PRNGKey(1), kT=KT)
    return nf, timings, run_fn, start, first


def test_snapshots_energies_and_keys(system, short_run):
    _, _, _, template, _ = system
    nf, timings, run_fn, start, first = short_run
    assert first.snapshots.position.shape == (timings.n_snapshots, N, 3)
    assert first.U_ref.shape == (timings.n_snapshots,)
    assert not bool(first.overflow) and not bool(first.nonfinite)
    assert int(first.last_valid_step) == timings.n_steps
    np.testing.assert_array_equal(first.last_valid_position, first.sim_state.position)
    np.testing.assert_array_equal(first.snapshots.position[-1], first.sim_state.position)
    # U_ref against energies recomputed on freshly allocated neighbor lists
    energy_fn = template(PARAMS)
    for k in (0, timings.n_snapshots - 1):
        R = first.snapshots.position[k]
        assert float(first.U_ref[k]) == pytest.approx(
            float(energy_fn(R, neighbor=nf.allocate(R))), rel=1e-10)
    # a Langevin fluid at 120 K: the mean kinetic temperature is near kT
    ke = 0.5 * jnp.sum(first.snapshots.momentum ** 2, axis=(1, 2)) / MASS
    assert float(jnp.mean(2 * ke / (3 * N))) == pytest.approx(KT, rel=0.15)
    # the key alone decides the noise: same key, same trajectory; new key, new one
    again = run_fn(PARAMS, start, jax.random.PRNGKey(1), kT=KT)
    np.testing.assert_array_equal(again.sim_state.position, first.sim_state.position)
    other = run_fn(PARAMS, start, jax.random.PRNGKey(2), kT=KT)
    assert not np.allclose(other.sim_state.position, first.sim_state.position)


def test_missing_kT_is_an_error(system, short_run):
    _, _, R0, template, langevin = system
    nf, timings, run_fn, start, _ = short_run
    init_fn, _ = make_trajectory(langevin, template, nf, timings)
    with pytest.raises(ValueError, match="'kT'"):
        init_fn(PARAMS, jax.random.PRNGKey(0), R0, mass=MASS)
    with pytest.raises(ValueError, match="'kT'"):
        run_fn(PARAMS, start, jax.random.PRNGKey(0), temperature=120.0)


def test_nan_positions_raise(system, short_run):
    nf, _, run_fn, start, _ = short_run
    bad = {"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(jnp.nan)}
    out = run_fn(bad, start, jax.random.PRNGKey(1), kT=KT)
    assert bool(out.nonfinite) and int(out.last_valid_step) == 0
    with pytest.raises(SimulationError, match="NaN or infinite positions"):
        run_with_restart(run_fn, nf, bad, start, jax.random.PRNGKey(1), kT=KT, statepoint=3)


# -- neighbor-list overflow -------------------------------------------------------


@pytest.fixture(scope="module")
def overflowing(system):
    """A Dense list allocated on the lattice without spare capacity: every
    particle has exactly as many neighbors as it can hold, so the first
    fluctuation in the fluid overflows it."""
    displacement, _, R0, template, langevin = system
    nf = _neighbor_fn(displacement, capacity_multiplier=1.0)
    timings = process_printouts(DT, 1.0, 0.0, 0.1)
    init_fn, run_fn = make_trajectory(langevin, template, nf, timings)
    start = init_fn(PARAMS, jax.random.PRNGKey(0), R0, kT=KT, mass=MASS)
    failed = run_fn(PARAMS, start, jax.random.PRNGKey(1), kT=KT)
    return nf, timings, init_fn, run_fn, start, failed


def test_overflow_keeps_last_valid_positions(system, overflowing):
    displacement, _, R0, template, langevin = system
    nf, timings, _, _, start, failed = overflowing
    assert bool(failed.overflow) and not bool(failed.nonfinite)
    k = int(failed.last_valid_step)
    assert 0 < k < timings.n_steps
    # jax-md's reference_position holds the overflowing positions; ours do not
    np.testing.assert_array_equal(failed.nbrs.reference_position, failed.sim_state.position)
    assert not np.allclose(failed.last_valid_position, failed.sim_state.position)
    # the same run with room to spare passes through exactly the same k steps
    roomy = _neighbor_fn(displacement)
    init_k, run_k = make_trajectory(langevin, template, roomy, process_printouts(DT, k * DT, 0.0,
                                                                                 k * DT))
    ok = run_k(PARAMS, init_k(PARAMS, jax.random.PRNGKey(0), R0, kT=KT, mass=MASS),
               jax.random.PRNGKey(1), kT=KT)
    assert not bool(ok.overflow)
    np.testing.assert_allclose(failed.last_valid_position, ok.sim_state.position, atol=1e-9)


def test_overflow_restarts_from_last_valid_positions(overflowing):
    nf, timings, _, run_fn, start, failed = overflowing
    restart = restart_state(failed, nf, overflow_capacity_multiplier=2.5)
    np.testing.assert_array_equal(restart.sim_state.position, failed.last_valid_position)
    np.testing.assert_array_equal(restart.nbrs.reference_position, failed.last_valid_position)
    assert restart.capacity >= int(np.ceil(2.5 * start.capacity))
    assert not bool(restart.nbrs.did_buffer_overflow)

    result = run_with_restart(run_fn, nf, PARAMS, start, jax.random.PRNGKey(1), kT=KT,
                              overflow_capacity_multiplier=2.5, max_neighbor_retries=3)
    assert not bool(result.overflow) and not bool(result.nonfinite)
    assert int(result.last_valid_step) == timings.n_steps
    assert result.capacity == restart.capacity > start.capacity
    assert bool(jnp.all(jnp.isfinite(result.snapshots.position)))
    # run_with_restart ran exactly the trajectory that starts at the last valid state
    expected = run_fn(PARAMS, restart, jax.random.PRNGKey(1), kT=KT)
    np.testing.assert_array_equal(result.snapshots.position, expected.snapshots.position)
    np.testing.assert_array_equal(result.U_ref, expected.U_ref)


def test_overflow_without_retries_raises(overflowing):
    nf, _, _, run_fn, start, _ = overflowing
    with pytest.raises(NeighborListOverflowError,
                       match=rf"state point 7 with every capacity tried: \[{start.capacity}\]"):
        run_with_restart(run_fn, nf, PARAMS, start, jax.random.PRNGKey(1), kT=KT,
                         max_neighbor_retries=0, statepoint=7)
    with pytest.raises(ValueError, match="overflow_capacity_multiplier"):
        restart_state(start, nf, overflow_capacity_multiplier=1.0)


def test_npt_trajectory(system):
    """NPT (jax-md's npt_nose_hoover, fractional coordinates): the box moves,
    the neighbor list and the energies follow the snapshot's box."""
    from chemtrain import quantity
    grid = np.stack(np.meshgrid(*[np.arange(N_SIDE)] * 3, indexing="ij"), -1).reshape(-1, 3)
    R0 = jnp.asarray((grid + 0.5) / N_SIDE)                      # fractional
    displacement, shift = space.periodic_general(BOX, fractional_coordinates=True)
    nf = partition.neighbor_list(displacement, BOX, R_CUT, dr_threshold=0.05,
                                 capacity_multiplier=2.5, format=partition.Dense,
                                 fractional_coordinates=True)
    template = lennard_jones_template(displacement, R_CUT)
    npt = partial(simulate.npt_nose_hoover, shift_fn=shift, dt=0.005, kT=KT, pressure=0.0)
    init_fn, run_fn = make_trajectory(npt, template, nf, process_printouts(0.005, 0.1, 0.0, 0.05))
    with pytest.raises(ValueError, match="initial box"):
        init_fn(PARAMS, jax.random.PRNGKey(0), R0, kT=KT, mass=MASS)
    start = init_fn(PARAMS, jax.random.PRNGKey(0), R0, kT=KT, mass=MASS, box=BOX)
    out = run_with_restart(run_fn, nf, PARAMS, start, jax.random.PRNGKey(1), kT=KT, pressure=1.0)
    boxes = jax.vmap(simulate.npt_box)(out.snapshots)
    assert abs(float(boxes[-1][0, 0]) - BOX) > 1e-4          # the barostat moved the box
    last = jax.tree.map(lambda x: x[-1], out.snapshots)
    nb = nf.allocate(last.position, box=boxes[-1])
    evaluate = jax.jit(lambda s, nb: (template(PARAMS)(s.position, neighbor=nb, box=boxes[-1]),
                                      quantity.density()(s)))
    U, rho = evaluate(last, nb)
    assert float(out.U_ref[-1]) == pytest.approx(float(U), rel=1e-10)
    assert float(rho) == pytest.approx(N * MASS / float(jnp.linalg.det(boxes[-1])), rel=1e-12)
