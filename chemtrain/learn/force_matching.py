"""Force matching as pure functions: predictions, per-structure losses, and
metric sums, all for one shard of a padded batch.

A batch is a dict of arrays with a leading sample axis: ``R``, targets ``U``,
``F`` and ``stress``, optional per-sample weights, ``_valid`` (padded
samples are False), and every other key is passed to the energy function as
a keyword argument (``species``, ``box``, ``mask``, ...). With a per-atom
``mask``, padded atoms lose their edges and their force errors.

Edges come from precomputed graphs (:class:`~chemtrain.neighbors.Graph`)
when the batch holds ``senders``, ``receivers`` and ``shifts``, else from a
jax-md neighbor list updated for every structure.

Stress (kJ/mol/nm^3, ASE's sign: ``(1/V) dE/d(strain)``) is the derivative
of the energy with respect to jax-md's ``perturbation`` ``I + strain``
(symmetric), which the energy function must apply to its edge vectors (the
project's templates do). Structures without a cell (volume 0, molecules)
predict zero stress and never enter a stress loss or metric.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..data.loader import VALID
from ..ensemble import volume
from ..neighbors import GRAPH_KEYS, graph_from, mask_graph
from .losses import TargetLoss
from .step import make_update

TARGETS = ("U", "F", "stress")


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


def batch_kwargs(batch: Mapping, exclude) -> dict:
    """The batch entries that go to the energy function as keyword arguments."""
    return {k: v for k, v in batch.items() if k not in exclude}


def _require_box(kwargs):
    if "box" not in kwargs:
        raise ValueError("A stress target needs each structure's cell: add 'box' (structures, "
                         "3, 3) to the data (zeros for structures without a cell).")


def _deformation(strain):
    """The cell's deformation ``1 + sym(strain)`` (last two axes 3x3)."""
    sym = 0.5 * (strain + jnp.swapaxes(strain, -1, -2))
    return jnp.eye(3, dtype=strain.dtype) + sym


def _stress(dS, box):
    """``(stress, has_cell)`` of one structure from its energy's derivative
    by the strain: ``dS / V``, zero where the structure has no cell."""
    V = volume(box).astype(dS.dtype)
    has = V > 0
    return jnp.where(has, dS / jnp.where(has, V, 1.0), 0.0), has


def make_predictor(energy_fn_template: Callable, nbrs_init, vary: Callable = lambda t: t) -> Callable:
    """Return ``predict(params, R, kwargs, stress=False) -> (pred, nbr_error)``
    for a batch of structures (the leading axis of ``R`` and kwargs);
    ``pred`` holds ``U`` and ``F`` and, with ``stress``, ``stress``
    (3x3) and ``has_stress`` (the structure has a cell).

    Energy, forces and stress come from one ``value_and_grad``; a template
    with :attr:`~chemtrain.models.EnergyTemplate.batched` energies evaluates
    the whole batch at once (MACE: one disjoint graph), others are vmapped;
    ``nbr_error`` is True where the neighbor list overflowed or was
    otherwise invalid (never with precomputed graphs, for which
    ``nbrs_init`` may be None). ``vary`` is the strategy's
    :meth:`~chemtrain.parallel.base.Strategy.vary`: the neighbor-list
    template becomes per-shard data, as jax-md's update mixes it with
    per-shard positions in one ``lax.cond``.
    """

    def neighbors_of(nbrs0, R, kwargs):
        if all(k in kwargs for k in GRAPH_KEYS):
            nbrs, error = graph_from(kwargs), jnp.zeros((), bool)
            kwargs = {k: v for k, v in kwargs.items() if k not in GRAPH_KEYS}
            if "mask" in kwargs:
                nbrs = mask_graph(nbrs, kwargs["mask"])
            return nbrs, error, kwargs
        if nbrs0 is None:
            raise ValueError("nbrs_init is None, so every batch must carry precomputed graphs "
                             f"{GRAPH_KEYS}; this one has {sorted(kwargs)}. Add them with "
                             "chemtrain.neighbors.add_graphs(data, cutoff) or pass a jax-md "
                             "neighbor list as nbrs_init.")
        nbrs = nbrs0.update(R, **({"box": kwargs["box"]} if "box" in kwargs else {}))
        if "mask" in kwargs:
            nbrs = mask_neighbors(nbrs, kwargs["mask"])
        return nbrs, nbrs.error.code != 0, kwargs

    def one(params, nbrs0, R, kwargs, strain0):
        energy_fn = energy_fn_template(params)
        nbrs, error, kwargs = neighbors_of(nbrs0, R, kwargs)
        if strain0 is None:
            U, dU = jax.value_and_grad(lambda r: energy_fn(r, neighbor=nbrs, **kwargs))(R)
            return {"U": U, "F": -dU}, error
        _require_box(kwargs)

        def energy(r, strain):
            return energy_fn(r, neighbor=nbrs, perturbation=_deformation(strain), **kwargs)
        U, (dU, dS) = jax.value_and_grad(energy, argnums=(0, 1))(R, strain0)
        sigma, has = _stress(dS, kwargs["box"])
        return {"U": U, "F": -dU, "stress": sigma, "has_stress": has}, error

    batched = getattr(energy_fn_template, "batched", None)

    def whole_batch(params, nbrs0, R, kwargs, strain0):
        # the template's batched energies: every structure's energy depends
        # on its own positions and strain only, so the gradient of their sum
        # holds each structure's forces and strain derivative
        graphs, error, kwargs = jax.vmap(neighbors_of, in_axes=(None, 0, 0))(nbrs0, R, kwargs)
        energies = batched(params)
        if strain0 is None:
            def total(r):
                U = energies(r, graphs, **kwargs)
                return jnp.sum(U), U
            (_, U), dU = jax.value_and_grad(total, has_aux=True)(R)
            return {"U": U, "F": -dU}, error
        _require_box(kwargs)

        def total_strained(r, strain):
            U = energies(r, graphs, perturbation=_deformation(strain), **kwargs)
            return jnp.sum(U), U
        (_, U), (dU, dS) = jax.value_and_grad(total_strained, argnums=(0, 1), has_aux=True)(
            R, strain0)
        sigma, has = jax.vmap(_stress)(dS, kwargs["box"])
        return {"U": U, "F": -dU, "stress": sigma, "has_stress": has}, error

    def predict(params, R, kwargs, stress=False):
        # the zero strain is per-shard data: a replicated one would have its
        # derivative summed over the shards by shard_map's transpose
        strain0 = vary(jnp.zeros((R.shape[0], 3, 3), R.dtype)) if stress else None
        if batched is not None and (nbrs_init is not None or all(k in kwargs for k in GRAPH_KEYS)):
            return whole_batch(params, vary(nbrs_init), R, kwargs, strain0)
        return jax.vmap(one, in_axes=(None, None, 0, 0, 0))(params, vary(nbrs_init), R, kwargs,
                                                           strain0)

    return predict


def per_sample_errors(pred: Mapping, batch: Mapping, targets, losses: Mapping | None = None
                      ) -> dict:
    """Mean elementwise loss of each target for each structure (shape (b,)):
    the mean squared error unless ``losses`` (``{target: TargetLoss}``,
    :mod:`chemtrain.learn.losses`) says otherwise.

    Forces average over the real atoms of a structure (the ``mask``), so a
    padded structure has the same loss as the unpadded one.
    """
    out = {}
    for t in targets:
        spec = (losses or {}).get(t, TargetLoss())
        if t not in TARGETS:
            raise ValueError(f"Unknown target {t!r}; force matching knows {TARGETS}.")
        r = pred[t] - batch[t]
        if t == "U":
            if spec.per_atom:
                n = (jnp.sum(batch["mask"].astype(r.dtype), axis=-1) if "mask" in batch
                     else jnp.asarray(batch["R"].shape[-2], r.dtype))
                r, ref = r / jnp.maximum(n, 1.0), batch[t] / jnp.maximum(n, 1.0)
            else:
                ref = batch[t]
            out[t] = spec.fn(r, ref)
        elif t == "stress":
            out[t] = jnp.mean(spec.fn(r, batch[t]), axis=(-2, -1))
        else:
            sq = jnp.sum(spec.fn(r, batch[t]), axis=-1)
            if "mask" in batch:
                m = batch["mask"].astype(sq.dtype)
                out[t] = jnp.sum(sq * m, axis=-1) / (3.0 * jnp.maximum(jnp.sum(m, axis=-1), 1.0))
            else:
                out[t] = jnp.mean(sq, axis=-1) / 3.0
    return out


def sample_weights(pred: Mapping, batch: Mapping, target: str, weights_keys: Mapping[str, str],
                   dtype):
    """Per-structure weight of a target's error: valid samples, times the
    data's weights (``weights_keys``), times, for stress, whether the
    structure has a cell."""
    w = batch[VALID].astype(dtype)
    if target in weights_keys:
        w = w * batch[weights_keys[target]]
    if target == "stress":
        w = w * pred["has_stress"].astype(dtype)
    return w


def make_shard_loss(predict: Callable, gammas: Mapping[str, float],
                    weights_keys: Mapping[str, str], inputs_exclude,
                    losses: Mapping | None = None) -> Callable:
    """Return ``loss(params, batch) -> (loss, aux)`` of one shard.

    The loss is ``sum_t gamma_t * sum_i valid_i w_ti mse_ti / capacity`` with
    the shard's fixed capacity (rows), so the mean over shards is the loss of
    the global batch. ``aux`` has the per-target parts and the number of
    structures whose neighbor list failed.
    """
    targets = tuple(gammas)

    def loss_fn(params, batch):
        pred, nbr_error = predict(params, batch["R"], batch_kwargs(batch, inputs_exclude),
                                  stress="stress" in targets)
        valid = batch[VALID]
        capacity = valid.shape[0]
        errors = per_sample_errors(pred, batch, targets, losses)
        parts = {}
        for t in targets:
            w = sample_weights(pred, batch, t, weights_keys, errors[t].dtype)
            parts[t] = jnp.sum(w * errors[t]) / capacity
        loss = sum(gammas[t] * parts[t] for t in targets)
        return loss, {"parts": parts, "nbr_errors": jnp.sum(nbr_error & valid)}

    return loss_fn


def metric_sums(given, batch: Mapping, gammas: Mapping[str, float],
                weights_keys: Mapping[str, str], losses: Mapping | None = None) -> dict:
    """Per-shard sums for exact global metrics of predictions already made,
    ``given = (pred, nbr_error)`` of :func:`make_predictor`.

    For each target: sum of absolute and squared errors and the number of
    values (stress: of structures with a cell and a weight above 0); plus
    the summed per-structure loss and number of valid structures. Dividing
    the global sums once gives MAE, RMSE and the mean loss whatever the
    padding.
    """
    pred, nbr_error = given
    targets = tuple(gammas)
    valid = batch[VALID]
    fvalid = valid.astype(pred["U"].dtype)
    errors = per_sample_errors(pred, batch, targets, losses)
    out = {"n": jnp.sum(fvalid), "nbr_errors": jnp.sum(nbr_error & valid)}
    loss = 0.0
    for t in targets:
        w = sample_weights(pred, batch, t, weights_keys, fvalid.dtype)
        loss = loss + gammas[t] * jnp.sum(w * errors[t])
        d = pred[t] - batch[t]
        if t == "U":
            m = fvalid
        elif t == "stress":  # structures with a cell and a stress label
            m = (w > 0).astype(d.dtype)[:, None, None] * jnp.ones_like(d)
        else:
            atom = batch["mask"].astype(d.dtype) if "mask" in batch else jnp.ones(d.shape[:2], d.dtype)
            m = (atom * fvalid[:, None])[..., None] * jnp.ones_like(d)
        out[t] = {"abs": jnp.sum(jnp.abs(d) * m), "sq": jnp.sum(d * d * m), "count": jnp.sum(m)}
    out["loss"] = loss
    return out


def make_evaluation(model: Callable, sums_of: Callable, strategy, exclude) -> tuple:
    """Compile a stage's metric sums as two programs: ``model(params,
    inputs)`` (the energy model's per-row outputs, the one costly program,
    also what predictions are read from) and ``sums_of(outputs, batch)``
    (the metrics, summed over shards). The model sees only its inputs
    (``R`` and the batch's other keys not in ``exclude``: no targets,
    weights or padding flags), so validation, test metrics and predictions
    of labelled or unlabelled data share one compiled model instead of
    each compiling its own.

    Returns:
      ``(sums, outputs)``: ``sums(params, batch)`` and ``outputs(params,
      batch)``, per shard as :meth:`~chemtrain.parallel.base.Strategy.compile`
      makes them.
    """
    compiled = strategy.compile(model, in_sharded=(False, True), out_sharded=True)
    reduce = strategy.compile(lambda out, b: strategy.sum(sums_of(out, b)),
                              in_sharded=(True, True), out_sharded=False)

    def outputs(params, batch):
        return compiled(params, {k: v for k, v in batch.items() if k == "R" or k not in exclude})
    return (lambda params, batch: reduce(outputs(params, batch), batch)), outputs


def finish_metrics(sums: Mapping, targets) -> dict:
    """Turn globally summed metric sums into MAE/RMSE per target and the loss."""
    n = float(sums["n"])
    out = {"loss": float(sums["loss"]) / max(n, 1.0), "n_structures": int(n)}
    for t in targets:
        c = max(float(sums[t]["count"]), 1.0)
        out[t] = {"MAE": float(sums[t]["abs"]) / c, "RMSE": float(np.sqrt(float(sums[t]["sq"]) / c))}
    return out


def failed_step_message(nbr_errors: int, loss: float, where: str, grad_ok: bool = True,
                        update_ok: bool = True) -> str:
    """Why a step was not applied, and what to do about it."""
    if nbr_errors:
        return (f"The neighbor list overflowed (or saw an invalid box) for {nbr_errors} "
                f"structure(s) in {where}. Allocate nbrs_init on the densest, largest structure "
                f"with a larger capacity_multiplier.")
    if grad_ok and np.isfinite(loss) and not update_ok:
        return (f"The optimizer's update gives non-finite parameters or optimizer state in "
                f"{where}, from a finite loss ({loss:.6g}) and gradient: a learning rate or "
                f"schedule that gives NaN or inf, or a gradient so large that the optimizer's "
                f"moments overflow (a structure with overlapping atoms?). Check the data and "
                f"the optimizer.")
    return (f"The loss is {loss} (gradient finite: {grad_ok}) in {where}. Lower the learning "
            f"rate or check the data and the energy function.")


@dataclasses.dataclass(frozen=True)
class TrainerFunctions:
    """What a force-matching trainer computes, as one value: the compiled
    step and metric sums, predictions, how a stage's summed metrics and an
    epoch's training sums are read, and the training loader it needs.
    :func:`trainer_functions` gives one model's; a committee's come from
    :func:`chemtrain.learn.ensemble.trainer_functions`.

    Attributes:
      update: compiled ``(params, opt_state, batch) -> (params, opt_state,
        stats)`` (:func:`chemtrain.learn.step.make_update`).
      sums: ``(params, batch) -> metric sums``, summed over shards.
      predict: ``(params, batch) -> predictions`` (per row; with a stress
        target also ``stress`` and ``has_stress``). Both run one compiled
        model program (:func:`make_evaluation`).
      finish: ``(host sums, gammas) -> metrics`` of a stage.
      train_record: ``(host step sums, n_steps, gammas) -> dict`` with
        ``train_loss`` and ``train_parts`` (and whatever else the epoch
        record gets).
      training_loader: ``loader -> loader`` the training stage uses.
      val_record: ``(validation metrics, gammas) -> dict``, what the epoch
        record gets of them (one model's: ``val``, per target).
    """

    update: Callable
    sums: Callable
    predict: Callable
    finish: Callable
    train_record: Callable
    training_loader: Callable = lambda loader: loader
    val_record: Callable = lambda val, gammas: {"val": {t: val[t] for t in gammas}}


def train_record(host: Mapping, n_steps: int, gammas) -> dict:
    """One model's epoch: the mean loss and per-target parts of its steps."""
    return {"train_loss": float(host["loss"]) / n_steps,
            "train_parts": {t: float(host["parts"][t]) / n_steps for t in gammas}}


def trainer_functions(template, nbrs_init, optimizer, strategy, gammas: Mapping,
                      weights_keys: Mapping, exclude, losses: Mapping | None = None
                      ) -> TrainerFunctions:
    """The :class:`TrainerFunctions` of one model trained by force matching.

    Args:
      template: the :class:`~chemtrain.models.EnergyTemplate`.
      nbrs_init: the jax-md neighbor list, or None (graphs in the data).
      optimizer: the optax transformation.
      strategy: the run's parallel strategy.
      gammas: loss weight per target.
      weights_keys: ``{target: dataset key}`` of per-structure weights.
      exclude: dataset keys that are not the energy function's keywords.
      losses: ``{target: TargetLoss}`` (:mod:`chemtrain.learn.losses`);
        None: squared errors.

    Returns:
      Its :class:`TrainerFunctions`.
    """
    predict = make_predictor(template, nbrs_init, strategy.vary)
    loss_fn = make_shard_loss(predict, gammas, weights_keys, exclude, losses)
    stress = "stress" in gammas
    sums, outputs = make_evaluation(
        lambda p, b: predict(p, b["R"], batch_kwargs(b, exclude), stress=stress),
        lambda given, b: metric_sums(given, b, gammas, weights_keys, losses), strategy, exclude)
    return TrainerFunctions(
        update=make_update(loss_fn, optimizer, strategy), sums=sums,
        predict=lambda p, b: outputs(p, b)[0], finish=finish_metrics, train_record=train_record)
