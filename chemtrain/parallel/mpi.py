"""One process per device under mpirun: mpi4py on the host, mpi4jax inside jit.

Each rank holds a full replica of the state on its single device. A step's
gradient pytree is raveled into one buffer and averaged with one allreduce;
every rank then applies the same optax update, so parameters are never sent
after the initial broadcast. In-memory datasets live on rank 0, which sends
each rank its contiguous rows of every batch.
"""
from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

from .base import Strategy

INSTALL_HINT = "pip install 'chemtrain[mpi]'  (or: pip install mpi4py 'mpi4jax>=0.9.0.post1')"


def _import_mpi4py():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"parallelism='mpi' needs the package mpi4py, which could not be "
                          f"imported ({e}). Install it with: {INSTALL_HINT}") from e
    return MPI


def _import_mpi4jax():
    try:
        import mpi4jax
    except Exception as e:  # a broken build raises more than ImportError
        raise ImportError(f"parallelism='mpi' with more than one rank needs the package "
                          f"mpi4jax, which could not be imported ({type(e).__name__}: {e}). "
                          f"Install it with: {INSTALL_HINT}; build it against the MPI "
                          f"of your mpirun, with pip install --no-cache-dir.") from e
    return mpi4jax


class MpiStrategy(Strategy):
    name = "mpi"

    def __init__(self):
        MPI = _import_mpi4py()
        self.MPI = MPI  # the mpi4py module (its operations and communicators)
        self.comm = MPI.COMM_WORLD
        n_local = jax.local_device_count()
        if n_local != 1:
            raise RuntimeError(
                f"parallelism='mpi' runs one process per device, but rank {self.comm.Get_rank()} "
                f"sees {n_local} JAX devices ({jax.local_devices()}). Give each rank one device: "
                f"set CUDA_VISIBLE_DEVICES per rank (e.g. CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK "
                f"or $MPI_LOCALRANKID in a wrapper script), or on CPU do not set "
                f"--xla_force_host_platform_device_count. To use several devices per process, "
                f"use parallelism='jax'.")
        self._device = jax.local_devices()[0]
        self._mpi4jax = None
        if self.comm.Get_size() > 1:
            self._mpi4jax = _import_mpi4jax()
            self._jax_comm = self.comm.Clone()  # mpi4jax gets its own communicator
            from .failures import install_excepthook, start_mpi_exit_watch
            install_excepthook(self)
            start_mpi_exit_watch(self)

    @property
    def n_shards(self) -> int:
        return self.comm.Get_size()

    @property
    def process_index(self) -> int:
        return self.comm.Get_rank()

    @property
    def process_count(self) -> int:
        return self.comm.Get_size()

    @property
    def scatters_from_root(self) -> bool:
        return True  # in-memory datasets live on rank 0

    def local_rows(self, batch: int) -> slice:
        per_rank = batch // self.n_shards
        return slice(self.process_index * per_rank, (self.process_index + 1) * per_rank)

    # -- placement ----------------------------------------------------------
    def place_batch(self, local_batch):
        return jax.device_put(local_batch, self._device)

    def replicate(self, tree):
        return jax.device_put(tree, self._device)

    def broadcast_from_root(self, tree):
        return jax.tree.map(np.asarray, self.comm.bcast(jax.tree.map(np.asarray, tree), root=0))

    def to_host(self, x, sharded: bool = False):
        local = jax.tree.map(np.asarray, x)
        if not sharded or self.n_shards == 1:
            return local
        parts = self.comm.allgather(local)
        return jax.tree.map(lambda *p: np.concatenate(p), *parts)

    def select_rows(self, data, idx, schema, batch):
        """Rank 0 sends each rank its contiguous rows ``idx[local_rows]`` of
        ``data``; the others receive them by ``schema``, without the data."""
        per = batch // self.n_shards
        rank = self.process_index
        if rank == 0:
            for r in range(1, self.n_shards):
                for tag, k in enumerate(sorted(schema)):
                    self.comm.Send(np.ascontiguousarray(data[k][idx[r * per:(r + 1) * per]]),
                                   dest=r, tag=tag)
            return {k: data[k][idx[:per]] for k in schema}
        out = {}
        for tag, k in enumerate(sorted(schema)):
            shape, dtype = schema[k]
            out[k] = np.empty((per, *shape), np.dtype(dtype))
            self.comm.Recv(out[k], source=0, tag=tag)
        return out

    # -- host-level communication -----------------------------------------
    def host_max(self, value):
        return self.comm.allreduce(value, op=self.MPI.MAX)

    def host_allgather(self, value):
        return self.comm.allgather(value)

    def host_sum(self, tree):
        if self.n_shards == 1:
            return tree
        def reduce(x):
            shape = np.shape(x)  # ascontiguousarray makes 0-d arrays 1-d
            x = np.ascontiguousarray(x)
            out = np.empty_like(x)
            self.comm.Allreduce(x, out, op=self.MPI.SUM)
            return out.reshape(shape)
        return jax.tree.map(reduce, tree)

    def host_allgather_object(self, obj):
        return self.comm.allgather(obj)

    def bcast_object(self, obj):
        return self.comm.bcast(obj, root=0)

    def abort(self, message: str) -> None:
        if self.n_shards == 1:
            return  # nothing to end: the exception propagates
        sys.stderr.write(f"{message}\nchemtrain: aborting all {self.n_shards} MPI ranks.\n")
        sys.stderr.flush()
        # Give the launcher a moment to forward the message: once any rank
        # aborts, mpirun tears the job down and may drop unread output.
        time.sleep(1.0)
        self.comm.Abort(1)
        # MPICH's MPI_Abort can return before the launcher ends this process;
        # nothing after a failure may run here (it could write files).
        os._exit(1)

    # -- inside compiled per-shard functions ------------------------------
    def _allreduce_sum(self, tree):
        if self._mpi4jax is None:
            return tree
        flat, unravel = ravel_pytree(tree)
        total = self._mpi4jax.allreduce(flat, op=self.MPI.SUM, comm=self._jax_comm)
        return unravel(total)

    def vary(self, tree):
        return tree  # each rank runs its own jit: nothing is marked replicated

    def sum(self, tree):
        return self._allreduce_sum(tree)

    def mean(self, tree):
        n = self.n_shards
        return jax.tree.map(lambda x: x / n, self._allreduce_sum(tree))

    def mean_gradient(self, grads):
        # one packed buffer, one allreduce (ravel_pytree concatenates leaves)
        return self.mean(grads)

    def compile(self, fn, in_sharded, out_sharded):
        return jax.jit(fn)

    def describe(self):
        return f"mpi: {self.n_shards} rank(s), one device each"
