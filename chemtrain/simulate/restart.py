"""The neighbor-list overflow restart of DiffTRe trajectories: a list with
room for a given capacity (:func:`allocate_with_capacity`), the state a
failed trajectory restarts from (:func:`restart_state`), the run that
restarts (:func:`run_with_restart`) and the trainers' policy for it
(:class:`RestartPolicy`)."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ..ensemble import box_kwargs
from .trajectory import NeighborListOverflowError, SimulationError, TrajState

log = logging.getLogger("chemtrain")


def allocate_with_capacity(neighbor_fn, position, capacity: int, **kwargs):
    """Allocate a neighbor list at ``position`` with room for ``capacity``.

    Args:
      neighbor_fn: jax-md ``NeighborListFns``.
      position: (N, 3) positions in nm.
      capacity: the least ``max_occupancy`` wanted (jax-md's meaning:
        neighbors per particle for Dense lists, in total for Sparse ones).
      **kwargs: passed to ``neighbor_fn.allocate`` (e.g. ``box``).

    Returns:
      A jax-md ``NeighborList`` holding at least ``capacity`` neighbors, or
      what jax-md's own estimate gives if more.
    """
    from jax_md import partition
    nbrs = neighbor_fn.allocate(position, **kwargs)
    if nbrs.max_occupancy >= capacity:
        return nbrs
    missing = capacity - nbrs.max_occupancy
    if partition.is_sparse(nbrs.format):  # jax-md multiplies extra capacity by N
        missing = -(-missing // position.shape[0])
    return neighbor_fn.allocate(position, extra_capacity=int(missing), **kwargs)


def restart_state(traj_state: TrajState, neighbor_fn, overflow_capacity_multiplier: float = 1.5
                  ) -> TrajState:
    """The state a failed (overflowed) trajectory restarts from.

    That is its last valid simulator state, with a neighbor list allocated at
    those positions (and, for NPT, that box) whose capacity is the failed one
    times ``overflow_capacity_multiplier``, rounded up.

    Args:
      traj_state: :class:`TrajState` of the failed run.
      neighbor_fn: jax-md ``NeighborListFns`` that allocates the new list.
      overflow_capacity_multiplier: growth factor of the capacity, larger
        than 1.

    Returns:
      A :class:`TrajState` at the last valid state with the new list, the
      failure flags cleared, ``last_valid_step`` 0, no snapshots and the same
      ``energy_params``.

    Raises:
      ValueError: ``overflow_capacity_multiplier`` is not larger than 1.
    """
    if not overflow_capacity_multiplier > 1:
        raise ValueError(f"overflow_capacity_multiplier must be larger than 1, got "
                         f"{overflow_capacity_multiplier}.")
    state = traj_state.last_valid_state
    target = int(math.ceil(traj_state.capacity * overflow_capacity_multiplier))
    nbrs = allocate_with_capacity(neighbor_fn, state.position, target, **box_kwargs(state))
    return TrajState(sim_state=state, nbrs=nbrs, last_valid_position=state.position,
                     overflow=jnp.asarray(False), nonfinite=jnp.asarray(False),
                     last_valid_state=state, last_valid_step=jnp.asarray(0),
                     energy_params=traj_state.energy_params)


def _name(statepoint) -> str:
    return "" if statepoint is None else f" at state point {statepoint}"


def run_with_restart(run_fn: Callable, neighbor_fn, params, traj_state: TrajState, key, *,
                     overflow_capacity_multiplier: float = 1.5, max_neighbor_retries: int = 3,
                     statepoint=None, **state_kwargs) -> TrajState:
    """Run one trajectory, restarting it with a larger neighbor list on overflow.

    On a neighbor-list overflow the trajectory restarts from the last valid
    state with a larger neighbor list (see :func:`restart_state`), at most
    ``max_neighbor_retries`` times; every attempt gets the same ``key``.

    Args:
      run_fn: the ``run_fn`` of :func:`make_trajectory`.
      neighbor_fn: jax-md ``NeighborListFns`` for the re-allocations.
      params: energy parameters passed to ``run_fn``.
      traj_state: :class:`TrajState` to start from.
      key: JAX random key passed to ``run_fn``.
      overflow_capacity_multiplier: growth factor of the capacity at each
        restart, larger than 1.
      max_neighbor_retries: the most restarts, a non-negative integer.
      statepoint: label of the state point for log lines and error messages
        (None: no label).
      **state_kwargs: passed to ``run_fn`` (``kT`` in kJ/mol is required).

    Returns:
      The :class:`TrajState` of the first run that neither overflowed nor
      produced non-finite positions.

    Raises:
      ValueError: ``max_neighbor_retries`` is not a non-negative integer, or
        a restart is needed and ``overflow_capacity_multiplier`` is not larger
        than 1.
      NeighborListOverflowError: still overflowing after the retries (names
        ``statepoint`` and the capacities tried).
      SimulationError: positions became NaN or infinite.
    """
    if isinstance(max_neighbor_retries, bool) or not (
            isinstance(max_neighbor_retries, (int, np.integer)) and max_neighbor_retries >= 0):
        raise ValueError(f"max_neighbor_retries must be a non-negative integer, got "
                         f"{max_neighbor_retries!r}.")
    capacities = [traj_state.capacity]
    for attempt in range(max_neighbor_retries + 1):
        result = run_fn(params, traj_state, key, **state_kwargs)
        if bool(result.nonfinite):
            raise SimulationError(
                f"The simulation{_name(statepoint)} produced NaN or infinite positions after "
                f"{int(result.last_valid_step)} of its steps (neighbor capacity "
                f"{result.capacity}). The potential or the time step is unstable at these "
                f"parameters: check the parameters, reduce the time step or start from a "
                f"relaxed configuration (in the model's units: positions in nm, not Å).")
        if not bool(result.overflow):
            return result
        if attempt == max_neighbor_retries:
            break
        traj_state = restart_state(result, neighbor_fn, overflow_capacity_multiplier)
        capacities.append(traj_state.capacity)
        log.info("neighbor list overflowed%s after %d steps; restarting from the last valid "
                 "positions with capacity %d (was %d)", _name(statepoint),
                 int(result.last_valid_step), capacities[-1], capacities[-2])
    raise NeighborListOverflowError(
        f"The neighbor list overflowed{_name(statepoint)} with every capacity tried: "
        f"{capacities} (max_neighbor_retries={max_neighbor_retries}, "
        f"overflow_capacity_multiplier={overflow_capacity_multiplier}; in a trainer "
        f"RestartPolicy(capacity_multiplier, max_retries)). Allocate a larger list "
        f"(partition.neighbor_list(..., capacity_multiplier=...)), allow more retries, or check "
        f"whether the system collapses at these parameters.")


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """What a trainer does when a trajectory's neighbor list overflows
    (:func:`run_with_restart`): restart from the last valid state with the
    capacity multiplied by ``capacity_multiplier``, at most ``max_retries``
    times, then raise :class:`NeighborListOverflowError`.

    Attributes:
      capacity_multiplier: growth factor of the capacity at each restart, a
        number larger than 1.
      max_retries: the most restarts of one trajectory, a whole number >= 0.
    """

    capacity_multiplier: float = 1.5
    max_retries: int = 3

    def __post_init__(self):
        if isinstance(self.capacity_multiplier, bool) or not isinstance(
                self.capacity_multiplier, (int, float)) or not self.capacity_multiplier > 1.0:
            raise ValueError(f"RestartPolicy: capacity_multiplier must be a number larger than 1 "
                             f"(the growth of the neighbor capacity at a restart), got "
                             f"{self.capacity_multiplier!r}.")
        if isinstance(self.max_retries, bool) or not isinstance(
                self.max_retries, (int, np.integer)) or self.max_retries < 0:
            raise ValueError(f"RestartPolicy: max_retries must be a whole number >= 0 (restarts "
                             f"of one trajectory), got {self.max_retries!r}.")

    def run(self, run_fn, neighbor_fn, params, traj_state, key, statepoint=None,
            **state_kwargs) -> TrajState:
        """:func:`run_with_restart` under this policy."""
        return run_with_restart(run_fn, neighbor_fn, params, traj_state, key,
                                overflow_capacity_multiplier=self.capacity_multiplier,
                                max_neighbor_retries=self.max_retries, statepoint=statepoint,
                                **state_kwargs)
