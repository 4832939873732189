"""The reference configurations a relative-entropy state point learns
from (:class:`ReferenceFrames`), checked and read once where the state
point is added."""
from __future__ import annotations

import jax
import numpy as np

from ..checksum import crc


class ReferenceFrames:
    """The reference configurations of one relative-entropy state point.

    An array (frames, N, dim), or a loader with ``read_indices(rows)`` and a
    ``schema`` holding ``'R'`` (:class:`chemtrain.data.HDF5ParallelDataLoader`),
    read batch by batch. Checked against the simulation's reference state
    (N, dim): shape, finite positions, the same scale (:func:`check_frame_scale`);
    cast to its dtype. Built once: ``nbrs`` is a neighbor list of
    ``neighbor_fn`` that holds every frame, ``checksum`` a loader's content.

    Args:
      data: the frames or a loader of them.
      reference_state: the simulation's initial positions, (N, dim) or
        (chains, N, dim).
      batch_size: frames per update (None: all).
      where: the state point's name in messages.
      neighbor_fn: jax-md neighbor-list functions of the model (None: no
        ``nbrs``).
    """

    def __init__(self, data, reference_state, batch_size, where: str, neighbor_fn=None):
        reference_state = np.asarray(reference_state)
        frame_shape, dtype = reference_state.shape[-2:], reference_state.dtype
        self.where, self.dtype = where, np.dtype(dtype)
        self.loader = data if hasattr(data, "read_indices") and hasattr(data, "schema") else None
        if self.loader is not None:
            if "R" not in self.loader.schema:
                raise ValueError(f"{where}: the reference loader has no dataset 'R' (positions); "
                                 f"it has {sorted(self.loader.schema)}.")
            shape, self.n = (int(self.loader.n), *self.loader.schema["R"][0]), int(self.loader.n)
            self.array = None
        else:
            try:
                self.array = np.asarray(data)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{where}: reference_data must be an array of positions (frames, "
                                f"N, dim) or a chemtrain loader, got {type(data).__name__}.") from e
            shape, self.n = self.array.shape, (len(self.array) if self.array.ndim else 0)
            if self.array.dtype.kind not in "fiu":
                raise TypeError(f"{where}: reference_data must hold numbers, got dtype "
                                f"{self.array.dtype}.")
        if len(shape) != 3:
            raise ValueError(f"{where}: reference_data must have shape (frames, N, dim), got "
                             f"{tuple(shape)}.")
        if self.n == 0:
            raise ValueError(f"{where}: reference_data is empty (0 frames); relative entropy "
                             f"needs reference configurations.")
        if tuple(shape[1:]) != tuple(frame_shape):
            raise ValueError(f"{where}: the reference configurations have {shape[1]} particles "
                             f"in {shape[2]} dimensions, but the simulation has "
                             f"{frame_shape[0]} in {frame_shape[1]} (reference_state); map them "
                             f"to the coarse-grained sites of the model first.")
        if self.array is not None:
            self.array = self.array.astype(self.dtype, copy=False)
            self.check_finite(self.array, np.arange(self.n))
        if batch_size is None:
            batch_size = self.n
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ValueError(f"{where}: reference_batch_size must be a positive whole number or "
                             f"None, got {batch_size!r}.")
        if batch_size > self.n:
            raise ValueError(f"{where}: reference_batch_size={batch_size} is larger than the "
                             f"reference data ({self.n} frames); use at most {self.n}.")
        self.batch_size = int(batch_size)
        check_frame_scale(where, self.take(np.arange(1))[0], reference_state.reshape(
            -1, *frame_shape)[0])
        self.checksum, self.nbrs = self._scan(neighbor_fn)

    def _scan(self, neighbor_fn, chunk: int = 256):
        """One pass over every frame: the checksum of a loader's content
        (node-local copies may differ) and, given ``neighbor_fn``, a
        neighbor list that holds every frame: allocated at frame 0 and again
        at the first frame that overflows it, until none does. Whether a
        list overflows depends on the positions only, so it holds them for
        any parameters."""
        total, nbrs = 0, None
        fits = jax.jit(jax.vmap(lambda nb, r: nb.update(r).did_buffer_overflow, (None, 0)))
        for start in range(0, self.n, chunk):
            R = self.take(np.arange(start, min(start + chunk, self.n)))
            if self.loader is not None:
                total = crc(R, start=total)
            if neighbor_fn is None:
                continue
            for _ in range(len(R) + 1):
                if nbrs is None:
                    nbrs = neighbor_fn.allocate(R[0])
                bad = np.flatnonzero(np.asarray(fits(nbrs, R)))
                if not len(bad):
                    break
                nbrs = neighbor_fn.allocate(R[int(bad[0])])
            else:
                raise RuntimeError(f"{self.where}: the neighbor list of the reference frames "
                                   f"still overflows after growing it for every frame.")
        return total, nbrs

    def check_finite(self, R, rows) -> None:
        bad = ~np.isfinite(R).reshape(len(R), -1).all(axis=1)
        if bad.any():
            frames = np.asarray(rows)[bad][:5].tolist()
            raise ValueError(f"{self.where}: reference frame(s) {frames} hold NaN or infinite "
                             f"positions; remove them from reference_data.")

    def take(self, rows):
        """The frames ``rows``, checked finite, in the simulation's dtype."""
        if self.array is not None:
            return self.array[rows]
        R = np.asarray(self.loader.read_indices(rows)["R"]).astype(self.dtype, copy=False)
        self.check_finite(R, rows)
        return R

    def fingerprint(self):
        """What must be equal on every process: the array, or the loader's
        file and size, with the batch size."""
        if self.array is not None:
            return np.append(np.ravel(self.array).astype(np.float64), self.batch_size)
        name = str(getattr(self.loader, "path", type(self.loader).__name__))
        return np.array([crc(name), self.n, self.batch_size, self.checksum])


#: reference frames spanning more than this many times the simulation's
#: reference state (or less than its inverse) are refused as in other units
FRAME_SCALE_LIMIT = 4.0


def check_frame_scale(name, frame, reference_state) -> None:
    """Refuse a reference frame whose positions span a region of another size
    than the simulation's reference state (largest extent over the
    dimensions): frames in Angstrom for a model in nm span 10 times as much,
    and the minimum image would fold their bonds silently."""
    span = float(np.max(np.ptp(frame, axis=0)))
    own = float(np.max(np.ptp(reference_state, axis=0)))
    if own > 0 and span > 0 and not 1 / FRAME_SCALE_LIMIT <= span / own <= FRAME_SCALE_LIMIT:
        raise ValueError(f"State point {name}: reference frame 0 spans {span:.4g} (largest extent "
                         f"of its positions) where the simulation's reference state spans "
                         f"{own:.4g}, {span / own:.3g} times as much. Pass reference frames in "
                         f"the model's units and coordinates (nm; Angstrom are 10 times larger; "
                         f"fractional coordinates if the simulation uses them).")
