"""The batches of state points of a DiffTRe epoch and the random keys of
its trajectories: functions of the state-point index and the update count
only, never of how state points are spread over processes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def statepoint_batches(n_statepoints: int, sim_batch_size: int) -> list[list[int]]:
    """The state points of each update of an epoch, in order.

    ``sim_batch_size=-1`` updates from all state points at once. A remainder
    that does not fill a batch joins the batch before it, so every state
    point is used exactly once per epoch."""
    if n_statepoints < 1:
        raise ValueError("There are no state points to train on.")
    if isinstance(sim_batch_size, bool) or not isinstance(sim_batch_size, (int, np.integer)) \
            or (sim_batch_size < 1 and sim_batch_size != -1):
        raise ValueError(f"sim_batch_size must be a positive integer or -1 (all state points "
                         f"in one update), got {sim_batch_size!r}.")
    if sim_batch_size == -1:
        return [list(range(n_statepoints))]
    if sim_batch_size > n_statepoints:
        raise ValueError(f"sim_batch_size={sim_batch_size} is larger than the number of state "
                         f"points ({n_statepoints}); use at most {n_statepoints}, or -1 for all.")
    n_full = n_statepoints // sim_batch_size
    batches = [list(range(i * sim_batch_size, (i + 1) * sim_batch_size)) for i in range(n_full)]
    batches[-1].extend(range(n_full * sim_batch_size, n_statepoints))
    return batches


def as_key(key):
    """The trainer's base key as raw key data: ``None`` (seed 0), an integer
    seed, a ``jax.random.PRNGKey`` or a new-style typed key."""
    if key is None:
        key = 0
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return jnp.asarray(jax.random.PRNGKey(int(key)))
    try:
        arr = jnp.asarray(key)
    except TypeError:
        arr = None
    if arr is not None and jnp.issubdtype(arr.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(arr)  # raw key data: plain numbers in saved states
    if arr is None or arr.shape != (2,) or arr.dtype != jnp.uint32:
        raise TypeError(f"key must be an integer seed or a JAX random key "
                        f"(jax.random.PRNGKey(seed)), got {key!r}"
                        + ("" if arr is None else f" of shape {arr.shape} and dtype {arr.dtype}")
                        + ".")
    return arr


def statepoint_key(base_key, statepoint_index: int, update_count: int, chain: int = 0):
    """The random key of one trajectory: a function of the run's base key,
    the state point's global index, the number of updates done so far and
    the chain, and of nothing that depends on the distribution over
    processes."""
    key = jax.random.fold_in(base_key, int(statepoint_index))
    key = jax.random.fold_in(key, int(update_count))
    return jax.random.fold_in(key, int(chain))


def train_key(key, index: int, update: int, chain: int):
    """The key of chain ``chain`` of state point ``index`` recomputed in
    update ``update`` (stream 0 of the run's key)."""
    return statepoint_key(jax.random.fold_in(key, 0), index, update, chain)
