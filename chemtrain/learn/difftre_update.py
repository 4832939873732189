"""One DiffTRe update after the state points were computed, as pure
functions on host data: what each process contributes (one pytree that a
sum over processes reduces), the batch's loss and mean gradient, the
decision whether the update may be applied, and the per-state-point
records of the history.

The trainer (:mod:`chemtrain.trainers.difftre_core`) computes the loss
and gradient of its own state points (:mod:`chemtrain.learn.difftre`),
calls :func:`contributions`, sums the result over processes, then
:func:`mean_gradient`, :func:`failure` and :func:`records`. Nothing here
knows how the state points were spread over processes.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np


def host64(tree):
    """Host copy of a pytree, floating leaves in float64 (sums over
    processes and state points in one precision)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(
        np.asarray(a).dtype, np.floating) else np.asarray(a), tree)


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
    recomputed, neighbor-list overflows, loss parts (NaN without a part,
    e.g. under a custom ``loss_fn``) and predictions.
    """
    n = len(batch)
    out = {"grad": jax.tree.map(lambda p: np.zeros(np.shape(p), np.float64), params),
           "loss": np.zeros(n), "n_eff": np.zeros(n), "n_eff_start": np.zeros(n),
           "recomputed": np.zeros(n), "nbr_overflow": np.zeros(n),
           "parts": {k: np.zeros(n) for k in names},
           "pred": [{k: np.zeros(shapes[k]) for k in names} for shapes in target_shapes]}
    for j, i in enumerate(batch):
        if i not in results:
            continue
        r = results[i]
        out["grad"] = jax.tree.map(np.add, out["grad"], r["grad"])
        out["loss"][j], out["n_eff"][j] = r["loss"], r["aux"]["n_eff"]
        out["n_eff_start"][j], out["recomputed"][j] = r["n_eff_start"], r["recomputed"]
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


def records(summed: Mapping, batch: Sequence[int], update: int, names: Sequence[str],
            n_snapshots: Sequence[int], targets: Sequence[Mapping]) -> dict:
    """State point -> its record of the update (the history's per-state-point
    entries): loss, loss parts, N_eff before any recompute, the number of
    snapshots, whether it was recomputed, predictions and targets."""
    out = {}
    for j, i in enumerate(batch):
        pred = summed["pred"][j]
        out[i] = {"statepoint": i, "update": update, "loss": float(summed["loss"][j]),
                  "parts": {k: float(summed["parts"][k][j]) for k in names
                            if not np.isnan(summed["parts"][k][j])},  # none with loss_fn
                  "n_eff": float(summed["n_eff_start"][j]), "n_snapshots": n_snapshots[j],
                  "recomputed": bool(summed["recomputed"][j]),
                  "predictions": {k: pred[k].tolist() for k in names},
                  "targets": {k: np.asarray(targets[j][k]).tolist() for k in names}}
    return out
