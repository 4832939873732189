"""HDF5ParallelDataLoader: every process reads only its own rows, in a thread.

The file's root holds equal-length datasets, one row per structure (``R``,
``F``, ``U``, ``mask``, ``species``, ``box``, ``stress``, precomputed graphs
``senders``/``receivers``/``shifts``, ...; see ``chemtrain.data.convert``).
Every process draws the same batch order from ``(seed, epoch)`` and reads, in
a background thread, only the rows the parallel strategy assigns to it (MPI:
its contiguous block of the global batch; JAX: the blocks of its devices).
The thread hands numpy arrays through a bounded queue; the training thread
places them on devices. An exception in the thread is raised in the training
thread at the next batch, with its original traceback.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Iterator

import numpy as np

from ..checksum import crc
from .dataset import GRAPH_KEYS, check_shapes, check_weights
from .loader import VALID, global_batches, n_batches

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class HDF5ParallelDataLoader:
    """Batches from an HDF5 file, read by each process for itself.

    Args:
      source: path of the HDF5 file (required for multi-process runs: each
        process opens and closes its own read-only handle), or an open
        ``h5py.File`` (single-process runs only).
      keys: datasets to read (default: all datasets at the root).
      shuffle: shuffle every epoch (default: True for training, False for
        evaluation; decided by ``trainer.set_loader``).
      seed: seed of the batch order (default: the trainer's seed).
      prefetch: number of batches read ahead (bounded queue depth).
      rows: use only these rows of the file (e.g. a training split), in
        ascending order; default all.
      dtype: hand out floating-point datasets in this precision (e.g.
        ``np.float32`` for float32 training from a float64 file).
    """

    def __init__(self, source, keys=None, shuffle: bool | None = None, seed: int | None = None,
                 prefetch: int = 2, rows=None, dtype=None):
        import h5py
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}.")
        self.source = source
        self.prefetch = prefetch
        self.shuffle = shuffle
        self.seed = seed
        self.batch = None
        self.drop_last = True
        if isinstance(source, h5py.File):
            self.path = source.filename
            info = _inspect(source, self.path)
        else:
            self.path = os.fspath(source)
            if not os.path.exists(self.path):
                raise FileNotFoundError(f"HDF5 file {self.path!r} does not exist.")
            with h5py.File(self.path, "r") as f:
                info = _inspect(f, self.path)
        self.n, shapes = info
        if keys is not None:
            missing = [k for k in keys if k not in shapes]
            if missing:
                raise KeyError(f"{self.path!r} has no dataset(s) {missing} at its root; it has "
                               f"{sorted(shapes)}.")
            shapes = {k: shapes[k] for k in keys}
        self.rows = None if rows is None else _check_rows(rows, self.n, self.path)
        if self.rows is not None:
            self.n = len(self.rows)
        self.dtype = None if dtype is None else np.dtype(dtype)
        if self.dtype is not None:
            if self.dtype.kind != "f":
                raise ValueError(f"dtype must be a floating-point type (np.float32 or "
                                 f"np.float64), got {self.dtype}.")
            shapes = {k: (shape, self.dtype.str if np.dtype(t).kind == "f" else t)
                      for k, (shape, t) in shapes.items()}
        self.schema = shapes

    # -- set-up by the trainer ---------------------------------------------
    def configure(self, batch: int, training: bool, seed: int, strategy, required=(),
                  weights=()) -> None:
        """Bind to a trainer's global batch, stage and strategy (called by
        ``trainer.set_loader``).

        Every process must see the same file (rows and datasets; checked
        first, so that a difference raises on all of them). The datasets'
        shapes are checked as :func:`chemtrain.data.validate_dataset` checks
        arrays (``U`` (n,), ``F`` like ``R`` (n, atoms, 3), ...), and the
        per-structure weights named in ``weights`` are read once and must be
        finite and >= 0."""
        import h5py
        weights = [k for k in weights if k in self.schema]
        values = self._read_columns(weights)
        schema = {k: [list(shape), dtype] for k, (shape, dtype) in sorted(self.schema.items())}
        strategy.check_same({"n": self.n, "schema": schema,
                             "weights": {k: crc(v) for k, v in values.items()}},
                            f"the HDF5 file {self.path!r} (rows and datasets)")
        missing = [k for k in required if k not in self.schema]
        if missing:
            raise KeyError(f"{self.path!r} lacks the dataset(s) {missing} that training needs; "
                           f"it has {sorted(self.schema)}.")
        for k in ("R", "U", "F", "stress", "box", *weights):
            if k in self.schema and np.dtype(self.schema[k][1]).kind not in "fiu":
                raise ValueError(f"The HDF5 file {self.path!r}: dataset {k!r} must hold numbers, "
                                 f"got dtype {np.dtype(self.schema[k][1])}.")
        for k in GRAPH_KEYS:
            if k in self.schema and np.dtype(self.schema[k][1]).kind not in "iu":
                raise ValueError(f"The HDF5 file {self.path!r}: dataset {k!r} must hold integers "
                                 f"(a precomputed graph), got dtype {np.dtype(self.schema[k][1])}.")
        check_shapes({k: (self.n, *shape) for k, (shape, _) in self.schema.items()}, self.n,
                     f"the HDF5 file {self.path!r}: dataset", weights, where="file")
        for k, v in values.items():
            check_weights(v, k, f"the HDF5 file {self.path!r}: dataset")
        if isinstance(self.source, h5py.File) and strategy.process_count > 1:
            raise ValueError(
                f"An open h5py.File cannot be shared by the {strategy.process_count} processes "
                f"of this run: pass the file path ({self.path!r}) instead, so that each process "
                f"opens its own read-only handle.")
        strategy.check_batch(batch)
        if training and self.n < batch:
            raise ValueError(f"{self.path!r} has {self.n} structures, fewer than batch={batch}.")
        self.batch = batch
        self.drop_last = training
        if self.shuffle is None:
            self.shuffle = training
        if self.seed is None:
            self.seed = seed

    def read_columns(self, keys) -> dict:
        """Whole (small, per-structure) datasets such as ``box``, read once
        (the trainer checks cells against its neighbor list's cutoff)."""
        return self._read_columns(keys)

    def _read_columns(self, keys) -> dict:
        """Whole (small, per-structure) datasets, read once."""
        if not keys:
            return {}
        with self._open() as f:
            out = {k: np.asarray(f[k][()]) for k in keys}
        return self._cast({k: v if self.rows is None else v[self.rows] for k, v in out.items()})

    def _cast(self, data: dict) -> dict:
        if self.dtype is None:
            return data
        return {k: v.astype(self.dtype) if v.dtype.kind == "f" else v for k, v in data.items()}

    def __len__(self) -> int:
        return n_batches(self.n, self.batch, self.drop_last)

    # -- reading -------------------------------------------------------------
    def _open(self):
        """Open the file read-only for one epoch (one handle per process)."""
        import h5py
        if isinstance(self.source, h5py.File):
            return _Borrowed(self.source)
        return h5py.File(self.path, "r")

    def _plan(self, strategy, epoch):
        """(rows to read, validity) of this process for every batch."""
        rows = strategy.local_rows(self.batch)
        for idx, valid in global_batches(self, epoch):
            yield idx[rows], valid[rows]

    def read_rows(self, f, idx: np.ndarray) -> dict:
        """Read rows ``idx`` of every dataset of the open file ``f``, one
        slice per run of consecutive rows (much faster in h5py than a point
        selection). The reader thread calls it once per batch: a subclass
        may override it to add caching, logging or fault injection."""
        if self.rows is not None:
            idx = self.rows[idx]
        unique, inverse = np.unique(idx, return_inverse=True)
        cuts = np.nonzero(np.diff(unique) != 1)[0] + 1
        runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(unique, cuts)]
        out = {}
        for k in self.schema:
            ds = f[k]
            rows = [ds[a:b] for a, b in runs]
            out[k] = (rows[0] if len(rows) == 1 else np.concatenate(rows))[inverse]
        return self._cast(out)

    def read_indices(self, idx) -> dict:
        """Rows ``idx`` of every dataset, read now (for a trainer that draws
        its own rows, e.g. relative entropy's reference batches)."""
        with self._open() as f:
            return self.read_rows(f, np.asarray(idx))

    def local_batches(self, strategy, epoch: int = 0) -> Iterator[dict]:
        """Yield this process's rows of every batch of an epoch (numpy), read
        ahead in a background thread."""
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        plan = self._plan(strategy, epoch)  # a generator: O(1) memory per epoch

        def put(item):
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work():
            try:
                with self._open() as f:
                    for idx, valid in plan:
                        local = self.read_rows(f, idx)
                        local[VALID] = valid
                        if not put(local):
                            return
                put(_END)
            except BaseException as e:  # reaches the training thread
                put(_Failure(e))

        thread = threading.Thread(target=work, name="chemtrain-hdf5-reader", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    break
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            stop.set()
            thread.join(timeout=10)


def _check_rows(rows, n: int, path: str) -> np.ndarray:
    """``rows`` as sorted int64 row numbers of a file of ``n`` rows."""
    r = np.asarray(rows)
    if r.ndim != 1 or r.size == 0 or r.dtype.kind not in "iu":
        raise ValueError(f"rows must be a non-empty 1-D array of row numbers of {path!r}, got "
                         f"{'dtype ' + str(r.dtype) if r.ndim == 1 else 'shape ' + str(r.shape)}.")
    bad = r[(r < 0) | (r >= n)]
    if bad.size:
        raise ValueError(f"rows holds {bad.size} row number(s) outside the {n} rows of {path!r} "
                         f"(0 to {n - 1}), first {bad[:5].tolist()}.")
    r = np.sort(r.astype(np.int64))
    if np.any(np.diff(r) == 0):
        raise ValueError(f"rows names row(s) {np.unique(r[1:][np.diff(r) == 0])[:5].tolist()} "
                         f"more than once; give each row of {path!r} once.")
    return r


class _Borrowed:
    """Context manager that lends an open file without closing it."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        return False


def _inspect(f, path) -> tuple[int, dict]:
    """Number of rows and {name: (row shape, dtype)} of the root datasets."""
    import h5py
    datasets = {k: v for k, v in f.items() if isinstance(v, h5py.Dataset)}
    if not datasets:
        nested = []
        f.visititems(lambda name, obj: nested.append(name) if isinstance(obj, h5py.Dataset) else None)
        where = f" (found datasets only inside groups: {nested[:5]})" if nested else ""
        raise ValueError(f"{path!r} has no datasets at its root{where}. The loader expects one "
                         f"dataset per quantity at the root, one row per structure; write them "
                         f"there, e.g. with python -m chemtrain.data.convert.")
    lengths = {k: (v.shape[0] if v.shape else None) for k, v in datasets.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{path!r}: the root datasets must have equal length (one row per "
                         f"structure), got lengths {lengths}.")
    n = next(iter(lengths.values()))
    return n, {k: (tuple(v.shape[1:]), v.dtype.str) for k, v in datasets.items()}
