"""Force matching as pure functions: predictions, per-structure losses, and
metric sums, all for one shard of a padded batch.

A batch is a dict of arrays with a leading sample axis: ``R``, targets ``U``
and ``F``, optional per-sample weights, ``_valid`` (padded samples are
False), and every other key is passed to the energy function as a keyword
argument (``species``, ``box``, ``mask``, ...). With a per-atom ``mask``,
padded atoms lose their neighbor-list edges and their force errors.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..data.loader import VALID

TARGETS = ("U", "F")


def check_gammas(gammas: Mapping[str, float] | None) -> dict:
    """Loss weights per target (default U and F 1.0), each finite and >= 0."""
    gammas = dict({"U": 1.0, "F": 1.0} if gammas is None else gammas)
    for t, g in gammas.items():
        if t not in TARGETS:
            raise ValueError(f"Unknown target {t!r} in gammas; force matching trains {TARGETS}.")
        if not (isinstance(g, (int, float, np.number)) and np.isfinite(g) and g >= 0):
            raise ValueError(f"gammas[{t!r}] = {g!r} must be a finite number >= 0 (a loss "
                             f"weight); leave a target out of gammas to not train on it.")
    return gammas


def mask_neighbors(nbrs, mask):
    """Point every neighbor-list edge that touches a padded atom at the
    sentinel index N, so that padded atoms have no neighbors."""
    n = mask.shape[0]
    real = jnp.concatenate([mask.astype(bool), jnp.zeros((1,), bool)])
    from jax_md import partition
    idx = nbrs.idx
    if partition.is_sparse(nbrs.format):
        keep = real[idx[0]] & real[idx[1]]
    else:
        keep = real[:n, None] & real[idx]
    return dataclasses.replace(nbrs, idx=jnp.where(keep, idx, n))


def energy_kwargs(batch: Mapping, exclude) -> dict:
    """The batch entries that go to the energy function as keyword arguments."""
    return {k: v for k, v in batch.items() if k not in exclude}


def make_predictor(energy_fn_template: Callable, nbrs_init, vary: Callable = lambda t: t) -> Callable:
    """Return ``predict(params, R, kwargs) -> ({'U', 'F'}, nbr_error)`` for a
    batch of structures (vmapped over the leading axis of ``R`` and kwargs).

    Energy and forces come from one ``value_and_grad``; ``nbr_error`` is True
    where the neighbor list overflowed or was otherwise invalid. ``vary`` is
    the strategy's :meth:`~chemtrain.parallel.base.Strategy.vary`: the
    neighbor-list template becomes per-shard data, as jax-md's update mixes
    it with per-shard positions in one ``lax.cond``.
    """

    def one(params, nbrs0, R, kwargs):
        energy_fn = energy_fn_template(params)
        nbrs = nbrs0.update(R, **({"box": kwargs["box"]} if "box" in kwargs else {}))
        if "mask" in kwargs:
            nbrs = mask_neighbors(nbrs, kwargs["mask"])
        U, dU = jax.value_and_grad(lambda r: energy_fn(r, neighbor=nbrs, **kwargs))(R)
        return {"U": U, "F": -dU}, nbrs.error.code != 0

    def predict(params, R, kwargs):
        return jax.vmap(one, in_axes=(None, None, 0, 0))(params, vary(nbrs_init), R, kwargs)

    return predict


def per_sample_errors(pred: Mapping, batch: Mapping, targets) -> dict:
    """Mean squared error of each target for each structure (shape (b,)).

    Forces average over the real atoms of a structure (the ``mask``), so a
    padded structure has the same loss as the unpadded one.
    """
    out = {}
    for t in targets:
        if t == "U":
            out[t] = (pred["U"] - batch["U"]) ** 2
        elif t == "F":
            sq = jnp.sum((pred["F"] - batch["F"]) ** 2, axis=-1)
            if "mask" in batch:
                m = batch["mask"].astype(sq.dtype)
                out[t] = jnp.sum(sq * m, axis=-1) / (3.0 * jnp.maximum(jnp.sum(m, axis=-1), 1.0))
            else:
                out[t] = jnp.mean(sq, axis=-1) / 3.0
        else:
            raise ValueError(f"Unknown target {t!r}; force matching knows {TARGETS}.")
    return out


def make_shard_loss(predict: Callable, gammas: Mapping[str, float],
                    weights_keys: Mapping[str, str], inputs_exclude) -> Callable:
    """Return ``loss(params, batch) -> (loss, aux)`` of one shard.

    The loss is ``sum_t gamma_t * sum_i valid_i w_ti mse_ti / capacity`` with
    the shard's fixed capacity (rows), so the mean over shards is the loss of
    the global batch. ``aux`` has the per-target parts and the number of
    structures whose neighbor list failed.
    """
    targets = tuple(gammas)

    def loss_fn(params, batch):
        pred, nbr_error = predict(params, batch["R"], energy_kwargs(batch, inputs_exclude))
        valid = batch[VALID]
        capacity = valid.shape[0]
        errors = per_sample_errors(pred, batch, targets)
        parts = {}
        for t in targets:
            w = valid.astype(errors[t].dtype)
            if t in weights_keys:
                w = w * batch[weights_keys[t]]
            parts[t] = jnp.sum(w * errors[t]) / capacity
        loss = sum(gammas[t] * parts[t] for t in targets)
        return loss, {"parts": parts, "nbr_errors": jnp.sum(nbr_error & valid)}

    return loss_fn


def make_metric_sums(predict: Callable, gammas: Mapping[str, float],
                     weights_keys: Mapping[str, str], inputs_exclude) -> Callable:
    """Return ``sums(params, batch)``: per-shard sums for exact global metrics.

    For each target: sum of absolute and squared errors and the number of
    values; plus the summed per-structure loss and number of valid structures.
    Dividing the global sums once gives MAE, RMSE and the mean loss whatever
    the padding.
    """
    targets = tuple(gammas)

    def sums(params, batch):
        pred, nbr_error = predict(params, batch["R"], energy_kwargs(batch, inputs_exclude))
        valid = batch[VALID]
        fvalid = valid.astype(pred["U"].dtype)
        errors = per_sample_errors(pred, batch, targets)
        out = {"n": jnp.sum(fvalid), "nbr_errors": jnp.sum(nbr_error & valid)}
        loss = 0.0
        for t in targets:
            w = fvalid * (batch[weights_keys[t]] if t in weights_keys else 1.0)
            loss = loss + gammas[t] * jnp.sum(w * errors[t])
            d = pred[t] - batch[t]
            if t == "U":
                m = fvalid
            else:
                atom = batch["mask"].astype(d.dtype) if "mask" in batch else jnp.ones(d.shape[:2], d.dtype)
                m = (atom * fvalid[:, None])[..., None] * jnp.ones_like(d)
            out[t] = {"abs": jnp.sum(jnp.abs(d) * m), "sq": jnp.sum(d * d * m), "count": jnp.sum(m)}
        out["loss"] = loss
        return out

    return sums


def finish_metrics(sums: Mapping, targets) -> dict:
    """Turn globally summed metric sums into MAE/RMSE per target and the loss."""
    n = float(sums["n"])
    out = {"loss": float(sums["loss"]) / max(n, 1.0), "n_structures": int(n)}
    for t in targets:
        c = max(float(sums[t]["count"]), 1.0)
        out[t] = {"MAE": float(sums[t]["abs"]) / c, "RMSE": float(np.sqrt(float(sums[t]["sq"]) / c))}
    return out


def failed_step_message(nbr_errors: int, loss: float, where: str) -> str:
    """Why a step was not applied, and what to do about it."""
    if nbr_errors:
        return (f"The neighbor list overflowed (or saw an invalid box) for {nbr_errors} "
                f"structure(s) in {where}. Allocate nbrs_init on the densest, largest structure "
                f"with a larger capacity_multiplier.")
    return (f"The loss is {loss} in {where}. Lower the learning rate or check the data and "
            f"the energy function.")
