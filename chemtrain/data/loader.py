"""Batches of an in-memory dataset for one process.

A loader yields, per step, this process's rows of the global batch as numpy
arrays plus a per-sample validity mask ``_valid``. Every process draws the same
global order (from ``seed`` and the epoch), so shuffling needs no
communication and a restored run sees the same batches.
"""
from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import numpy as np

from .dataset import dataset_length

VALID = "_valid"


@runtime_checkable
class Loader(Protocol):
    """What a trainer relies on in a data loader (a runtime-checkable protocol).

    A loader has ``n`` structures and a ``seed`` of the batch order; a
    restored trainer sets the seed. ``len(loader)`` is the number of batches
    per epoch. ``local_batches(strategy, epoch)`` yields, for every global
    batch of the epoch, this process's rows as a dict of numpy arrays with a
    boolean ``_valid`` column (``VALID``) that marks padding rows False.
    Each batch must be new arrays that the loader does not write to again:
    the trainer hands them to an asynchronous step without copying, so a
    loader that refilled one buffer could change a batch still in use.
    ``configure(batch, training, seed, strategy, required=(), weights=())``
    binds a loader that reads for itself (such as
    :class:`HDF5ParallelDataLoader`) to a trainer: its global batch size,
    whether the loader serves the training stage, the seed and the
    strategy; it may check that the loader holds the keys in ``required``
    and valid per-structure weights under the keys ``weights``.
    ``trainer.set_loader`` calls it. In-memory loaders are built configured.

    Attributes:
      n: number of structures.
      seed: seed of the batch order.
    """
    n: int
    seed: int

    def __len__(self) -> int: ...

    def configure(self, batch: int, training: bool, seed: int, strategy, required=(),
                  weights=()) -> None: ...

    def local_batches(self, strategy, epoch: int = 0) -> Iterator[dict]: ...


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


class InMemoryLoader:
    """Iterate over global batches of an in-memory dataset.

    Every process draws the same global order from ``seed`` and the epoch
    and takes its own rows of each global batch. For training
    (``drop_last=True``) the incomplete last batch of an epoch is skipped
    (when shuffled, different structures each epoch); for evaluation
    (``drop_last=False``) it is padded with invalid samples (copies of a
    real row, marked False in ``VALID``) that the metrics ignore.

    Args:
      data: dict of numpy arrays with one row per structure (see
        :func:`validate_dataset`). With a strategy that scatters from the
        root only the root needs it; other processes may pass None and then
        must give ``n`` and ``schema``.
      batch: the global batch size (structures per step over all processes).
      shuffle: draw a new order every epoch (from ``seed`` and the epoch);
        else the rows go in their order.
      seed: seed of the batch order.
      drop_last: skip an incomplete last batch instead of padding it.
      n: number of structures; default: the length of ``data``.
      schema: ``{key: (row shape, dtype string)}`` of ``data``'s arrays;
        default: read from ``data``.

    Attributes:
      data: the dataset (None where this process holds none).
      n: number of structures.
      schema: row shape and dtype of each key.
      batch: the global batch size.
      shuffle: whether each epoch is shuffled.
      seed: seed of the batch order.
      drop_last: whether an incomplete last batch is skipped.
    """

    def __init__(self, data: dict | None, batch: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, n: int | None = None, schema: dict | None = None):
        self.data = data
        self.n = dataset_length(data) if n is None else n
        self.schema = schema if schema is not None else describe(data)
        self.batch = batch
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last

    def __len__(self) -> int:
        return n_batches(self.n, self.batch, self.drop_last)

    def configure(self, batch: int, training: bool, seed: int, strategy, required=(),
                  weights=()) -> None:
        """Built configured by the trainer; only the seed can change."""
        self.seed = seed

    def global_batches(self, epoch: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return global_batches(self, epoch)

    def local_batches(self, strategy, epoch: int = 0) -> Iterator[dict]:
        """Yield this process's rows of each global batch as numpy arrays.

        The rows are ``strategy.select_rows``; with a strategy that
        ``scatters_from_root`` only the root holds ``data`` and sends them.
        """
        rows = strategy.local_rows(self.batch)
        for idx, valid in self.global_batches(epoch):
            local = strategy.select_rows(self.data, idx, self.schema, self.batch)
            local[VALID] = valid[rows]
            yield local


def n_batches(n: int, batch: int, drop_last: bool) -> int:
    full, rest = divmod(n, batch)
    return full if (drop_last or rest == 0) else full + 1


def global_batches(loader, epoch: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (indices, valid) of each global batch of ``loader`` (which has
    ``n``, ``batch``, ``seed``, ``shuffle``, ``drop_last``); the rows that pad
    an incomplete last batch repeat a real row and are marked invalid."""
    order = epoch_order(loader.n, epoch, loader.seed, loader.shuffle)
    for b in range(n_batches(loader.n, loader.batch, loader.drop_last)):
        idx = order[b * loader.batch:(b + 1) * loader.batch]
        valid = np.ones(loader.batch, bool)
        if idx.size < loader.batch:
            valid[idx.size:] = False
            idx = np.concatenate([idx, np.full(loader.batch - idx.size, order[0])])
        yield idx, valid


def describe(data: dict) -> dict:
    """Row shape and dtype of each array: what a process without the data
    needs to receive rows."""
    return {k: (tuple(v.shape[1:]), v.dtype.str) for k, v in data.items()}
