"""JAX SPMD over a 1-D mesh with axis ``data``: local devices, or all
processes' devices after ``jax.distributed.initialize``.

State is replicated (``P()``), batches are split along axis 0
(``P('data')``). Per-shard functions run under ``jax.shard_map``; gradients
of replicated parameters are taken with the parameters cast to varying and
averaged with ``lax.pmean`` (the rule that is right with and without the
varying-axis check).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .base import Strategy, contiguous_rows

AXIS = "data"


def check_mesh(mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}. "
            f"Build one with jax.sharding.Mesh(jax.devices(), ('{AXIS}',)).")
    if tuple(mesh.axis_names) != (AXIS,):
        raise ValueError(
            f"mesh must be 1-D with the single axis name '{AXIS}', got axes "
            f"{tuple(mesh.axis_names)} with shape {dict(mesh.shape)}. Build it "
            f"with jax.sharding.Mesh(np.array(devices), ('{AXIS}',)).")
    return mesh


class JaxStrategy(Strategy):
    name = "jax"

    def __init__(self, mesh: Mesh | None = None, check_vma: bool = True):
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()), (AXIS,))
        self.mesh = check_mesh(mesh)
        self.check_vma = check_vma
        self._rep = NamedSharding(self.mesh, P())
        self._shard = NamedSharding(self.mesh, P(AXIS))
        # Positions of this process's devices along the mesh axis; they must
        # form one contiguous block so that a process reads one slice.
        devs = list(self.mesh.devices.flat)
        mine = [i for i, d in enumerate(devs) if d.process_index == jax.process_index()]
        if not mine:
            raise ValueError("The mesh holds none of this process's devices.")
        if mine != list(range(mine[0], mine[0] + len(mine))):
            raise ValueError(
                "This process's devices are not contiguous along the mesh axis "
                f"(positions {mine}); build the mesh from jax.devices() in order.")
        self._my_positions = mine
        if self.process_count > 1:
            from .failures import install_excepthook, start_jax_watchdog
            start_jax_watchdog()
            install_excepthook(self)

    @property
    def n_shards(self) -> int:
        return int(self.mesh.size)

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def process_count(self) -> int:
        return len({d.process_index for d in self.mesh.devices.flat})

    @property
    def scatters_from_root(self) -> bool:
        return False  # every process holds in-memory data and reads its rows

    def local_rows(self, batch: int) -> slice:
        per_shard = batch // self.n_shards
        first = self._my_positions[0]
        return slice(first * per_shard, (first + len(self._my_positions)) * per_shard)

    def select_rows(self, data, idx, schema, batch):
        return contiguous_rows(data, idx, self.local_rows(batch))

    # -- placement ----------------------------------------------------------
    def place_batch(self, local_batch):
        if self.process_count == 1:
            return jax.device_put(local_batch, self._shard)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._shard, np.asarray(x)),
            local_batch)

    def replicate(self, tree):
        if self.process_count == 1:
            return jax.device_put(tree, self._rep)
        # Every process holds the same host value (broadcast_from_root first).
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._rep, np.asarray(x)),
            tree)

    def broadcast_from_root(self, tree):
        if self.process_count == 1:
            return tree
        from jax.experimental import multihost_utils
        return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))

    def to_host(self, x, sharded: bool = False):
        if self.process_count == 1:
            return jax.tree.map(np.asarray, x)
        if sharded:
            from jax.experimental import multihost_utils
            return jax.tree.map(np.asarray, multihost_utils.process_allgather(x, tiled=True))
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), x)

    # -- host-level communication -----------------------------------------
    def host_max(self, value):
        if self.process_count == 1:
            return value
        from jax.experimental import multihost_utils
        vals = multihost_utils.process_allgather(np.asarray(value, np.float64))
        return float(np.max(vals))

    def host_sum(self, tree):
        if self.process_count == 1:
            return tree
        from jax.experimental import multihost_utils
        return jax.tree.map(
            lambda x: np.sum(np.asarray(multihost_utils.process_allgather(np.asarray(x))), axis=0),
            tree)

    def host_allgather(self, value):
        if self.process_count == 1:
            return [value]
        from jax.experimental import multihost_utils
        return list(np.asarray(multihost_utils.process_allgather(np.asarray(value))))

    def host_allgather_object(self, obj):
        if self.process_count == 1:
            return [obj]
        import json
        from jax.experimental import multihost_utils
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        n = int(np.max(multihost_utils.process_allgather(np.int64(data.size))))
        buf = np.zeros(n, np.uint8)
        buf[:data.size] = data
        rows = np.asarray(multihost_utils.process_allgather(buf))
        return [json.loads(r.tobytes().rstrip(b"\0").decode()) for r in rows]

    def abort(self, message: str) -> None:
        if self.process_count == 1:
            return  # nothing to end: the exception propagates
        from .failures import jax_abort
        jax_abort(message)

    def bcast_object(self, obj):
        if self.process_count == 1:
            return obj
        import json
        from jax.experimental import multihost_utils
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8) if self.is_root else np.zeros(0, np.uint8)
        n = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
        buf = np.zeros(n, np.uint8)
        buf[:data.size] = data
        out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        return json.loads(out.tobytes().decode())

    # -- inside compiled per-shard functions ------------------------------
    def vary(self, tree):
        return jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), tree)

    def mean(self, tree):
        return jax.lax.pmean(tree, AXIS)

    def sum(self, tree):
        return jax.lax.psum(tree, AXIS)

    def mean_gradient(self, grads):
        return self.mean(grads)

    def compile(self, fn, in_sharded, out_sharded):
        spec = lambda s: P(AXIS) if s else P()
        in_specs = tuple(spec(s) for s in in_sharded)
        out_specs = (tuple(spec(s) for s in out_sharded)
                     if isinstance(out_sharded, tuple) else spec(out_sharded))
        mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs,
                               out_specs=out_specs, check_vma=self.check_vma)
        return jax.jit(mapped)

    def describe(self):
        return (f"jax: {self.n_shards} device(s) over {self.process_count} "
                f"process(es), mesh axis '{AXIS}'")
