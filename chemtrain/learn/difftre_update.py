"""One DiffTRe update as pure functions of a state point
(:class:`chemtrain.trainers.StatePoint`, frozen), its trajectories and the
parameters: the loss and gradient of one state point
(:func:`fixed_quantities`, :func:`loss_and_grad`), what each process
contributes (one pytree that a sum over processes reduces), the batch's
loss and mean gradient, the decision whether the update may be applied,
the step-size search and the per-state-point records of the history.

The trainer (:mod:`chemtrain.trainers.difftre_core`) calls
:func:`loss_and_grad` for its own state points (recomputing trajectories
where N_eff is too small), :func:`contributions`, sums the result over
processes, then :func:`mean_gradient`, :func:`failure`, optionally
:func:`step_size`, and :func:`records`. Nothing here knows how the state
points were spread over processes: a reduction over them is passed in.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import box_kwargs, energy_kwargs
from . import difftre as dt
from .diagnose import all_finite, energy_gradient_note, nonfinite_predictions_note


def host64(tree):
    """Host copy of a pytree, floating leaves in float64 (sums over
    processes and state points in one precision)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(
        np.asarray(a).dtype, np.floating) else np.asarray(a), tree)


def chains_of(trajs):
    """(snapshots, neighbor list) of each chain's trajectory."""
    return [(t.snapshots, t.nbrs) for t in trajs]


def energies_of(trajs):
    """The reference energies of every snapshot of all chains, in order."""
    return jnp.concatenate([jnp.ravel(t.U_ref) for t in trajs])


def fixed_quantities(sp, params, trajs):
    """``(values, n_overflow)``: the quantities of state point ``sp`` that
    ignore the potential (RDF, ADF, density), evaluated on ``trajs``, and
    how often their neighbor lists overflowed. Valid until the trajectories
    change, whatever the parameters."""
    sp.fns.prepare(trajs, sp.state_kwargs)
    _, values, n_overflow = sp.fns.fixed_values(params, chains_of(trajs), sp.state_kwargs)
    return values, n_overflow


def loss_and_grad(sp, params, trajs, fixed=None):
    """``(loss, aux), grad`` of state point ``sp`` reweighted from ``trajs``
    (one :class:`~chemtrain.simulate.TrajState` per chain) to ``params``.
    ``aux`` holds ``n_eff``, ``parts``, ``predictions`` and
    ``nbr_overflow``; ``fixed`` is :func:`fixed_quantities` of the same
    trajectories (computed here when None)."""
    sp.fns.prepare(trajs, sp.state_kwargs)
    values, n_overflow = fixed_quantities(sp, params, trajs) if fixed is None else fixed
    (loss, aux), grad = sp.fns.loss_and_grad(params, chains_of(trajs), energies_of(trajs),
                                             sp.target_values, sp.state_kwargs, values)
    return (loss, dict(aux, nbr_overflow=aux["nbr_overflow"] + n_overflow)), grad


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
    violations = (dt.step_size_violations(np.array(table), np.asarray(n_eff_now, np.float64),
                                          allowed_reduction)
                  if table else np.zeros(len(candidates), np.int64))
    return dt.choose_step_size(candidates, reduce(violations))


def contributions(batch: Sequence[int], results: Mapping[int, Mapping], params,
                  names: Sequence[str], target_shapes: Sequence[Mapping]) -> dict:
    """This process's share of one update over the state points ``batch``.

    ``results`` maps the state points computed here to their host results
    (``loss``, ``grad``, ``aux`` with ``n_eff``, ``nbr_overflow``, ``parts``
    and ``predictions``, ``n_eff_start``, ``recomputed``); ``params`` (host)
    gives the gradient's structure, ``target_shapes`` the shape of each
    target per state point of the batch. Entries of state points computed
    elsewhere are zeros, so the element-wise sum over processes is the whole
    batch: the gradient summed over its state points, and per state point
    its loss, N_eff (after and before a recompute), whether it was
    recomputed, the decorrelated samples of the trajectory it started from
    and how far (in its standard errors) the parameters had moved from it,
    neighbor-list overflows, loss parts (NaN without a part, e.g. under a
    custom ``loss_fn``) and predictions.
    """
    n = len(batch)
    out = {"grad": jax.tree.map(lambda p: np.zeros(np.shape(p), np.float64), params),
           "loss": np.zeros(n), "n_eff": np.zeros(n), "n_eff_start": np.zeros(n),
           "recomputed": np.zeros(n), "nbr_overflow": np.zeros(n),
           "n_independent": np.zeros(n), "reuse_se": np.zeros(n),
           "parts": {k: np.zeros(n) for k in names},
           "pred": [{k: np.zeros(shapes[k]) for k in names} for shapes in target_shapes]}
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
        for k in names:
            out["parts"][k][j] = r["aux"]["parts"].get(k, np.nan)
            out["pred"][j][k] = np.asarray(r["aux"]["predictions"][k]).reshape(
                out["pred"][j][k].shape)
    return out


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
        return f"The neighbor list overflowed on stored snapshots of state point(s) {bad} in {where}."
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
    note = nonfinite_predictions_note(aux["predictions"], sp.fns.quantities)
    if note:
        notes.append(note)
    if not all_finite(aux["weights"]):
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


def records(summed: Mapping, batch: Sequence[int], update: int, names: Sequence[str],
            n_snapshots: Sequence[int], targets: Sequence[Mapping]) -> dict:
    """State point -> its record of the update (the history's per-state-point
    entries): loss, loss parts, N_eff before any recompute, the number of
    snapshots, whether it was recomputed (with ``n_independent`` and
    ``reuse_se`` of the trajectory it started from), predictions and targets."""
    out = {}
    for j, i in enumerate(batch):
        pred = summed["pred"][j]
        out[i] = {"statepoint": i, "update": update, "loss": float(summed["loss"][j]),
                  "parts": {k: float(summed["parts"][k][j]) for k in names
                            if not np.isnan(summed["parts"][k][j])},  # none with loss_fn
                  "n_eff": float(summed["n_eff_start"][j]), "n_snapshots": n_snapshots[j],
                  "recomputed": bool(summed["recomputed"][j]),
                  "n_independent": float(summed["n_independent"][j]),
                  "reuse_se": float(summed["reuse_se"][j]),
                  "predictions": {k: pred[k].tolist() for k in names},
                  "targets": {k: np.asarray(targets[j][k]).tolist() for k in names}}
    return out
