"""The strategy interfaces: everything a trainer needs to know about parallelism.

A strategy is two small interfaces in one object:

* :class:`Comm`, host-level communication between processes: who this
  process is, broadcasting, gathering and reducing numpy values and small
  JSON-like objects, and ending every process after a failure;
* :class:`Sharding`, how one global batch is split: how many shards there
  are, which rows this process reads, how host data becomes device arrays
  and back, and how a per-shard function becomes one compiled function with
  the right collectives (``vary``, ``mean``, ``sum``).

Every member whose right behaviour depends on the parallel method is
abstract, so a concrete strategy implements each of them (or raises an error
naming the method and the mode); nothing falls back to a single-process
default. The few concrete members here (``is_root``, ``check_batch``,
``local_items``, ``check_same``, ``failure_guard``, ``describe``) are
computed from the abstract ones and are right for every method.

Trainers call these members and never ask which method is active.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

import numpy as np

Pytree = Any


class Comm(abc.ABC):
    """Host-level communication between the processes of a run."""

    @property
    @abc.abstractmethod
    def process_index(self) -> int:
        """This process's index, 0 on the root."""

    @property
    @abc.abstractmethod
    def process_count(self) -> int:
        """Number of processes of the run."""

    @abc.abstractmethod
    def bcast_object(self, obj: Any) -> Any:
        """Send a small Python object (JSON-like) from the root to everyone."""

    @abc.abstractmethod
    def broadcast_from_root(self, tree: Pytree) -> Pytree:
        """Return the root's value of ``tree`` (numpy leaves) on every process."""

    @abc.abstractmethod
    def host_allgather(self, value) -> list:
        """List of every process's ``value`` (a numpy array of equal shape)."""

    @abc.abstractmethod
    def host_allgather_object(self, obj: Any) -> list:
        """List of every process's small JSON-like ``obj``."""

    @abc.abstractmethod
    def host_sum(self, tree: Pytree) -> Pytree:
        """Sum of a pytree of numpy arrays (equal structure) over processes."""

    @abc.abstractmethod
    def host_max(self, value: float) -> float:
        """Maximum of a Python number over processes."""

    @abc.abstractmethod
    def abort(self, message: str) -> None:
        """End every process after a failure on this one; ``message`` is
        shown. Returns only where there is nothing to end (one process)."""

    # -- computed from the members above ----------------------------------
    @property
    def is_root(self) -> bool:
        return self.process_index == 0

    def local_items(self, n: int) -> range:
        """The items (e.g. DiffTRe state points) this process computes out of
        ``n``: one contiguous block per process; when ``n`` does not divide,
        the first ``n % process_count`` processes take one more."""
        size, rank = self.process_count, self.process_index
        base, extra = divmod(n, size)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))

    def check_same(self, value: Any, what: str) -> None:
        """Raise the same ``ValueError`` on every process unless ``value``
        (JSON-like: numbers, strings, lists, dicts) is equal on all of them.

        ``what`` names the thing compared, e.g. "the HDF5 file's rows and
        datasets"; the message lists each process's value (shortened)."""
        import json
        from ..checksum import crc
        text = json.dumps(value, sort_keys=True, default=str)
        mine = np.array([crc(text), len(text)], np.int64)
        sums = [np.asarray(s) for s in self.host_allgather(mine)]
        if all(np.array_equal(s, sums[0]) for s in sums):
            return
        values = self.host_allgather_object(text[:300])
        listing = "; ".join(f"process {i}: {v}" for i, v in enumerate(values))
        from .failures import raised_everywhere
        raise raised_everywhere(ValueError(
            f"The processes of this run disagree on {what}; every process must use the same. "
            f"{listing}"))

    def failure_guard(self):
        """Context manager around work that reaches collectives: an exception
        raised on this process alone ends every process (so none waits
        forever); one raised on every process (see
        :func:`chemtrain.parallel.failures.raised_everywhere`) propagates."""
        from .failures import AbortOnError
        return AbortOnError(self)


class Sharding(abc.ABC):
    """How one global batch is split over shards (devices or ranks)."""

    @property
    @abc.abstractmethod
    def n_shards(self) -> int:
        """Global number of shards (devices or ranks) a batch is split over."""

    @property
    @abc.abstractmethod
    def scatters_from_root(self) -> bool:
        """Whether in-memory datasets live on the root only (which then sends
        each process its rows in :meth:`select_rows`)."""

    @abc.abstractmethod
    def local_rows(self, batch: int) -> slice:
        """The contiguous rows of a global batch that this process reads."""

    @abc.abstractmethod
    def select_rows(self, data: dict | None, idx: np.ndarray, schema: dict,
                    batch: int) -> dict:
        """This process's rows ``idx[local_rows(batch)]`` of the in-memory
        ``data`` (a dict of arrays; None off the root when
        ``scatters_from_root``). ``schema`` maps keys to (row shape, dtype)
        so that a process without the data can receive its rows."""

    @abc.abstractmethod
    def place_batch(self, local_batch: Pytree) -> Pytree:
        """Turn this process's numpy rows into the device batch of a step."""

    @abc.abstractmethod
    def replicate(self, tree: Pytree) -> Pytree:
        """Place a state pytree (identical on all processes) on every shard."""

    @abc.abstractmethod
    def to_host(self, x: Pytree, sharded: bool = False) -> Pytree:
        """Numpy copy of a compiled function's output (global for sharded)."""

    @abc.abstractmethod
    def compile(self, fn: Callable, in_sharded: tuple[bool, ...],
                out_sharded: Any) -> Callable:
        """Compile a per-shard ``fn``.

        ``in_sharded[i]`` says whether argument ``i`` is split along its
        leading axis (a batch) or replicated (state). ``out_sharded`` is a
        bool or a tuple of bools in the same sense for the outputs.
        """

    # -- inside compiled per-shard functions ------------------------------
    @abc.abstractmethod
    def vary(self, tree: Pytree) -> Pytree:
        """Mark replicated values as per-shard before differentiating."""

    @abc.abstractmethod
    def mean(self, tree: Pytree) -> Pytree:
        """Mean over shards."""

    @abc.abstractmethod
    def sum(self, tree: Pytree) -> Pytree:
        """Sum over shards."""

    @abc.abstractmethod
    def mean_gradient(self, grads: Pytree) -> Pytree:
        """Average a gradient pytree over shards (may pack leaves)."""

    # -- computed from the members above ----------------------------------
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


class Strategy(Comm, Sharding):
    """A parallel method: both interfaces (see module docstring)."""

    #: name of the method as given to ``parallelism=``; every strategy sets it
    name: str = "abstract"

    def describe(self) -> str:
        return f"{self.name}: {self.n_shards} shard(s), process {self.process_index}/{self.process_count}"


#: members every concrete strategy must define itself (the contract test
#: checks that none is inherited)
REQUIRED = tuple(sorted(set(Comm.__abstractmethods__) | set(Sharding.__abstractmethods__)))


def contiguous_rows(data: dict, idx: np.ndarray, rows: slice) -> dict:
    """``select_rows`` of a strategy where every process holds ``data``."""
    return {k: v[idx[rows]] for k, v in data.items()}
