"""Reweighting as pure functions, shared by every reweighting objective
(DiffTRe, relative entropy, dynamics): Boltzmann weights of stored
snapshots, the effective sample size, ensemble observables, DiffTRe's loss
and gradient of one state point, the recompute rule and the step-size
search.

A state point's trajectory is a list of *chains*; each chain is a pair
``(snapshots, nbrs)``: jax-md simulator states stacked along axis 0 and the
neighbor list the chain ended with (it is updated to every snapshot).
``U_ref`` holds the potential energy of every snapshot of every chain (in
chain order) under the parameters that generated them. With parameters
theta, snapshot ``i`` gets the weight

    w_i = exp(-(U_theta_i - U_ref_i) / kT) / sum_j exp(-(U_theta_j - U_ref_j) / kT)

(in an NPT ensemble the ``pressure * volume`` terms of both ensembles are
equal for a stored snapshot and cancel, so the same formula holds). Every
observable is a function of the per-snapshot quantities and these weights;
the loss is differentiated through both, since quantities such as the
pressure or the energy depend on theta too.

Nothing here depends on how state points are spread over processes: random
keys derive from the state-point index and the update count only.
"""
from __future__ import annotations

__all__ = ["reweighting_weights", "effective_sample_size", "statistical_inefficiency",
           "independent_samples", "reuse_distance", "needs_recompute", "weighted_mean",
           "traj_mean", "mse", "resolve_observables", "statepoint_loss", "map_in_chunks",
           "snapshot_fn", "make_snapshot_evaluator", "potential_dependent", "unfixed",
           "make_statepoint_head", "make_statepoint_loss", "make_neff_fn",
           "step_size_candidates", "scaled_params", "step_size_violations", "choose_step_size",
           "statepoint_batches", "as_key", "statepoint_key"]

import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import box_kwargs, energy_kwargs
from .difftre_batches import as_key, statepoint_batches, statepoint_key
from .pool import effective_sample_size, pooled_weights
from .step_size import (choose_step_size, scaled_params, step_size_candidates,
                        step_size_violations)
from .reuse import independent_samples, needs_recompute, reuse_distance, statistical_inefficiency

# -- reweighting ----------------------------------------------------------


def reweighting_weights(U_theta, U_ref, kT):
    """Normalised Boltzmann weights of snapshots sampled at ``U_ref``.

    ``softmax(-(U_theta - U_ref) / kT)`` over the last axis, computed with
    the maximum subtracted, so large energy differences neither overflow nor
    underflow to all zeros. At ``U_theta == U_ref`` every weight is 1/N.
    """
    U_theta, U_ref = jnp.asarray(U_theta), jnp.asarray(U_ref)
    if U_theta.shape != U_ref.shape:
        raise ValueError(f"U_theta has shape {U_theta.shape} but U_ref has {U_ref.shape}; "
                         f"both need one energy per snapshot.")
    return jax.nn.softmax(-(U_theta - U_ref) / kT, axis=-1)


def weighted_mean(values, weights):
    """Weighted mean over the leading (snapshot) axis of ``values``."""
    values, w = jnp.asarray(values), jnp.asarray(weights)
    if not jnp.issubdtype(values.dtype, jnp.inexact):  # counts, flags
        values = values.astype(w.dtype)
    return jnp.tensordot(w, values, axes=(0, 0))


def traj_mean(quantity: str) -> Callable:
    """Observable factory: the weighted mean of one quantity.

    Returns ``observable(quantity_trajs, weights)``, where ``quantity_trajs``
    maps quantity names to per-snapshot values (leading snapshot axis). This
    is the observable of every target that names a quantity and no
    observable of its own."""
    def observable(quantity_trajs, weights):
        return weighted_mean(quantity_trajs[quantity], weights)
    observable.__name__ = f"traj_mean_{quantity}"
    return observable


# -- targets and loss -----------------------------------------------------


def mse(prediction, target):
    """Mean squared error over all elements."""
    return jnp.mean((jnp.asarray(prediction) - jnp.asarray(target)) ** 2)


def resolve_observables(targets: Mapping, quantities: Mapping,
                        observables: Mapping | None, require_values: bool = True) -> dict:
    """The observable of every target and of every given observable.

    A target named like a quantity and without its own observable gets the
    weighted mean of that quantity. A target with neither is an error.
    ``require_values=False`` accepts target specs without their 'target'
    array (the values then come with every loss evaluation)."""
    if not isinstance(targets, Mapping) or not targets:
        raise ValueError(f"targets must be a non-empty dict {{name: {{'target': array, "
                         f"'gamma': weight}}}}, got {targets!r}.")
    if not isinstance(quantities, Mapping) or not quantities:
        raise ValueError("quantities must be a non-empty dict {name: fn(state, neighbor=..., "
                         "energy_fn=..., **state_kwargs)} of per-snapshot functions.")
    for name, fn in quantities.items():
        if not callable(fn):
            raise TypeError(f"quantities[{name!r}] must be a function of one snapshot, "
                            f"got {type(fn).__name__}.")
    observables = dict(observables or {})
    for name, fn in observables.items():
        if not callable(fn):
            raise TypeError(f"observables[{name!r}] must be a function "
                            f"(quantity_trajs, weights) -> array, got {type(fn).__name__}.")
    for name, spec in targets.items():
        if not isinstance(spec, Mapping) or (require_values and "target" not in spec):
            raise ValueError(f"targets[{name!r}] must be a dict with a 'target' array (and "
                             f"optionally 'gamma' and 'loss_fn'), got {spec!r}.")
        unknown = set(spec) - {"target", "gamma", "loss_fn"}
        if unknown:
            raise ValueError(f"targets[{name!r}] has unknown keys {sorted(unknown)}; "
                             f"allowed are 'target', 'gamma', 'loss_fn'.")
        gamma = spec.get("gamma", 1.0)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.number)) \
                or not (math.isfinite(float(gamma)) and float(gamma) >= 0):
            raise ValueError(f"targets[{name!r}]['gamma'] must be a finite number >= 0 (the "
                             f"weight of this target's loss), got {gamma!r}. A negative weight "
                             f"would train away from the target.")
        if "loss_fn" in spec and not callable(spec["loss_fn"]):
            raise TypeError(f"targets[{name!r}]['loss_fn'] must be a function (prediction, "
                            f"target) -> scalar, got {type(spec['loss_fn']).__name__}.")
        if name not in observables:
            if name not in quantities:
                raise ValueError(
                    f"Target {name!r} has no observable: there is neither observables[{name!r}] "
                    f"nor a quantity {name!r} whose weighted mean could serve. Quantities: "
                    f"{sorted(quantities)}; observables: {sorted(observables)}. Add "
                    f"observables[{name!r}] or rename the target.")
            observables[name] = traj_mean(name)
    return observables


def statepoint_loss(predictions: Mapping, targets: Mapping, target_values: Mapping):
    """``sum_k gamma_k * loss_k(prediction_k, target_k)`` of one state point.

    ``targets`` holds each target's 'gamma' (default 1) and optional
    'loss_fn(prediction, target)' (default :func:`mse`); ``target_values``
    holds this state point's target arrays. Returns (loss, parts)."""
    parts = {name: _scalar(spec.get("loss_fn", mse)(predictions[name], target_values[name]),
                           f"targets[{name!r}]['loss_fn']")
             for name, spec in targets.items()}
    loss = sum(spec.get("gamma", 1.0) * parts[name] for name, spec in targets.items())
    return loss, parts


def _scalar(value, what: str):
    """``value`` if it is one number, else a ValueError naming ``what``."""
    shape = jnp.shape(value)
    if shape != ():
        raise ValueError(f"{what} returned an array of shape {shape}; a loss must be one number "
                         f"(e.g. jnp.mean(...) of the per-element errors).")
    return value


def map_in_chunks(fn, xs, batch_size):
    """``vmap(fn)(xs)`` over the leading axis, ``batch_size`` entries at a time
    (None: all at once)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    if batch_size is None or batch_size >= n:
        return jax.vmap(fn)(xs)
    return jax.lax.map(fn, xs, batch_size=batch_size)


def pad_to_chunks(xs, chunk: int, fill: str = "last"):
    """The leaves of ``xs`` (leading axis n) as (ceil(n / chunk), chunk, ...)
    blocks. The last block is filled with copies of the last entry
    (``fill="last"``: valid inputs whose results are dropped) or with zeros
    (``fill="zeros"``: e.g. cotangents that add nothing)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def blocks(x):
        if pad:
            extra = (jnp.repeat(x[-1:], pad, axis=0) if fill == "last"
                     else jnp.zeros((pad, *x.shape[1:]), x.dtype))
            x = jnp.concatenate([x, extra])
        return x.reshape(n_chunks, chunk, *x.shape[1:])
    return jax.tree.map(blocks, xs)


def batched_snapshot_energies(batched: Callable) -> Callable:
    """``(params, nbrs0, snapshots, state_kwargs) -> (U, overflow)`` of a
    chunk of snapshots (leading axis B) through an energy template's
    ``batched`` energies (:attr:`chemtrain.models.EnergyTemplate.batched`:
    MACE evaluates the chunk as one disjoint graph): the neighbor list
    ``nbrs0`` updated to each snapshot, the energy keyword arguments given
    the leading axis B. Equal to a vmap of :func:`snapshot_fn`'s energies."""
    def energies(params, nbrs0, snaps, state_kwargs):
        n = snaps.position.shape[0]
        nbrs = jax.vmap(lambda s: nbrs0.update(s.position, **box_kwargs(s)))(snaps)
        shared = energy_kwargs(jax.tree.map(lambda x: x[0], snaps), state_kwargs)
        own = jax.vmap(lambda s: energy_kwargs(s, {}))(snaps)   # an NPT state's box
        kwargs = {k: jnp.broadcast_to(v, (n, *jnp.shape(v))) for k, v in shared.items()
                  if k not in own}
        U = batched(params)(snaps.position, nbrs, **kwargs, **own)
        return U, nbrs.did_buffer_overflow
    return energies


def snapshot_fn(energy_fn_template: Callable | None, quantities: Mapping) -> Callable:
    """Return ``one(params, nbrs0, snapshot, state_kwargs) -> (U, q,
    overflow)``: one snapshot's energy under ``params`` (None without a
    template), its ``quantities`` and whether the neighbor list ``nbrs0``,
    updated to it, overflowed."""
    def one(params, nbrs0, snapshot, state_kwargs):
        energy_fn = energy_fn_template(params) if energy_fn_template is not None else _no_energy
        nbrs = nbrs0.update(snapshot.position, **box_kwargs(snapshot))
        U = None if energy_fn_template is None else energy_fn(
            snapshot.position, neighbor=nbrs, **energy_kwargs(snapshot, state_kwargs))
        q = {name: fn(snapshot, neighbor=nbrs, energy_fn=energy_fn, **state_kwargs)
             for name, fn in quantities.items()}
        return U, q, nbrs.did_buffer_overflow
    return one


def make_snapshot_evaluator(energy_fn_template: Callable | None,
                            quantities: Mapping | None = None,
                            vmap_batch: int | None = 10) -> Callable:
    """Return ``evaluate(params, chains, state_kwargs) -> (U, quantity_trajs,
    n_overflow)``: the potential energy under ``params`` and the per-snapshot
    quantities of every snapshot of every chain (concatenated in chain order),
    and the number of snapshots whose neighbor list overflowed.

    Quantities receive ``energy_fn=energy_fn_template(params)``, so the ones
    that depend on the potential (pressure, energy) follow ``params``.
    Without a template (None) no energy is computed (U is None) and the
    quantities must not use the potential. ``vmap_batch`` snapshots are
    evaluated at once (None: all)."""
    quantities = dict(quantities or {})
    one = snapshot_fn(energy_fn_template, quantities)
    batched = getattr(energy_fn_template, "batched", None)
    if batched is not None and not quantities:
        # energies only: chunks through the template's batched energies
        chunk_fn = batched_snapshot_energies(batched)

        def one_chain(params, nbrs0, snapshots, state_kwargs):
            n = jax.tree.leaves(snapshots)[0].shape[0]
            size = n if vmap_batch is None else min(int(vmap_batch), n)
            blocks = pad_to_chunks(snapshots, size)
            U, overflow = jax.lax.map(lambda b: chunk_fn(params, nbrs0, b, state_kwargs), blocks)
            return U.reshape(-1)[:n], {}, overflow.reshape(-1)[:n]
    else:
        def one_chain(params, nbrs0, snapshots, state_kwargs):
            return map_in_chunks(lambda s: one(params, nbrs0, s, state_kwargs), snapshots,
                                 vmap_batch)

    def evaluate(params, chains, state_kwargs):
        outs = [one_chain(params, nbrs0, snapshots, state_kwargs) for snapshots, nbrs0 in chains]
        U = None if energy_fn_template is None else jnp.concatenate([o[0] for o in outs])
        q = {name: jnp.concatenate([o[1][name] for o in outs]) for name in quantities}
        n_overflow = sum(jnp.sum(o[2]) for o in outs)
        return U, q, n_overflow

    return evaluate


class _EnergyUsed(Exception):
    pass


def _no_energy(*args, **kwargs):
    raise _EnergyUsed


def potential_dependent(quantities: Mapping, snapshot, nbrs, state_kwargs: Mapping) -> set:
    """Names of the quantities that call the energy function they are given
    (and so depend on the parameters), found by tracing each on one
    snapshot. The others depend on the snapshot alone: their values can be
    computed once per trajectory and reused while reweighting."""
    dependent = set()
    for name, fn in quantities.items():
        def probe(s, nb, kw, fn=fn):
            return fn(s, neighbor=nb.update(s.position, **box_kwargs(s)),
                      energy_fn=_no_energy, **kw)
        try:
            jax.eval_shape(probe, snapshot, nbrs, dict(state_kwargs))
        except _EnergyUsed:
            dependent.add(name)
    return dependent


def unfixed(quantities: Mapping, fixed: tuple) -> dict:
    """The quantities not named in ``fixed`` (those evaluated under the
    parameters); ``fixed`` must name quantities."""
    unknown = set(fixed) - set(quantities)
    if unknown:
        raise ValueError(f"fixed names unknown quantities {sorted(unknown)}.")
    return {k: v for k, v in quantities.items() if k not in fixed}


def make_statepoint_head(targets: Mapping, observables: Mapping, loss_fn: Callable | None = None,
                         fixed: tuple = ()) -> Callable:
    """Return ``head(U, qs, U_ref, target_values, state_kwargs, fixed_values)
    -> (loss, aux)``: the DiffTRe loss of one state point from its
    snapshots' energies ``U`` and quantities ``qs`` (plus the ``fixed``
    ones in ``fixed_values``), as :func:`make_statepoint_loss` describes
    (``aux`` without 'nbr_overflow'); ``observables`` resolved."""
    def head(U, qs, U_ref, target_values, state_kwargs, fixed_values=None):
        qs = dict(qs, **{k: fixed_values[k] for k in fixed})
        if jnp.ndim(U_ref) == 3:   # a pool of trajectories (chemtrain.learn.pool)
            weights, slot_n_eff = pooled_weights(U, U_ref, state_kwargs["kT"])
            pool = {"n_eff": slot_n_eff[-1], "pool_n_eff": slot_n_eff}
        else:
            weights = reweighting_weights(U, U_ref, state_kwargs["kT"])
            pool = {"n_eff": effective_sample_size(weights)}
        predictions = {name: fn(qs, weights) for name, fn in observables.items()}
        for name in targets:
            got, want = jnp.shape(predictions[name]), jnp.shape(target_values[name])
            if got != want:
                raise ValueError(f"The observable {name!r} has shape {got} but its target has "
                                 f"shape {want}; give targets[{name!r}]['target'] the shape of "
                                 f"the observable (per state point).")
        if loss_fn is None:
            value, parts = statepoint_loss(predictions, targets, target_values)
        else:
            value, parts = _scalar(loss_fn(predictions, target_values), "loss_fn"), {}
        return value, {"predictions": predictions, "parts": parts, "weights": weights, **pool}
    return head


def make_statepoint_loss(energy_fn_template: Callable, quantities: Mapping, targets: Mapping,
                         observables: Mapping | None = None, loss_fn: Callable | None = None,
                         vmap_batch: int | None = 10, fixed: tuple = ()) -> Callable:
    """Return ``loss(params, chains, U_ref, target_values, state_kwargs,
    fixed_values=None) -> (loss, aux)``: the DiffTRe loss of one state point
    as a function of the parameters, to be differentiated with ``jax.grad``
    (or, in memory that does not grow with the snapshots, by
    :func:`chemtrain.learn.difftre_grad.make_value_and_grad`). ``targets``
    gives each target's 'gamma' and optional 'loss_fn' (a 'target' entry is
    ignored: ``target_values`` holds the values, so one compiled loss serves
    every state point).

    Every snapshot's energy and quantities are evaluated under ``params``,
    except the quantities named in ``fixed`` (see
    :func:`potential_dependent`), whose per-snapshot values come in
    ``fixed_values``. The weights follow from ``U_ref`` and
    ``state_kwargs['kT']``; the observables (see
    :func:`resolve_observables`) are the predictions. The loss is
    ``loss_fn(predictions, target_values)`` if given, else
    :func:`statepoint_loss`. ``aux`` holds 'predictions', 'parts',
    'weights', 'n_eff' and 'nbr_overflow' (snapshots whose neighbor list
    overflowed: their values are invalid).
    """
    observables = resolve_observables(targets, quantities, observables, require_values=False)
    evaluate = make_snapshot_evaluator(energy_fn_template, unfixed(quantities, fixed), vmap_batch)
    head = make_statepoint_head(targets, observables, loss_fn, fixed)

    def loss(params, chains, U_ref, target_values, state_kwargs, fixed_values=None):
        U, qs, n_overflow = evaluate(params, chains, state_kwargs)
        value, aux = head(U, qs, U_ref, target_values, state_kwargs, fixed_values)
        return value, dict(aux, nbr_overflow=n_overflow)

    return loss


def make_neff_fn(energy_fn_template: Callable, vmap_batch: int | None = 10) -> Callable:
    """Return ``n_eff(params, chains, U_ref, state_kwargs)``: the effective sample size
    of one state point's snapshots under ``params`` (energies only)."""
    evaluate = make_snapshot_evaluator(energy_fn_template, None, vmap_batch)

    def n_eff(params, chains, U_ref, state_kwargs):
        U, _, _ = evaluate(params, chains, state_kwargs)
        kT = state_kwargs["kT"]
        return effective_sample_size(reweighting_weights(U, U_ref, kT))

    return n_eff
