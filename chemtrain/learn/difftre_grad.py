"""The DiffTRe gradient of one state point in memory that grows with
``vmap_batch``, not with the number of snapshots.

``jax.value_and_grad`` of :func:`chemtrain.learn.reweighting.make_statepoint_loss`
keeps the reverse-mode residuals of every snapshot until the backward pass:
for a neural potential, gigabytes per thousand snapshots. But the loss
depends on the parameters only through each snapshot's energy ``U_i`` and
potential-dependent quantities ``q_i``, so

    dL/dtheta = sum_i  dL/dU_i dU_i/dtheta + dL/dq_i dq_i/dtheta.

:func:`make_value_and_grad` computes it in two passes: a forward pass over
all snapshots (chunked, no residuals kept) gives ``U``, ``q``, the loss and
the cotangents ``dL/dU_i``, ``dL/dq_i`` (the gradient of the cheap "head"
that maps energies and quantities to the loss); a second pass scans the
snapshots chunk by chunk, each chunk's vector-Jacobian product with its
cotangents added to the running gradient, so only one chunk's residuals
exist at a time. The result equals the direct gradient up to rounding (the
terms are summed in another order).
"""
from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from . import reweighting as reweight


def make_value_and_grad(energy_fn_template: Callable, quantities: Mapping, targets: Mapping,
                        observables: Mapping | None = None, loss_fn: Callable | None = None,
                        vmap_batch: int | None = 10, fixed: tuple = ()) -> Callable:
    """Return ``value_and_grad(params, chains, U_ref, target_values,
    state_kwargs, fixed_values=None) -> ((loss, aux), grad)``: what
    ``jax.value_and_grad(loss, has_aux=True)`` of
    :func:`~chemtrain.learn.reweighting.make_statepoint_loss` (same arguments)
    returns, with peak memory set by ``vmap_batch`` snapshots (None: all at
    once)."""
    observables = reweight.resolve_observables(targets, quantities, observables,
                                               require_values=False)
    dependent = reweight.unfixed(quantities, fixed)
    batched = getattr(energy_fn_template, "batched", None)
    if batched is not None and not dependent:
        # only the energies depend on the parameters: each chunk's energies
        # from the template's batched evaluation (one disjoint graph for
        # MACE) instead of a vmap of one snapshot's
        energies = reweight.batched_snapshot_energies(batched)

        def chunk_values(p, nbrs0, snaps, state_kwargs):
            return energies(p, nbrs0, snaps, state_kwargs)[0], {}
    else:
        one = reweight.snapshot_fn(energy_fn_template, dependent)

        def chunk_values(p, nbrs0, snaps, state_kwargs):
            U, q, _ = jax.vmap(lambda s: one(p, nbrs0, s, state_kwargs))(snaps)
            return U, q
    evaluate = reweight.make_snapshot_evaluator(energy_fn_template, dependent, vmap_batch)
    head = reweight.make_statepoint_head(targets, observables, loss_fn, fixed)

    def value_and_grad(params, chains, U_ref, target_values, state_kwargs, fixed_values=None):
        U, qs, n_overflow = evaluate(jax.lax.stop_gradient(params), chains, state_kwargs)
        (value, aux), (gU, gq) = jax.value_and_grad(head, argnums=(0, 1), has_aux=True)(
            U, qs, U_ref, target_values, state_kwargs, fixed_values)
        grad, start = jax.tree.map(jnp.zeros_like, params), 0
        for snapshots, nbrs0 in chains:
            n = jax.tree.leaves(snapshots)[0].shape[0]
            cot = (gU[start:start + n], {k: v[start:start + n] for k, v in gq.items()})
            grad = jax.tree.map(jnp.add, grad, _chunked_vjp(
                chunk_values, params, nbrs0, snapshots, cot, state_kwargs, vmap_batch))
            start += n
        return (value, dict(aux, nbr_overflow=n_overflow)), grad

    return value_and_grad


def _chunked_vjp(chunk_values, params, nbrs0, snapshots, cotangents, state_kwargs, chunk):
    """``sum_i vjp(snapshot i)(cotangent i)`` over one chain's snapshots,
    ``chunk`` at a time (padded with zero cotangents), in a scan;
    ``chunk_values(params, nbrs0, snapshots, state_kwargs) -> (U, q)`` of
    one chunk."""
    n = jax.tree.leaves(snapshots)[0].shape[0]
    chunk = n if chunk is None else min(int(chunk), n)
    # padded snapshots repeat the last one (valid inputs); their cotangents are zero
    padded = reweight.pad_to_chunks(snapshots, chunk)
    cot = reweight.pad_to_chunks(cotangents, chunk, fill="zeros")

    def body(total, block):
        snaps, (gU, gq) = block

        _, vjp = jax.vjp(lambda p: chunk_values(p, nbrs0, snaps, state_kwargs), params)
        (g,) = vjp((gU, gq))
        return jax.tree.map(jnp.add, total, g), None

    total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (padded, cot))
    return total

