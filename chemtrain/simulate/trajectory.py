"""DiffTRe trajectories on jax-md: timings, the trajectory generator and the
neighbor-list overflow restart.

``make_trajectory`` builds ``(init_fn, run_fn)`` in jax-md's style. ``run_fn``
runs equilibration and production in one jitted ``lax.scan`` from the last
state of the previous trajectory, with the forces recomputed for the new
parameters (jax-md states carry the force of the parameters that produced
them). The neighbor list is updated every step; an overflow (or non-finite
positions) is recorded as data, the integration stops advancing at the first
failed step (later steps are computed and thrown away: cheaper than a
``lax.cond`` around each step), and the state of the last step whose
neighbor-list update was valid is kept: jax-md itself overwrites
``reference_position`` with the
overflowing positions and keeps its error bits set until the next
``allocate``. ``run_with_restart`` is the host-side policy: re-allocate at
the last valid positions with a larger capacity and run again from there.
"""
from __future__ import annotations


import inspect
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import ENSEMBLE_KEYS, box_kwargs, is_npt
from .inputs import check_energy, check_time_step, initial_mass, simulator_settings


# kept under its old public name (chemtrain.simulate.state_box_kwargs)
state_box_kwargs = box_kwargs


class NeighborListOverflowError(RuntimeError):
    """The neighbor list kept overflowing after every allowed re-allocation.

    Raised by :func:`~chemtrain.simulate.run_with_restart` once its retries are used up, and by the
    ``init_fn`` of :func:`make_trajectory` when the initial neighbor list has
    overflowed already. A subclass of RuntimeError.
    """


class SimulationError(RuntimeError):
    """A trajectory produced non-finite positions.

    Raised by :func:`~chemtrain.simulate.run_with_restart` when positions became NaN or infinite.
    A subclass of RuntimeError.
    """


# -- timings -----------------------------------------------------------------


class Timings(NamedTuple):
    """Step counts of one trajectory (upstream chemtrain's meaning).

    A trajectory runs ``n_equilibration_steps`` steps, then ``n_snapshots``
    printout intervals of ``steps_per_printout`` steps each; the state at
    the end of each interval is a snapshot, taken at ``t_snapshots``. Made by
    :func:`process_printouts`.

    Attributes:
      time_step: integration time step in ps.
      n_equilibration_steps: steps before the first printout interval.
      n_production_steps: steps after equilibration,
        ``n_snapshots * steps_per_printout``.
      steps_per_printout: steps of one printout interval.
      n_snapshots: snapshots of one trajectory.
      t_snapshots: (n_snapshots,) times of the snapshots in ps.
      total_time: length of the trajectory in ps, equilibration included.
      t_equilib: equilibration time in ps.
      print_every: time between two snapshots in ps.
      t_start: time in ps added to ``t_snapshots`` (default 0).
    """
    time_step: float
    n_equilibration_steps: int
    n_production_steps: int
    steps_per_printout: int
    n_snapshots: int
    t_snapshots: np.ndarray
    total_time: float
    t_equilib: float
    print_every: float
    t_start: float = 0.0

    @property
    def n_steps(self) -> int:
        """All integration steps of one trajectory."""
        return self.n_equilibration_steps + self.n_production_steps


def _whole(ratio: float, what: str, fix: str, rtol: float = 1e-6) -> int:
    n = int(round(ratio))
    if abs(ratio - n) > rtol * max(1.0, abs(ratio)):
        raise ValueError(f"{what} is {ratio:.6g}, not a whole number. {fix}")
    return n


def process_printouts(time_step: float, total_time: float, t_equilib: float,
                      print_every: float, t_start: float = 0.0) -> Timings:
    """Step counts of a trajectory, from its times in ps.

    The trajectory lasts ``total_time``, the first ``t_equilib`` of which is
    equilibration, with a snapshot every ``print_every``. Counts are rounded to
    the nearest integer (0.3 / 0.1 gives 3 steps, not 2); the time ratios must
    be whole numbers up to round-off. Zero equilibration is allowed.

    Args:
      time_step: integration time step in ps, positive.
      total_time: length of the trajectory in ps, equilibration included;
        longer than ``t_equilib``.
      t_equilib: equilibration time in ps, zero or positive, a multiple of
        ``time_step``.
      print_every: time between snapshots in ps, a multiple of ``time_step``;
        ``total_time - t_equilib`` must be a multiple of it.
      t_start: start time in ps; it only offsets ``t_snapshots``.

    Returns:
      :class:`Timings` with snapshots at ``t_start + t_equilib + k *
      print_every`` for k = 1 to ``n_snapshots``.

    Raises:
      ValueError: a time is not a number; ``time_step``, ``total_time`` or
        ``print_every`` is not positive and finite; ``t_equilib`` is negative,
        not finite or not shorter than ``total_time``; a time ratio is not a
        whole number; or there would be no snapshot or no step per printout.
    """
    def number(name, value):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number (ps), got {value!r}.") from None

    time_step, total_time, t_equilib, print_every, t_start = (
        number("time_step", time_step), number("total_time", total_time),
        number("t_equilib", t_equilib), number("print_every", print_every),
        number("t_start", t_start))
    for name, value in (("time_step", time_step), ("total_time", total_time),
                        ("print_every", print_every)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number (ps), got {value!r}.")
    if not (t_equilib >= 0 and math.isfinite(t_equilib)):
        raise ValueError(f"t_equilib must be zero or positive (ps), got {t_equilib!r}.")
    if t_equilib >= total_time:
        raise ValueError(
            f"The equilibration time t_equilib={t_equilib} ps is not shorter than the total time "
            f"total_time={total_time} ps, so no snapshot would be sampled. total_time includes "
            f"equilibration: use total_time > t_equilib, e.g. "
            f"total_time={t_equilib + 100 * print_every:g}.")
    steps_per_printout = _whole(
        print_every / time_step, f"print_every / time_step = {print_every} / {time_step}",
        "The print interval must be a multiple of the time step.")
    n_eq = _whole(t_equilib / time_step, f"t_equilib / time_step = {t_equilib} / {time_step}",
                  "The equilibration time must be a multiple of the time step.")
    n_snapshots = _whole(
        (total_time - t_equilib) / print_every,
        f"(total_time - t_equilib) / print_every = ({total_time} - {t_equilib}) / {print_every}",
        "The production time must be a multiple of the print interval.")
    if steps_per_printout < 1 or n_snapshots < 1:
        raise ValueError(f"The trajectory would have {n_snapshots} snapshot(s) of "
                         f"{steps_per_printout} step(s); make print_every at least one time step "
                         f"and total_time - t_equilib at least print_every.")
    t_snapshots = t_start + t_equilib + print_every * np.arange(1, n_snapshots + 1)
    return Timings(time_step=time_step, n_equilibration_steps=n_eq,
                   n_production_steps=n_snapshots * steps_per_printout,
                   steps_per_printout=steps_per_printout, n_snapshots=n_snapshots,
                   t_snapshots=t_snapshots, total_time=total_time, t_equilib=t_equilib,
                   print_every=print_every, t_start=t_start)


# -- trajectory state ---------------------------------------------------------


class TrajState(NamedTuple):
    """One trajectory: where it ended and what it sampled.

    Made by the ``init_fn`` and ``run_fn`` of :func:`make_trajectory` and by
    :func:`~chemtrain.simulate.restart_state`.

    Attributes:
      sim_state: jax-md simulator state at the end (continue from here).
      nbrs: jax-md neighbor list at the end (capacity: ``nbrs.max_occupancy``,
        also :attr:`capacity`).
      last_valid_position: (N, 3) positions in nm of the last step whose
        neighbor-list update was valid (equal to the final positions when
        nothing failed).
      snapshots: simulator states at the printouts, stacked along axis 0
        (n_snapshots of them; None before the first run).
      U_ref: (n_snapshots,) potential energy in kJ/mol of each snapshot under
        ``energy_params`` (None before the first run).
      overflow: scalar boolean, True if the neighbor list overflowed during the
        run.
      nonfinite: scalar boolean, True if positions became NaN or infinite
        during the run.
      last_valid_state: full simulator state at ``last_valid_position``.
      last_valid_step: number of steps of the run completed before the
        first failure (all steps when nothing failed).
      energy_params: the parameters that generated the trajectory.
    """
    sim_state: Any
    nbrs: Any
    last_valid_position: Any
    snapshots: Any = None
    U_ref: Any = None
    overflow: Any = False
    nonfinite: Any = False
    last_valid_state: Any = None
    last_valid_step: Any = 0
    energy_params: Any = None

    @property
    def capacity(self) -> int:
        """The neighbor-list capacity (jax-md's static ``max_occupancy``)."""
        return int(self.nbrs.max_occupancy)


def _check_kT(state_kwargs: dict, where: str) -> None:
    if "kT" not in state_kwargs:
        raise ValueError(
            f"{where} needs the thermostat temperature: state_kwargs must contain 'kT' (thermal "
            f"energy in kJ/mol, e.g. kT=chemtrain.units.kT(300.0)); got keys "
            f"{sorted(state_kwargs)}.")


def _accepts_box(init) -> bool:
    try:
        return "box" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        return False


def make_trajectory(simulator_template: Callable, energy_fn_template: Callable, neighbor_fn,
                    timings: Timings):
    """Return ``(init_fn, run_fn)`` for DiffTRe trajectories.

    Args:
      simulator_template: ``energy_fn -> (init, apply)``, a partial of a jax-md
        simulator, e.g. ``partial(simulate.nvt_langevin, shift_fn=shift,
        dt=0.01, kT=kT, gamma=4.0)`` (``nvt_nose_hoover`` and
        ``npt_nose_hoover`` work too; NPT needs ``periodic_general`` with
        fractional coordinates and a neighbor list built for them). A ``dt``
        (ps) it binds must equal ``timings.time_step``.
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``, the
        potential energy in kJ/mol of one configuration.
      neighbor_fn: jax-md ``NeighborListFns`` (``partition.neighbor_list``).
      timings: from :func:`process_printouts`.

    Returns:
      The tuple ``(init_fn, run_fn)``.

      ``init_fn(params, key, R0, nbrs=None, **state_kwargs) -> TrajState``
      builds the initial state at ``R0`` ((N, 3), nm) without running MD:
      ``kT`` (kJ/mol) is required; ``mass`` (amu; default: a ``mass`` bound in
      the simulator partial, else 1) and, for NPT, the initial ``box`` go to
      the simulator's init; a neighbor list is allocated at ``R0`` unless
      given. It raises ValueError without ``kT``, for an ``R0`` that is not
      2-D or not finite, for NPT without ``box`` and for a mass given
      differently in both places; NeighborListOverflowError when the given or
      allocated list has overflowed; and TypeError or ValueError for an energy
      template that does not give one number per configuration.

      ``run_fn(params, traj_state, key, **state_kwargs) -> TrajState`` runs one
      trajectory from the end of ``traj_state`` (jitted; recompiles only when
      the neighbor capacity changes), with the forces recomputed for
      ``params``. ``kT`` (and ``pressure`` for NPT) go to every step; other
      keys, except ``mass`` and ``box``, go to the energy function. ``key``
      replaces the random state of stochastic simulators. The result may have
      ``overflow`` or ``nonfinite`` set: use :func:`~chemtrain.simulate.run_with_restart`. It
      raises ValueError without ``kT``.

    Raises:
      TypeError: ``timings`` does not come from :func:`process_printouts`.
      ValueError: the simulator partial's ``dt`` differs from
        ``timings.time_step``, or the partial binds keywords its simulator
        ignores (see :mod:`chemtrain.simulate.inputs`).
    """
    from jax_md import quantity as jmd_quantity
    if not isinstance(timings, Timings):
        raise TypeError(f"timings must come from chemtrain.simulate.process_printouts(...), got "
                        f"{type(timings).__name__}.")
    settings = simulator_settings(simulator_template)
    check_time_step(settings, timings.time_step)

    @jax.jit  # compiled once per shapes and neighbor capacity, not per state point
    def _init_state(params, key, R0, nbrs, mass, box_kw, kwargs):
        init, _ = simulator_template(energy_fn_template(params))
        return init(key, R0, mass=mass, neighbor=nbrs, **box_kw, **kwargs)

    def init_fn(params, key, R0, nbrs=None, **state_kwargs) -> TrajState:
        _check_kT(state_kwargs, "init_fn")
        R0 = jnp.asarray(R0)
        if R0.ndim != 2:
            raise ValueError(f"R0 must be one configuration of shape (n_particles, dim), got "
                             f"shape {R0.shape}.")
        if not bool(jnp.all(jnp.isfinite(R0))):
            raise ValueError("R0 contains NaN or infinite positions.")
        init, _ = simulator_template(energy_fn_template(params))  # for its signature only
        kwargs = {k: v for k, v in state_kwargs.items() if k not in ("mass", "box", "pressure")}
        npt = _accepts_box(init)
        box_kw = {}
        if npt:
            if "box" not in state_kwargs:
                raise ValueError("This simulator (NPT) needs the initial box: pass box=... in "
                                 "state_kwargs.")
            box_kw = {"box": jnp.asarray(state_kwargs["box"])}
        given = nbrs is not None
        if nbrs is None:
            nbrs = neighbor_fn.allocate(R0, **box_kw)
        if bool(nbrs.did_buffer_overflow):
            raise NeighborListOverflowError(
                "The neighbor list given to init_fn has overflowed; allocate it at R0 "
                "(neighbor_fn.allocate(R0)) or pass nbrs=None." if given else
                f"The neighbor list that neighbor_fn.allocate gives at the reference state "
                f"overflows at once (capacity {nbrs.max_occupancy}): neighbor_fn allocates too "
                f"little room. Build it with a larger capacity_multiplier (at least 1), or check "
                f"the reference positions for overlapping particles.")
        mass = initial_mass(state_kwargs, settings)
        check_energy(energy_fn_template, params, R0, nbrs, **box_kw,
                     **{k: v for k, v in kwargs.items() if k not in ENSEMBLE_KEYS})
        state = _init_state(params, key, R0, nbrs, mass, box_kw, kwargs)
        return TrajState(sim_state=state, nbrs=nbrs, last_valid_position=state.position,
                         overflow=jnp.asarray(False), nonfinite=jnp.asarray(False),
                         last_valid_state=state, last_valid_step=jnp.asarray(0),
                         energy_params=params)

    def _run(params, sim_state, nbrs, key, step_kwargs, energy_kwargs):
        energy_fn = energy_fn_template(params)
        _, apply = simulator_template(energy_fn)
        if hasattr(sim_state, "rng"):
            sim_state = sim_state.set(rng=key)
        # Continue with forces of the new parameters, not the stored ones.
        force = jmd_quantity.force(energy_fn)(sim_state.position, neighbor=nbrs,
                                              **box_kwargs(sim_state), **energy_kwargs)
        sim_state = sim_state.set(force=force)

        def step(carry, _):
            state, nbrs, valid, n_valid, overflow, nonfinite = carry
            failed = overflow | nonfinite

            # every step is computed and one that follows a failure is thrown
            # away (a lax.cond that skipped it cost 5-7 % of every step of a
            # Lennard-Jones fluid): the state stays at the first failed step
            moved = apply(state, neighbor=nbrs, **step_kwargs, **energy_kwargs)
            moved_nbrs = nbrs.update(moved.position, **box_kwargs(moved))
            new_state, new_nbrs = jax.tree.map(lambda a, b: jnp.where(failed, a, b),
                                               (state, nbrs), (moved, moved_nbrs))
            bad_nbrs = new_nbrs.did_buffer_overflow != 0
            bad_pos = ~jnp.all(jnp.isfinite(new_state.position))
            ok = ~(failed | bad_nbrs | bad_pos)
            valid = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_state, valid)
            carry = (new_state, new_nbrs, valid, n_valid + ok.astype(n_valid.dtype),
                     overflow | (~failed & bad_nbrs), nonfinite | (~failed & bad_pos))
            return carry, None

        def printout(carry, _):
            carry, _ = jax.lax.scan(step, carry, None, length=timings.steps_per_printout)
            state, nbrs = carry[0], carry[1]
            U = energy_fn(state.position, neighbor=nbrs, **box_kwargs(state),
                          **energy_kwargs)
            return carry, (state, U)

        carry = (sim_state, nbrs, sim_state, jnp.asarray(0, jnp.int32), jnp.asarray(False),
                 jnp.asarray(False))
        if timings.n_equilibration_steps:
            carry, _ = jax.lax.scan(step, carry, None, length=timings.n_equilibration_steps)
        carry, (snapshots, U) = jax.lax.scan(printout, carry, None, length=timings.n_snapshots)
        state, nbrs, valid, n_valid, overflow, nonfinite = carry
        return state, nbrs, valid, n_valid, overflow, nonfinite, snapshots, U

    _run_jit = jax.jit(_run)

    def run_fn(params, traj_state: TrajState, key, **state_kwargs) -> TrajState:
        _check_kT(state_kwargs, "run_fn")
        step_kwargs = {"kT": state_kwargs["kT"]}
        if is_npt(traj_state.sim_state) and "pressure" in state_kwargs:
            step_kwargs["pressure"] = state_kwargs["pressure"]
        energy_kwargs = {k: v for k, v in state_kwargs.items()
                         if k not in ENSEMBLE_KEYS}
        state, nbrs, valid, n_valid, overflow, nonfinite, snapshots, U = _run_jit(
            params, traj_state.sim_state, traj_state.nbrs, key, step_kwargs, energy_kwargs)
        return TrajState(sim_state=state, nbrs=nbrs, last_valid_position=valid.position,
                         snapshots=snapshots, U_ref=U, overflow=overflow, nonfinite=nonfinite,
                         last_valid_state=valid, last_valid_step=n_valid, energy_params=params)

    return init_fn, run_fn
