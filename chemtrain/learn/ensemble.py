"""Committees of models as pure functions: K members of one energy template
whose parameters are stacked along a leading member axis, trained in one
vectorised step and evaluated together.

- :func:`stack_members` / :func:`member_params`: K parameter pytrees of one
  structure <-> one stacked pytree (leaves ``(K, ...)``).
- :func:`vectorized`: an optax transformation applied to every member
  separately (``vmap`` of its ``init`` and ``update``), so each member's
  optimizer state is its own, whatever the transformation (global-norm
  clipping included).
- :func:`member_loss`: the force-matching loss of one shard for K members
  at once; the batch holds, per row, one structure for each member
  (arrays ``(rows, K, ...)``), so each member sees its own data order.
- :func:`committee_predictor`: the members' mean prediction, with their
  spread (standard deviation over members, ``ddof=0``).

Which structures member ``k`` trains on, in which order, is
:mod:`chemtrain.data.members`'.

Units are those of the template (chemtrain's: nm, kJ/mol).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..data.loader import InMemoryLoader
from ..data.members import MemberLoader
from . import force_matching as fm
from .step import make_update


def stack_members(members: Sequence) -> object:
    """One pytree whose leaves stack the members' leaves on a new axis 0.

    Args:
      members: K >= 2 parameter pytrees of the same structure, shapes and
        dtypes.

    Returns:
      The stacked pytree, leaves ``(K, *leaf.shape)`` (numpy).

    Raises:
      ValueError: fewer than two members, or members that differ in
        structure, a leaf's shape or dtype (the first difference is named).
    """
    members = list(members)
    if len(members) < 2:
        raise ValueError(f"A committee needs at least 2 members, got {len(members)}: pass a list "
                         f"of K >= 2 initial parameter sets (e.g. init_params(key_k) for K keys).")
    first = jax.tree.structure(members[0])
    for k, m in enumerate(members[1:], 1):
        if jax.tree.structure(m) != first:
            raise ValueError(f"Member {k}'s parameters have another structure than member 0's: "
                             f"{jax.tree.structure(m)} against {first}. Every member must be "
                             f"made by the same template and initialiser.")
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(members[0])[0],
                                jax.tree.leaves(m)):
            if np.shape(a) != np.shape(b) or np.asarray(a).dtype != np.asarray(b).dtype:
                raise ValueError(
                    f"Member {k}'s parameter {jax.tree_util.keystr(path)} has shape "
                    f"{np.shape(b)} and dtype {np.asarray(b).dtype}, member 0's "
                    f"{np.shape(a)} and {np.asarray(a).dtype}: members must be one "
                    f"architecture (same template and sizes).")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *members)


def as_stacked(members):
    """A committee's parameters as one stacked pytree: a list or tuple of K
    member pytrees is stacked (:func:`stack_members`); anything else is taken
    as already stacked and must hold at least two members.

    Raises:
      ValueError: fewer than two members, or members that differ (named).
    """
    if isinstance(members, (list, tuple)):
        return stack_members(members)
    if n_members(members) < 2:
        raise ValueError(f"A committee needs at least 2 members, got {n_members(members)}.")
    return members


def n_members(stacked) -> int:
    """The number of members of a stacked pytree (its leaves' first axis)."""
    return int(np.shape(jax.tree.leaves(stacked)[0])[0])


def member_params(stacked, k: int):
    """Member ``k``'s parameters (host numpy) from a stacked pytree."""
    return jax.tree.map(lambda x: np.asarray(x)[k], stacked)


def vectorized(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """``optimizer`` applied to each member separately: ``init`` and
    ``update`` mapped over the leading member axis of parameters, updates
    and state."""
    return optax.GradientTransformation(jax.vmap(optimizer.init), jax.vmap(optimizer.update))


def member_loss(shard_loss: Callable) -> Callable:
    """The loss of K members on one shard from one member's ``shard_loss``
    (:func:`chemtrain.learn.force_matching.make_shard_loss`).

    Returns:
      ``loss(stacked_params, batch) -> (loss, aux)``: ``batch`` arrays are
      ``(rows, K, ...)``, member ``k`` seeing column ``k``. ``loss`` is the
      sum of the members' losses (each member's parameters enter only its
      own term, so its gradient is that member's), ``aux`` holds ``parts``
      (per target, shape (K,)) and ``nbr_errors`` (summed).
    """
    def loss(params, batch):
        losses, aux = jax.vmap(shard_loss, in_axes=(0, 1))(params, batch)
        return jnp.sum(losses), {"parts": aux["parts"], "nbr_errors": jnp.sum(aux["nbr_errors"])}
    return loss


def committee_predictor(predict: Callable) -> Callable:
    """The members' mean prediction from one member's ``predict``
    (:func:`chemtrain.learn.force_matching.make_predictor`).

    Returns:
      ``predict(stacked_params, R, kwargs, stress=False) -> (pred,
      nbr_error)`` like one member's, with ``U``, ``F`` (and ``stress``)
      the mean over members and ``U_std``, ``F_std`` (and ``stress_std``)
      their standard deviation over members (``ddof=0``), element-wise;
      ``nbr_error`` where any member's list failed.
    """
    def committee(params, R, kwargs, stress=False):
        return committee_of(*jax.vmap(lambda p: predict(p, R, kwargs, stress))(params))
    return committee


def committee_spread(members):
    """A committee's spread of a quantity: the population standard deviation
    (``ddof=0``) over its members (axis 0), per component; the one
    definition the trainer's predictions, the calculators and the
    calibration use. numpy for host arrays, jax.numpy for JAX arrays and
    traced values."""
    return (jnp if isinstance(members, jax.Array) else np).std(members, axis=0)


def committee_of(preds, errors):
    """The committee's ``(pred, nbr_error)`` from its members' predictions
    and neighbor-list errors (stacked on axis 0): mean and ``*_std`` of every
    predicted quantity, ``has_stress`` of the structures, any error."""
    out = {}
    for key, value in preds.items():
        if key == "has_stress":
            out[key] = value[0]
            continue
        out[key] = jnp.mean(value, axis=0)
        out[f"{key}_std"] = committee_spread(value)
    return out, jnp.any(errors, axis=0)


def trainer_functions(n: int, bootstrap: bool = False) -> Callable:
    """The factory of a committee's
    :class:`~chemtrain.learn.force_matching.TrainerFunctions`, with the
    signature of :func:`chemtrain.learn.force_matching.trainer_functions`.

    Args:
      n: the number of members K (>= 2).
      bootstrap: train each member on its own bootstrap sample of the
        training set (:func:`chemtrain.data.members.bootstrap_indices`).

    Returns:
      ``make(template, nbrs_init, optimizer, strategy, gammas, weights_keys,
      exclude, losses=None)``. Its ``update`` takes stacked parameters and the
      :func:`vectorized` optimizer's state; its metrics are the committee's
      (the mean prediction's) with ``members``, a list of each member's; its
      predictions are the committee's ``U``, ``F`` with their spread
      ``U_std``, ``F_std`` and each member's ``U_members`` (rows, K),
      ``F_members`` (rows, K, atoms, 3).
    """
    def training_loader(loader):
        if not isinstance(loader, InMemoryLoader):
            raise TypeError(f"A committee trains from in-memory data (set_datasets or "
                            f"set_dataset), so that each member draws its own order; got a "
                            f"{type(loader).__name__} for the training stage. Read the file "
                            f"into memory first.")
        return MemberLoader(loader, n, bootstrap)

    def record(host, n_steps, gammas):
        parts = {t: np.asarray(host["parts"][t], np.float64) / n_steps for t in gammas}
        losses = sum(gammas[t] * parts[t] for t in gammas)
        members = [{"train_loss": float(losses[k]),
                    "train_parts": {t: float(parts[t][k]) for t in gammas}} for k in range(n)]
        return {"train_loss": float(np.mean(losses)),
                "train_parts": {t: float(np.mean(parts[t])) for t in gammas}, "members": members}

    def val_record(val, gammas):   # the committee's, then each member's
        return {"val": {t: val[t] for t in gammas},
                "val_members": [{"loss": m["loss"], **{t: m[t] for t in gammas}}
                                for m in val["members"]]}

    def finish(host, gammas):
        out = fm.finish_metrics(host["committee"], gammas)
        out["members"] = [fm.finish_metrics(jax.tree.map(lambda x: x[k], host["members"]),
                                            gammas) for k in range(n)]
        return out

    def make(template, nbrs_init, optimizer, strategy, gammas, weights_keys, exclude,
             losses=None):
        predict = fm.make_predictor(template, nbrs_init, strategy.vary)
        loss = member_loss(fm.make_shard_loss(predict, gammas, weights_keys, exclude, losses))
        stress = "stress" in gammas

        def by_rows(tree, member_axis):
            return jax.tree.map(lambda x: jnp.moveaxis(x, member_axis, 1 - member_axis), tree)

        def outputs(params, batch):
            """Every member's (pred, nbr_error) of the batch, computed once,
            rows first (the compiled model program's per-row outputs)."""
            kwargs = fm.batch_kwargs(batch, exclude)
            return by_rows(jax.vmap(lambda p: predict(p, batch["R"], kwargs, stress))(params), 0)

        def sums_of(given, batch):
            preds, errors = by_rows(given, 1)
            one = lambda g: fm.metric_sums(g, batch, gammas, weights_keys, losses)  # noqa: E731
            c = one(committee_of(preds, errors))
            each = jax.vmap(lambda p, e: one((p, e)))(preds, errors)
            return {"committee": c, "members": each, "nbr_errors": c["nbr_errors"]}

        def predictions(given):
            preds, errors = by_rows(given, 1)
            return {**committee_of(preds, errors)[0], "U_members": given[0]["U"],
                    "F_members": given[0]["F"]}

        sums, model = fm.make_evaluation(outputs, sums_of, strategy, exclude)
        read = strategy.compile(predictions, in_sharded=(True,), out_sharded=True)
        return fm.TrainerFunctions(
            update=make_update(loss, optimizer, strategy), sums=sums,
            predict=lambda p, b: read(model(p, b)),
            finish=finish, train_record=record, training_loader=training_loader,
            val_record=val_record)
    return make
