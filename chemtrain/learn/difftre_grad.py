"""The DiffTRe gradient of one state point in memory that grows with
``vmap_batch``, not with the number of snapshots.

``jax.value_and_grad`` of :func:`chemtrain.learn.difftre.make_statepoint_loss`
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

from . import difftre as reweight


def make_value_and_grad(energy_fn_template: Callable, quantities: Mapping, targets: Mapping,
                        observables: Mapping | None = None, loss_fn: Callable | None = None,
                        vmap_batch: int | None = 10, fixed: tuple = ()) -> Callable:
    """Return ``value_and_grad(params, chains, U_ref, target_values,
    state_kwargs, fixed_values=None) -> ((loss, aux), grad)``: what
    ``jax.value_and_grad(loss, has_aux=True)`` of
    :func:`~chemtrain.learn.difftre.make_statepoint_loss` (same arguments)
    returns, with peak memory set by ``vmap_batch`` snapshots (None: all at
    once)."""
    observables = reweight.resolve_observables(targets, quantities, observables,
                                               require_values=False)
    dependent = reweight.unfixed(quantities, fixed)
    one = reweight.snapshot_fn(energy_fn_template, dependent)
    batched = getattr(energy_fn_template, "batched", None)
    if batched is not None and not dependent:
        # only the energies depend on the parameters: each chunk's energies
        # from the template's batched evaluation (one disjoint graph for
        # MACE) instead of a vmap of one snapshot's
        one = _batched_energies(batched)
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
                one, params, nbrs0, snapshots, cot, state_kwargs, vmap_batch))
            start += n
        return (value, dict(aux, nbr_overflow=n_overflow)), grad

    return value_and_grad


def _chunked_vjp(one, params, nbrs0, snapshots, cotangents, state_kwargs, chunk):
    """``sum_i vjp(snapshot i)(cotangent i)`` over one chain's snapshots,
    ``chunk`` at a time (padded with zero cotangents), in a scan."""
    n = jax.tree.leaves(snapshots)[0].shape[0]
    chunk = n if chunk is None else min(int(chunk), n)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def blocks(x):
        x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x
        return x.reshape(n_chunks, chunk, *x.shape[1:])
    # padded snapshots repeat the last one (valid inputs); their cotangents are zero
    padded = jax.tree.map(lambda x: _pad_edge(x, pad, n_chunks, chunk), snapshots)
    cot = jax.tree.map(blocks, cotangents)

    def body(total, block):
        snaps, (gU, gq) = block

        def values(p):
            if isinstance(one, _batched_energies):
                return one(p, nbrs0, snaps, state_kwargs), {}
            U, q, _ = jax.vmap(lambda s: one(p, nbrs0, s, state_kwargs))(snaps)
            return U, q
        _, vjp = jax.vjp(values, params)
        (g,) = vjp((gU, gq))
        return jax.tree.map(jnp.add, total, g), None

    total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (padded, cot))
    return total


def _pad_edge(x, pad, n_chunks, chunk):
    """``x`` with its last entry repeated ``pad`` times, in blocks."""
    if pad:
        x = jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)])
    return x.reshape(n_chunks, chunk, *x.shape[1:])


class _batched_energies:
    """``(params, nbrs0, snapshots, state_kwargs) -> U`` of a chunk of
    snapshots through an energy template's ``batched`` energies: the
    neighbor list updated to each snapshot, the energy keyword arguments
    given a leading snapshot axis."""

    def __init__(self, batched):
        self.batched = batched

    def __call__(self, params, nbrs0, snaps, state_kwargs):
        from ..ensemble import box_kwargs, energy_kwargs
        n = snaps.position.shape[0]
        nbrs = jax.vmap(lambda s: nbrs0.update(s.position, **box_kwargs(s)))(snaps)
        fixed = energy_kwargs(jax.tree.map(lambda x: x[0], snaps), state_kwargs)
        per = jax.vmap(lambda s: energy_kwargs(s, {}))(snaps)
        kwargs = {k: jnp.broadcast_to(v, (n, *jnp.shape(v))) for k, v in fixed.items()
                  if k not in per}
        return self.batched(params)(snaps.position, nbrs, **kwargs, **per)
