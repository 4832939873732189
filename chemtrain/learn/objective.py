"""A reweighting method as a value: :class:`Objective`, a frozen structure of
pure functions handed to the one reweighting loop
(:class:`chemtrain.trainers.Reweighting`), as an optax
``GradientTransformation`` is handed to any training loop.

The loop owns sampling (trajectories, their reuse and restarts), the
spreading of state points over processes and the sums over them, the
optimizer step and its step-size search, checkpoints, trajectory files,
failures, reports and its own bookkeeping (each state point's loss,
gradient, N_eff, recomputes and reuse measures, summed over processes and
written into the history). An objective owns its functions, its state and
its own numbers:

1. ``prepare(fns, spec)``: its compiled functions for state points that
   share the simulation functions ``fns``
   (:class:`~chemtrain.learn.statepoint.SimulationFunctions`, which hold
   the energy template) and the objective's settings ``spec`` (whatever
   :meth:`~chemtrain.trainers.Reweighting.add` was given, e.g. DiffTRe's
   quantities and observables); each state point holds them as
   ``sp.functions``. Called once per group of state points that share them;
2. ``init(sp, params)``: a new state point's own state, plain data (numbers,
   lists, dicts) kept in the trainer's state and in checkpoints
   (relative entropy: ``{"s_rel": 0.0}``);
3. ``derive(sp, params, trajs)``: what it computes once per trajectory
   (DiffTRe: the quantities that ignore the potential), or None;
4. ``inputs(sp, key)``: what it draws once per update and state point from
   ``key`` (relative entropy: a batch of reference frames), or None;
5. ``result(sp, params, trajs, derived, inputs)``: the state point's
   ``{"loss", "grad", "aux"}``; ``aux`` holds at least ``n_eff`` and
   ``nbr_overflow`` (neighbor-list overflows on stored snapshots);
6. ``contributions(batch, statepoints, results)``: this process's share of
   the objective's own numbers of the update, a dict of numpy arrays with
   zeros for state points computed elsewhere, so the element-wise sum over
   processes is the whole batch (DiffTRe: its loss parts and predictions);
7. ``after(sp, params, new_params, trajs, result, inputs)``: a number per
   state point computed after the step (relative entropy: its estimated
   change), summed over processes; None: nothing;
8. ``records(states, summed, after, batch, statepoints)``: from the summed
   contributions (with the loop's per-state-point ``loss``) and ``after``,
   ``(states, loss, records)``: every state point's state after the update,
   the update's loss and, per state point of the batch, the objective's
   entries of its history record (the loop adds its own; an entry of the
   objective's, such as relative entropy's ``loss``, takes precedence);
9. ``check(sp, params, trajs)``: raise on a state point that cannot be
   trained, seen on its first configuration (called when trajectories are
   sampled from the reference state or loaded from a file);
10. ``plot(statepoints, history, predictions, plot_x, path)``: the figure
    :meth:`~chemtrain.trainers.Reweighting.plot` writes.

A third method (a dynamic observable, another estimator) is a third value
built from these functions; nothing in the loop changes, and it needs
nothing from the loop (``tests/_support/mean_energy.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


def _none(*args, **kwargs):
    return None


def _no_state(sp, params) -> dict:
    return {}


def _no_contributions(batch, statepoints, results) -> dict:
    return {}


def _no_check(sp, params, trajs) -> None:
    return None


def mean_loss_records(states, summed, after, batch, statepoints):
    """The default :attr:`Objective.records`: the states unchanged, the
    update's loss the mean of the batch's losses, no entries of its own."""
    return states, float(np.sum(summed["loss"]) / len(batch)), {i: {} for i in batch}


@dataclasses.dataclass(frozen=True)
class Objective:
    """A reweighting method as a value of pure functions (see the module's
    docstring for each one's contract).

    Attributes:
      name: the method's name in messages.
      result: the state point's loss, gradient and ``aux``.
      records: ``(states, loss, records)`` of an applied update (default:
        the mean loss, no state change, no entries).
      prepare: the compiled functions of state points that share
        simulation functions and settings (default: none).
      init: a new state point's state, plain data (default: ``{}``).
      contributions: this process's share of the objective's own numbers,
        a dict that a sum over processes reduces (default: none).
      derive: what is computed once per trajectory (default: nothing).
      derive_pool: ``(sp, parts, size) -> derived``: the ``derive`` of a
        pool of ``size`` slots from each of its trajectories' own
        (``parts``, oldest first; :mod:`chemtrain.learn.pool`), so a
        trajectory is derived once, not again each time the pool changes.
        None: ``derive`` runs on the whole pool.
      inputs: what is drawn once per update and state point (default:
        nothing).
      after: a number per state point after the step (default: none).
      check: the check of a state point on its first configuration.
      plot: the figure of the trainer's ``plot``; None: the trainer has none.
      pools: whether ``derive`` and ``result`` accept a pool of recent
        trajectories (:mod:`chemtrain.learn.pool`) in place of one; the
        loop then reweights from a pool sized by its
        :class:`~chemtrain.learn.reuse.ReuseRule`. False: one trajectory.
    """

    name: str
    result: Callable
    records: Callable = mean_loss_records
    prepare: Callable = _none
    init: Callable = _no_state
    contributions: Callable = _no_contributions
    derive: Callable = _none
    derive_pool: Callable | None = None
    inputs: Callable = _none
    after: Callable | None = None
    check: Callable = _no_check
    plot: Callable | None = None
    pools: bool = False
