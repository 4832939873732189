"""The strategy interface: everything a trainer needs to know about parallelism.

A strategy owns one answer each to: how many shards there are, which rows of a
global batch this process reads, how host data becomes device arrays, how the
root's state reaches everyone, and how a per-shard function becomes one
compiled function with the right collectives. Trainers call these methods and
never ask which method is active.

Functions compiled by a strategy are written per shard and use only
``strategy.vary``, ``strategy.mean`` and ``strategy.sum`` to talk to the
other shards.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

import numpy as np

Pytree = Any


class Strategy(abc.ABC):
    """Base class of the parallel strategies (see module docstring)."""

    #: name of the method as given to ``parallelism=``
    name: str = "abstract"
    #: in-memory datasets live on the root, which sends each process its rows
    scatters_from_root: bool = False

    # -- who am I ---------------------------------------------------------
    @property
    @abc.abstractmethod
    def n_shards(self) -> int:
        """Global number of shards (devices or ranks) a batch is split over."""

    @property
    def process_index(self) -> int:
        return 0

    @property
    def process_count(self) -> int:
        return 1

    @property
    def is_root(self) -> bool:
        return self.process_index == 0

    def check_batch(self, batch: int) -> int:
        """Return rows per shard; raise if ``batch`` does not split evenly."""
        if not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}.")
        if batch % self.n_shards:
            raise ValueError(
                f"batch={batch} is not divisible by the number of shards "
                f"({self.n_shards}, parallelism={self.name!r}). batch is the "
                f"global number of structures per step; choose a multiple of "
                f"{self.n_shards}, e.g. batch={self.n_shards * max(1, batch // self.n_shards)}."
            )
        return batch // self.n_shards

    def local_rows(self, batch: int) -> slice:
        """The contiguous rows of a global batch that this process reads."""
        per_process = batch // self.process_count
        start = self.process_index * per_process
        return slice(start, start + per_process)

    # -- placement ----------------------------------------------------------
    @abc.abstractmethod
    def place_batch(self, local_batch: Pytree) -> Pytree:
        """Turn this process's numpy rows into the device batch of a step."""

    @abc.abstractmethod
    def replicate(self, tree: Pytree) -> Pytree:
        """Place a state pytree (identical on all processes) on every shard."""

    def broadcast_from_root(self, tree: Pytree) -> Pytree:
        """Return the root's value of ``tree`` (numpy leaves) on every process."""
        return tree

    def to_host(self, x: Pytree, sharded: bool = False) -> Pytree:
        """Numpy copy of a compiled function's output (global for sharded)."""
        return _tree_map(np.asarray, x)

    # -- host-level communication -----------------------------------------
    def host_max(self, value: float) -> float:
        """Maximum of a Python number over processes."""
        return value

    def barrier(self) -> None:
        """Wait for every process."""

    def bcast_object(self, obj: Any) -> Any:
        """Send a small Python object (JSON-like) from the root to everyone."""
        return obj

    def host_allgather(self, value) -> list:
        """List of every process's ``value`` (a numpy array of equal shape)."""
        return [value]

    def local_items(self, n: int) -> range:
        """The items (e.g. DiffTRe state points) this process computes out of
        ``n``: one contiguous block per process; when ``n`` does not divide,
        the first ``n % process_count`` processes take one more."""
        size, rank = self.process_count, self.process_index
        base, extra = divmod(n, size)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))

    def host_sum(self, tree: Pytree) -> Pytree:
        """Sum of a pytree of numpy arrays (equal structure) over processes."""
        return tree

    def check_same(self, value: Any, what: str) -> None:
        """Raise the same ``ValueError`` on every process unless ``value``
        (JSON-like: numbers, strings, lists, dicts) is equal on all of them.

        ``what`` names the thing compared, e.g. "the HDF5 file's rows and
        datasets"; the message lists each process's value (shortened)."""
        import json
        import zlib
        text = json.dumps(value, sort_keys=True, default=str)
        mine = np.array([zlib.crc32(text.encode()), len(text)], np.int64)
        sums = [np.asarray(s) for s in self.host_allgather(mine)]
        if all(np.array_equal(s, sums[0]) for s in sums):
            return
        values = self.host_allgather_object(text[:300])
        listing = "; ".join(f"process {i}: {v}" for i, v in enumerate(values))
        from .failures import raised_everywhere
        raise raised_everywhere(ValueError(
            f"The processes of this run disagree on {what}; every process must use the same. "
            f"{listing}"))

    def host_allgather_object(self, obj: Any) -> list:
        """List of every process's small JSON-like ``obj``."""
        return [obj]

    def scatter_rows(self, global_batch, schema, batch):
        """Rows of this process from the root's ``global_batch`` (only for
        strategies with ``scatters_from_root``)."""
        raise NotImplementedError

    def abort(self, message: str) -> None:
        """End every process after a failure on this one (multi-process
        strategies); ``message`` is shown."""

    def failure_guard(self):
        """Context manager around work that reaches collectives: an exception
        raised on this process alone ends every process (so none waits
        forever); one raised on every process (see
        :func:`chemtrain.parallel.failures.raised_everywhere`) propagates."""
        from .failures import AbortOnError
        return AbortOnError(self)

    # -- inside compiled per-shard functions ------------------------------
    def vary(self, tree: Pytree) -> Pytree:
        """Mark replicated values as per-shard before differentiating."""
        return tree

    def mean(self, tree: Pytree) -> Pytree:
        """Mean over shards (identity for one shard)."""
        return tree

    def sum(self, tree: Pytree) -> Pytree:
        """Sum over shards (identity for one shard)."""
        return tree

    def mean_gradient(self, grads: Pytree) -> Pytree:
        """Average a gradient pytree over shards (may pack leaves)."""
        return self.mean(grads)

    @abc.abstractmethod
    def compile(self, fn: Callable, in_sharded: tuple[bool, ...],
                out_sharded: Any) -> Callable:
        """Compile a per-shard ``fn``.

        ``in_sharded[i]`` says whether argument ``i`` is split along its
        leading axis (a batch) or replicated (state). ``out_sharded`` is a
        bool or a tuple of bools in the same sense for the outputs.
        """

    def describe(self) -> str:
        return f"{self.name}: {self.n_shards} shard(s), process {self.process_index}/{self.process_count}"


def _tree_map(fn, tree):
    import jax
    return jax.tree.map(fn, tree)
