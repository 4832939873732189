"""One update of the reweighting loop (:class:`chemtrain.trainers.Reweighting`)
as pure functions shared by every objective: host copies for sums over
processes, the batch's loss and mean gradient, the decision whether the
update may be applied (:func:`failure`, with :func:`diagnosis` of a
non-finite result), and the step-size search (:class:`StepSizeSearch`,
:func:`step_size`). Nothing here knows how the state points were spread
over processes: a reduction over them is passed in.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import box_kwargs, energy_kwargs
from .reweighting import choose_step_size, step_size_candidates, step_size_violations
from .diagnose import all_finite, energy_gradient_note, nonfinite_predictions_note


@dataclasses.dataclass(frozen=True)
class StepSizeSearch:
    """The step-size policy of the reweighting trainers: each update is
    scaled down (1, 1/2, 1/4, ...) until N_eff keeps ``allowed_reduction``
    of its value at every state point of the batch.

    Attributes:
      candidates: the number of scales tried, 1, 1/2, ...,
        2**-(candidates - 1); at least 1.
      allowed_reduction: the fraction of N_eff, in (0, 1], that a scaled
        step must keep; if even the smallest candidate does not keep it,
        that smallest step is taken with a warning.
    """

    candidates: int = 10
    allowed_reduction: float = 0.5

    def __post_init__(self):
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, (int, np.integer)) \
                or self.candidates < 1:
            raise ValueError(f"StepSizeSearch: candidates must be a whole number >= 1 (the "
                             f"scales 1, 1/2, ... tried), got {self.candidates!r}.")
        if isinstance(self.allowed_reduction, bool) or not isinstance(
                self.allowed_reduction, (int, float)) or not 0.0 < self.allowed_reduction <= 1.0:
            raise ValueError(f"StepSizeSearch: allowed_reduction must be a number in (0, 1] "
                             f"(the fraction of N_eff a scaled step keeps), got "
                             f"{self.allowed_reduction!r}.")

    @property
    def scales(self) -> np.ndarray:
        """The candidate scales, largest first."""
        return step_size_candidates(self.candidates)


def host64(tree):
    """Host copy of a pytree, floating leaves in float64 (sums over
    processes and state points in one precision)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(
        np.asarray(a).dtype, np.floating) else np.asarray(a), tree)


def global_norm(tree) -> float:
    """The Euclidean norm of all leaves of a (host) pytree together."""
    return math.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(tree)))


def chains_of(trajs):
    """(snapshots, neighbor list) of each chain's trajectory."""
    return [(t.snapshots, t.nbrs) for t in trajs]


def energies_of(trajs):
    """The reference energies of every snapshot of all chains, in order; of
    pooled chains (:mod:`chemtrain.learn.pool`), ``(chains, slots, n)``."""
    if jnp.ndim(trajs[0].U_ref) == 2:
        return jnp.stack([t.U_ref for t in trajs])
    return jnp.concatenate([jnp.ravel(t.U_ref) for t in trajs])


def step_size(statepoints, trajectories, n_eff_now, params, updates, candidates,
              allowed_reduction: float, reduce: Callable = lambda v: v) -> tuple[float, bool]:
    """``(scale, found)``: the largest of ``candidates`` by which ``updates``
    may be scaled so that N_eff keeps ``allowed_reduction`` of its value
    ``n_eff_now`` at every state point of the batch (``found`` False: none
    does; the smallest is returned). This process evaluates its
    ``statepoints`` on their ``trajectories``; ``reduce`` sums the
    per-candidate violation counts over processes (e.g.
    ``strategy.host_sum``)."""
    scales = jnp.asarray(candidates)
    table = [np.asarray(sp.fns.n_eff_candidates(params, updates, scales, chains_of(trajs),
                                                energies_of(trajs), sp.state_kwargs))
             for sp, trajs in zip(statepoints, trajectories)]
    violations = (step_size_violations(np.array(table), np.asarray(n_eff_now, np.float64),
                                          allowed_reduction)
                  if table else np.zeros(len(candidates), np.int64))
    return choose_step_size(candidates, reduce(violations))


def batch_loss(summed: Mapping) -> float:
    """The update's loss: the mean over the batch's state points."""
    return float(np.sum(summed["loss"]) / len(summed["loss"]))


def mean_gradient(summed: Mapping):
    """The update's gradient: the mean over the batch's state points."""
    n = len(summed["loss"])
    return jax.tree.map(lambda g: g / n, summed["grad"])


def failure(summed: Mapping, batch: Sequence[int], where: str) -> str | None:
    """Why the update of ``batch`` must not be applied (neighbor-list
    overflow on stored snapshots, a non-finite loss or gradient), or None."""
    if np.any(summed["nbr_overflow"]):
        bad = [batch[j] for j in np.nonzero(summed["nbr_overflow"])[0]]
        return (f"The neighbor list overflowed on stored snapshots of state point(s) {bad} in "
                f"{where}.")
    loss = batch_loss(summed)
    finite_grad = all(np.all(np.isfinite(g)) for g in jax.tree.leaves(summed["grad"]))
    if math.isfinite(loss) and finite_grad:
        return None
    bad = [batch[j] for j in range(len(batch)) if not np.isfinite(summed["loss"][j])]
    return (f"The loss is {loss} (gradient finite: {finite_grad}) in {where}"
            + (f"; non-finite at state point(s) {bad}" if bad else "")
            + ". Lower the learning rate or check the targets and the potential.")


def finite(result) -> bool:
    """Whether a state point's loss and gradient (``result`` of
    :func:`loss_and_grad`, on the host) are finite."""
    return all_finite((result["loss"], result["grad"]))


def diagnosis(sp, params, trajs, result) -> list[str]:
    """Likely causes of a non-finite loss or gradient of state point ``sp``
    (its ``result`` from :func:`loss_and_grad` on ``trajs``), in words:
    observables that are NaN (with the reason a quantity gives), energies
    that are not finite, an energy whose parameter gradient is NaN on a
    padded neighbor list. Host work, run only after a failure."""
    aux, notes = result["aux"], []
    # the quantities of objectives that have them (DiffTRe's prepared functions)
    quantities = getattr(sp.functions, "quantities", None) or {}
    note = nonfinite_predictions_note(aux.get("predictions", {}), quantities)
    if note:
        notes.append(note)
    if "weights" in aux and not all_finite(aux["weights"]):
        notes.append("The reweighting weights are not finite: the energy of stored snapshots "
                     "is not finite at the new parameters.")
    if not all_finite(result["grad"]):
        first = jax.tree.map(lambda x: x[0], trajs[0].snapshots)
        nbrs = trajs[0].nbrs.update(first.position, **box_kwargs(first))
        note = energy_gradient_note(sp.fns.energy_fn_template, params, first.position, nbrs,
                                    **energy_kwargs(first, sp.state_kwargs))
        if note:
            notes.append(note)
    return notes
