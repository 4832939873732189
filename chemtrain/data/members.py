"""Training batches for a committee of K members (:class:`MemberLoader`):
each member draws its own order of the training set, and optionally its own
bootstrap sample of it, so that member ``k`` sees exactly the batches a
single trainer with seed ``seed + k`` would see on its (bootstrapped) set.

A step's batch holds, per row, one structure for each member: arrays of
shape ``(rows, K, ...)``. Rows are split over processes and devices as any
batch's, so every parallel method works unchanged.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .loader import VALID, InMemoryLoader, epoch_order, n_batches

#: the extra stream of a member's bootstrap draw (beside its seed)
BOOTSTRAP_STREAM = 104729


def bootstrap_indices(n: int, seed: int, member: int) -> np.ndarray:
    """Member ``member``'s bootstrap sample of ``n`` training structures.

    Args:
      n: the number of training structures.
      seed: the committee's seed.
      member: the member's index.

    Returns:
      ``n`` indices (sorted, int64) drawn with replacement from
      ``numpy.random.default_rng([seed + member, BOOTSTRAP_STREAM])``.
    """
    rng = np.random.default_rng([seed + member, BOOTSTRAP_STREAM])
    return np.sort(rng.integers(0, n, n))


def member_order(n: int, epoch: int, seed: int, member: int,
                 bootstrap: np.ndarray | None = None) -> np.ndarray:
    """The training structures of member ``member`` in epoch ``epoch``, in order.

    Args:
      n: the number of training structures.
      epoch: the epoch.
      seed: the committee's seed.
      member: the member's index.
      bootstrap: the member's bootstrap indices, or None (the whole set).

    Returns:
      The order a single trainer with seed ``seed + member`` draws
      (:func:`chemtrain.data.loader.epoch_order`), mapped through
      ``bootstrap`` if given.
    """
    order = epoch_order(n, epoch, seed + member, True)
    return order if bootstrap is None else np.asarray(bootstrap)[order]


class MemberLoader:
    """Training batches of K members from an in-memory training set.

    Args:
      base: the training set's :class:`~chemtrain.data.InMemoryLoader`
        (shuffled, ``drop_last``): its data, global batch and seed.
      n_members: K.
      bootstrap: train each member on its own bootstrap sample
        (:func:`bootstrap_indices`) instead of the whole set.

    Attributes:
      n: the number of training structures.
      seed: the committee's seed (member ``k`` orders with ``seed + k``).
      batch: the global batch (rows per step; each row holds K structures).
      schema: row shape and dtype of each key, rows of K structures.
    """

    def __init__(self, base: InMemoryLoader, n_members: int, bootstrap: bool = False):
        self.base, self.n_members, self.bootstrap = base, int(n_members), bool(bootstrap)
        self.n, self.batch = base.n, base.batch
        self.schema = {k: ((self.n_members, *shape), dtype)
                       for k, (shape, dtype) in base.schema.items()}

    @property
    def seed(self) -> int:
        return self.base.seed

    @seed.setter
    def seed(self, seed: int) -> None:
        self.base.seed = seed

    def __len__(self) -> int:
        return n_batches(self.n, self.batch, True)

    def configure(self, batch: int, training: bool, seed: int, strategy, required=(),
                  weights=()) -> None:
        """Built configured by the trainer; only the seed can change."""
        self.seed = seed

    def samples(self, member: int) -> np.ndarray | None:
        """Member ``member``'s bootstrap indices, or None without bootstrap."""
        return bootstrap_indices(self.n, self.seed, member) if self.bootstrap else None

    def global_batches(self, epoch: int = 0) -> Iterator[np.ndarray]:
        """The (batch, K) structure indices of each step of ``epoch``."""
        orders = [member_order(self.n, epoch, self.seed, k, self.samples(k))
                  for k in range(self.n_members)]
        for b in range(len(self)):
            yield np.stack([o[b * self.batch:(b + 1) * self.batch] for o in orders], axis=1)

    def local_batches(self, strategy, epoch: int = 0) -> Iterator[dict]:
        """This process's rows of each step, arrays ``(rows, K, ...)``."""
        for idx in self.global_batches(epoch):
            local = strategy.select_rows(self.base.data, idx, self.schema, self.batch)
            rows = len(next(iter(local.values())))
            local[VALID] = np.ones((rows, self.n_members), bool)   # training: no padding
            yield local
