"""A reweighting method as a value: :class:`Objective`, a frozen structure of
pure functions handed to the one reweighting loop
(:class:`chemtrain.trainers.Reweighting`), as an optax
``GradientTransformation`` is handed to any training loop.

The loop owns sampling (trajectories, their reuse and restarts), the
spreading of state points over processes and the sums over them, the
optimizer step and its step-size search, checkpoints, trajectory files,
failures and reports. An objective owns only its per-state-point numbers:

1. ``derive(sp, params, trajs)``: what it computes once per trajectory
   (DiffTRe: the quantities that ignore the potential), or None;
2. ``inputs(sp, key)``: what it draws once per update and state point from
   ``key`` (relative entropy: a batch of reference frames), or None;
3. ``result(sp, params, trajs, derived, inputs)``: the state point's
   ``{"loss", "grad", "aux"}``; ``aux`` holds at least ``n_eff`` and
   ``nbr_overflow`` (neighbor-list overflows on stored snapshots);
4. ``contributions(batch, statepoints, results, params)``: this process's
   share of the update as one pytree of numpy arrays, zeros for state
   points computed elsewhere, so the element-wise sum over processes is the
   whole batch. It must hold ``grad`` (the gradient summed over state
   points), and per state point ``loss``, ``n_eff``, ``nbr_overflow``;
   :func:`shared_contributions` gives these plus the reuse bookkeeping;
5. ``after(sp, params, new_params, trajs, result, inputs)``: a number per
   state point computed after the step (relative entropy: its estimated
   change), summed over processes; None: nothing;
6. ``records(numbers, summed, after, batch, statepoints, update)``: from the
   summed contributions (and ``after``), ``(numbers, loss, records)``: the
   objective's updated per-state-point numbers (plain data kept in the
   trainer's state, e.g. ``{"s_rel": [...]}``), the update's loss and each
   state point's record for the history;
7. ``check(sp, params, trajs)``: raise on a state point that cannot be
   trained, seen on its first configuration (called when trajectories are
   sampled from the reference state or loaded from a file);
8. ``plot(statepoints, history, predictions, plot_x, path)``: the figure
   :meth:`~chemtrain.trainers.Reweighting.plot` writes.

A third method (a dynamic observable, another estimator) is a third value
built from these eight functions; nothing in the loop changes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np


def _none(*args, **kwargs):
    return None


def _no_check(sp, params, trajs) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Objective:
    """A reweighting method as eight pure functions (see the module's
    docstring for each one's contract).

    Attributes:
      name: the method's name in messages.
      result: the state point's loss, gradient and ``aux``.
      contributions: this process's share of the update, a pytree that a
        sum over processes reduces.
      records: ``(numbers, loss, records)`` of an applied update.
      derive: what is computed once per trajectory (default: nothing).
      inputs: what is drawn once per update and state point (default:
        nothing).
      after: a number per state point after the step (default: none).
      check: the check of a state point on its first configuration.
      plot: the figure of the trainer's ``plot``; None: the trainer has none.
      numbers: per-method plain numbers of a new state point, e.g.
        ``{"s_rel": 0.0}``: the trainer's state holds one list per key.
      pools: whether ``derive`` and ``result`` accept a pool of recent
        trajectories (:mod:`chemtrain.learn.pool`) in place of one; the
        loop then reweights from a pool sized by its
        :class:`~chemtrain.learn.reuse.ReuseRule`. False: one trajectory.
    """

    name: str
    result: Callable
    contributions: Callable
    records: Callable
    derive: Callable = _none
    inputs: Callable = _none
    after: Callable | None = None
    check: Callable = _no_check
    plot: Callable | None = None
    numbers: dict = dataclasses.field(default_factory=dict)
    pools: bool = False


def shared_contributions(batch: Sequence[int], results, params) -> dict:
    """The part of :attr:`Objective.contributions` every objective has.

    Args:
      batch: the indices of the update's state points.
      results: state point -> its host result on this process (the
        objective's ``result`` plus the loop's ``n_eff_start``,
        ``recomputed``, ``n_independent``, ``reuse_se``); state points of
        ``batch`` computed elsewhere are absent.
      params: the parameters (host), which give the gradient's structure.

    Returns:
      A dict: ``grad``, the gradient summed over this process's state points
      (float64), and per state point of the batch (zeros where computed
      elsewhere) ``loss``, ``n_eff`` (after and, as ``n_eff_start``, before a
      recompute), ``recomputed``, ``n_independent`` and ``reuse_se`` of the
      trajectory it started from (:mod:`chemtrain.learn.reuse`) and
      ``nbr_overflow``: arrays of the batch's length, so the sum over
      processes is the whole batch.
    """
    n = len(batch)
    out = {"grad": jax.tree.map(lambda p: np.zeros(np.shape(p), np.float64), params),
           **{k: np.zeros(n) for k in ("loss", "n_eff", "n_eff_start", "recomputed",
                                       "nbr_overflow", "n_independent", "reuse_se")}}
    for j, i in enumerate(batch):
        if i not in results:
            continue
        r = results[i]
        out["grad"] = jax.tree.map(np.add, out["grad"], r["grad"])
        out["loss"][j], out["n_eff"][j] = r["loss"], r["aux"]["n_eff"]
        out["n_eff_start"][j], out["recomputed"][j] = r["n_eff_start"], r["recomputed"]
        out["n_independent"][j] = r.get("n_independent", 0.0)
        out["reuse_se"][j] = r.get("reuse_se", 0.0)
        out["nbr_overflow"][j] = r["aux"]["nbr_overflow"]
    return out


def reuse_record(summed, j: int, statepoint, update: int) -> dict:
    """The entries of a state point's history record that the loop's
    bookkeeping gives.

    Args:
      summed: :func:`shared_contributions` summed over processes.
      j: the state point's position in the update's batch.
      statepoint: the :class:`~chemtrain.learn.StatePoint`.
      update: the update's index.

    Returns:
      A dict: ``statepoint`` (its index), ``update``, ``n_eff`` before any
      recompute, ``n_snapshots``, ``recomputed`` and the reuse measures
      ``n_independent`` and ``reuse_se`` of the trajectory it started from.
    """
    return {"statepoint": statepoint.index, "update": update,
            "n_eff": float(summed["n_eff_start"][j]), "n_snapshots": statepoint.n_snapshots,
            "recomputed": bool(summed["recomputed"][j]),
            "n_independent": float(summed["n_independent"][j]),
            "reuse_se": float(summed["reuse_se"][j])}

