"""One process, one device: plain ``jax.jit``, no collectives."""
from __future__ import annotations

import jax

from .base import Strategy


class SingleStrategy(Strategy):
    name = "single"

    def __init__(self, device=None):
        self._device = device if device is not None else jax.devices()[0]

    @property
    def n_shards(self) -> int:
        return 1

    def place_batch(self, local_batch):
        return jax.device_put(local_batch, self._device)

    def replicate(self, tree):
        return jax.device_put(tree, self._device)

    def compile(self, fn, in_sharded, out_sharded):
        return jax.jit(fn)
