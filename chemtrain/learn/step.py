"""One optimizer step written per shard; the strategy supplies collectives.

Every shard computes its loss and gradient, the strategy averages the
gradient over shards, and every shard applies the same optax update to its
replica. A step whose loss or gradient is not finite, or whose neighbor
lists failed on any shard, leaves parameters and optimizer state unchanged
and reports it, so the trainer can stop with the last good state.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from .diagnose import all_finite


def make_update(loss_fn: Callable, optimizer: optax.GradientTransformation, strategy) -> Callable:
    """Return the compiled ``update(params, opt_state, batch) ->
    (params, opt_state, stats)``; ``stats`` has 'loss', 'parts', 'nbr_errors',
    'grad_ok', 'update_ok' (new parameters and optimizer state finite) and
    'ok' (replicated)."""

    def local_update(params, opt_state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(strategy.vary(params), batch)
        grads = strategy.mean_gradient(grads)
        loss, parts = strategy.mean((loss, aux["parts"]))
        nbr_errors = strategy.sum(aux["nbr_errors"])
        grad_ok = all_finite(grads)
        ok = jnp.isfinite(loss) & (nbr_errors == 0) & grad_ok
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # a finite but huge gradient can overflow the optimizer's moments
        # (Adam's in float32 from |g| ~ 1e19): later steps would then be 0
        update_ok = all_finite((new_params, new_opt_state))
        ok = ok & update_ok
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        stats = {"loss": loss, "parts": parts, "nbr_errors": nbr_errors, "ok": ok,
                 "grad_ok": grad_ok, "update_ok": update_ok}
        return keep(new_params, params), keep(new_opt_state, opt_state), stats

    return strategy.compile(local_update, in_sharded=(False, False, True),
                            out_sharded=(False, False, False))
