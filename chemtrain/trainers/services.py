"""Services every trainer composes: progress and metrics reports, checkpoints
with the run's metadata (:mod:`.checkpoints`), failed-step handling, and the
replica check.

A trainer (``ForceMatching``, ``Difftre``, ``DifftreParallel``) is a loop over
updates plus these pieces; it holds them as attributes (composition, not a
class tower). Every method here is collective: call it on every process in
the same order. Root-only work (writing files, printing) happens inside, and
every process learns its outcome, so an error is raised on all processes at
once and none waits.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import numpy as np

from ..checksum import crc
from ..parallel.failures import raised_everywhere
from .errors import TrainingError

def collective(method):
    """Decorate a trainer's public method: it runs under the strategy's
    failure guard, so an exception on one process ends every process
    instead of leaving the others waiting in a collective."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        with self.strategy.failure_guard():
            return method(self, *args, **kwargs)
    return guarded


def check_consistency(strategy, trees: Mapping, step: int) -> None:
    """Compare checksums of every leaf of ``trees`` (host numpy) across
    processes; raise :class:`TrainingError` on every process naming the first
    leaf whose replicas differ."""
    flat, _ = jax.tree_util.tree_flatten_with_path(dict(trees))
    sums = np.array([crc(v) for _, v in flat], np.int64)
    for proc, other in enumerate(strategy.host_allgather(sums)):
        diff = np.nonzero(np.asarray(other) != sums)[0]
        if diff.size:
            raise raised_everywhere(TrainingError(
                f"Replicas diverged after step {step}: "
                f"{jax.tree_util.keystr(flat[diff[0]][0])} differs between process "
                f"{strategy.process_index} and process {proc} "
                f"({diff.size} leaf/leaves differ in all)."))


_add = jax.jit(lambda a, b: jax.tree.map(lambda x, y: x + y, a, b))


def add_trees(a, b):
    """Leaf-wise sum of two device pytrees (``a`` may be None), jitted."""
    return b if a is None else _add(a, b)


def run_steps(strategy, step: Callable, batches, on_failure: Callable, bar=None,
              first_step: int = 0, every: int | None = None, at_every: Callable | None = None):
    """Apply ``step(batch) -> stats`` to every batch and check each step on
    the host while the next one runs (no pipeline stall).

    ``stats`` are device values with 'ok' and 'loss' (replicated) and 'sum',
    a pytree summed over the steps. A step whose 'ok' is False calls
    ``on_failure(stats, index, applied)`` (it must raise), where ``applied``
    counts the steps of this call that did change the state. ``at_every(k)``
    runs after every ``every``-th global step. Returns (steps, summed 'sum').
    """
    def check(stats, later, index):
        ok, loss = strategy.to_host((stats["ok"], stats["loss"]))
        if not bool(ok):
            on_failure(stats, index, index + (int(strategy.to_host(later["ok"]))
                                              if later is not None else 0))
        return float(loss)

    n, total, prev = 0, None, None  # memory stays flat however long the epoch
    for batch in batches:
        stats = step(batch)
        total = add_trees(total, stats["sum"])
        n += 1
        if every and at_every is not None and (first_step + n) % every == 0:
            at_every(first_step + n)
        if prev is not None:
            loss = check(prev, stats, n - 2)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4g}")
        prev = stats
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    if prev is not None:
        check(prev, None, n - 1)
    return n, total


def init_state(strategy, init_params, optimizer):
    """(params, opt_state) replicated on the devices and the host params: the
    root's ``init_params`` and its optimizer state, on every process."""
    leaves = jax.tree_util.tree_flatten_with_path(init_params)[0]
    if not leaves:
        raise ValueError("init_params holds no arrays: there is nothing to train.")
    for path, leaf in leaves:
        if not np.issubdtype(np.asarray(leaf).dtype, np.floating):
            raise TypeError(
                f"Parameter {jax.tree_util.keystr(path) or 'init_params'} has dtype "
                f"{np.asarray(leaf).dtype}; trained parameters must be floating point (e.g. "
                f"jnp.asarray({np.asarray(leaf).tolist() if np.size(leaf) < 5 else '...'}, "
                f"jnp.float32)), since gradients of integers are not defined.")
    host_params = strategy.broadcast_from_root(jax.tree.map(np.asarray, init_params))
    host_opt = strategy.broadcast_from_root(jax.tree.map(np.asarray, _opt_init(optimizer,
                                                                             host_params)))
    return strategy.replicate(host_params), strategy.replicate(host_opt), host_params


def _opt_init(optimizer, params):
    """``optimizer.init(params)`` as one compiled program (run eagerly, each
    leaf's zeros compile their own), or eagerly when the init cannot be
    traced (a user's transformation that reads its arguments as numbers)."""
    try:
        return jax.jit(optimizer.init)(params)
    except jax.errors.JAXTypeError:
        return optimizer.init(params)
