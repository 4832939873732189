"""Edges: precomputed graphs, edge vectors of graphs and jax-md lists (with
jax-md's strain), and cell geometry (perpendicular widths, the
minimum-image check). See :mod:`chemtrain.neighbors`."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from ..data.dataset import GRAPH_KEYS  # the data layout owns the names

_FORMATS = {"sparse": "Sparse", "dense": "Dense", "ordered_sparse": "OrderedSparse"}


class SmallCellError(ValueError):
    """A periodic cell narrower than twice the cutoff met a minimum-image
    neighbor list, which would miss periodic images within the cutoff."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Graph:
    """The edges of one structure: both directions of every pair, every
    periodic image within the cutoff (self images of small cells included).

    ``senders``, ``receivers`` (E,) integers (N marks a padded edge) and
    ``shifts`` (E, 3) integer cell-shift counts."""
    senders: jax.Array
    receivers: jax.Array
    shifts: jax.Array

    @property
    def idx(self):
        raise TypeError(
            "This energy function reads neighbor.idx (a jax-md neighbor list), but the data carry "
            "precomputed graphs (senders, receivers, shifts). Get edges with "
            "chemtrain.neighbors.edge_vectors(displacement_fn, positions, neighbor, box=..., "
            "perturbation=...), which handles both, or drop the graph keys from the data and "
            "pass a jax-md nbrs_init.")


def graph_from(data) -> Graph:
    """The :class:`Graph` held by the graph keys of ``data`` (one structure)."""
    return Graph(*(data[k] for k in GRAPH_KEYS))


def mask_graph(graph: Graph, mask) -> Graph:
    """Point every edge that touches an atom with ``mask`` False at N."""
    n = mask.shape[0]
    real = jnp.concatenate([mask.astype(bool), jnp.zeros((1,), bool)])
    s, r = jnp.clip(graph.senders, 0, n), jnp.clip(graph.receivers, 0, n)
    keep = real[s] & real[r]
    return dataclasses.replace(graph, senders=jnp.where(keep, graph.senders, n),
                               receivers=jnp.where(keep, graph.receivers, n))


# --------------------------------------------------------------- edge vectors

def _transform(perturbation, vectors):
    """jax-md's convention: a displacement d becomes ``perturbation @ d``."""
    p = jnp.asarray(perturbation, vectors.dtype)
    return vectors * p if p.ndim == 0 else vectors @ p.T


def edge_vectors(displacement_fn: Callable | None, positions, neighbor, box=None,
                 perturbation=None):
    """``(senders, receivers, vectors, real)`` of one structure.

    ``vectors[e]`` points from ``senders[e]`` to ``receivers[e]``; ``real``
    is False for padded edges (whose indices are clipped into range). With a
    :class:`Graph`, ``vectors = R[r] - R[s] + box @ shift`` (``box`` None:
    no shifts, free space); with a jax-md list (Sparse, Dense or
    OrderedSparse) ``displacement_fn(R[r], R[s], box=..., perturbation=...)``
    gives them, and self pairs are dropped. ``perturbation`` (scalar or
    3x3) multiplies every vector, as jax-md's displacement functions do.
    """
    n = positions.shape[0]
    if isinstance(neighbor, Graph):
        s, r = neighbor.senders, neighbor.receivers
        real = (s >= 0) & (s < n) & (r >= 0) & (r < n)
        sc, rc = jnp.clip(s, 0, n - 1), jnp.clip(r, 0, n - 1)
        vec = positions[rc] - positions[sc]
        if box is not None:
            vec = vec + neighbor.shifts.astype(vec.dtype) @ _box_matrix(box, vec.dtype).T
        if perturbation is not None:
            vec = _transform(perturbation, vec)
        return sc, rc, vec, real
    if displacement_fn is None:
        raise ValueError("A jax-md neighbor list needs a displacement function; this energy "
                         "function was built without one (precomputed graphs only).")
    r, s, _ = neighbor_pairs(neighbor, n)
    real = (r < n) & (s < n) & (r != s)
    rc, sc = jnp.minimum(r, n - 1), jnp.minimum(s, n - 1)
    kw = {k: v for k, v in (("box", box), ("perturbation", perturbation)) if v is not None}
    vec = jax.vmap(lambda a, b: displacement_fn(a, b, **kw))(positions[rc], positions[sc])
    if vec.shape != rc.shape + positions.shape[-1:]:
        raise ValueError(
            f"displacement_fn returned shape {vec.shape[1:]} for one pair of {positions.shape[-1]}-D "
            f"positions; a displacement function returns the vector between them. Is it a metric "
            f"(jax-md's space.metric, canonicalize_displacement_or_metric, which return distances)? "
            f"Pass the displacement, e.g. space.periodic(box)[0].")
    return sc, rc, vec, real


def neighbor_pairs(neighbor, n_atoms: int):
    """Return (i, j, weight) arrays of a Dense, Sparse or OrderedSparse jax-md
    neighbor list (i: ``idx[0]`` or the row); ``weight`` is 1/2 for lists
    that store each pair twice (see :func:`pair_weight`)."""
    from jax_md import partition
    idx = neighbor.idx
    if partition.is_sparse(neighbor.format):
        i, j = idx[0], idx[1]
    else:
        i = jnp.broadcast_to(jnp.arange(n_atoms)[:, None], idx.shape).reshape(-1)
        j = idx.reshape(-1)
    return i, j, pair_weight(neighbor)


def pair_weight(neighbor) -> float:
    """1/2 for edge sets holding both directions of every pair (graphs,
    jax-md Sparse and Dense), 1 for jax-md OrderedSparse: the factor of a
    pair energy summed over edges."""
    from jax_md import partition
    ordered = getattr(neighbor, "format", None) is partition.NeighborListFormat.OrderedSparse
    return 1.0 if ordered and not isinstance(neighbor, Graph) else 0.5


def _box_matrix(box, dtype=None):
    """A jax-md box (scalar side, (3,) sides or (3, 3), columns the cell
    vectors) as a (3, 3) matrix."""
    box = jnp.asarray(box, dtype)
    if box.ndim == 0:
        return box * jnp.eye(3, dtype=box.dtype)
    if box.ndim == 1:
        return jnp.diag(box)
    return box


# ------------------------------------------------------------ cell geometry

def _as_matrices(box) -> tuple[np.ndarray, bool]:
    """Boxes as (n, 3, 3) and whether a single box was given."""
    b = np.asarray(box, np.float64)
    if b.ndim == 0 or b.shape in ((3,), (3, 3)):
        return _as_matrices(b[None])[0], True
    if b.ndim == 1:                       # one side length per structure
        return b[:, None, None] * np.eye(3), False
    if b.ndim == 2 and b.shape[1] == 3:   # three side lengths per structure
        return np.einsum("ni,ij->nij", b, np.eye(3)), False
    if b.ndim == 3 and b.shape[1:] == (3, 3):
        return b, False
    raise ValueError(f"A box must be a side length, three side lengths or a 3x3 matrix (per "
                     f"structure: shape (n,), (n, 3) or (n, 3, 3)); got shape {np.shape(box)}.")


def perpendicular_widths(box) -> np.ndarray:
    """Distances between opposite faces of each cell, shape (n, 3) (or (3,)
    for one box): ``V / |a_j x a_k|`` for the cell vectors ``a`` (the
    columns of a jax-md box). A flat cell has width 0."""
    b, single = _as_matrices(box)
    a = np.swapaxes(b, 1, 2)              # rows are cell vectors
    vol = np.abs(np.linalg.det(a))
    out = np.empty(a.shape[:2])
    for k in range(3):
        area = np.linalg.norm(np.cross(a[:, (k + 1) % 3], a[:, (k + 2) % 3]), axis=-1)
        out[:, k] = np.where(area > 0, vol / np.where(area > 0, area, 1.0), 0.0)
    return out[0] if single else out


def check_minimum_image(box, cutoff: float, pbc=None, name: str = "the cell",
                        unit: str = "nm", fix: str | None = None) -> None:
    """Raise :class:`SmallCellError` if a periodic cell is narrower than
    twice ``cutoff`` along a periodic direction (or periodic only in some
    directions, which jax-md's periodic spaces cannot do).

    ``box``: one box or one per structure (jax-md layout); ``pbc``: None
    (periodic in all three directions) or (3,) / (n, 3) booleans. ``fix``
    replaces the advice that ends the message (by default: precompute
    graphs, or use a supercell)."""
    widths = np.atleast_2d(perpendicular_widths(box))
    periodic = np.broadcast_to(np.asarray(True if pbc is None else pbc, bool), widths.shape)
    part = periodic.any(1) & ~periodic.all(1)
    if part.any():
        k = int(np.nonzero(part)[0][0])
        raise SmallCellError(
            f"{name}: structure {k} is periodic along {periodic[k].tolist()} only; a jax-md "
            f"neighbor list is periodic in all three directions or none. Precompute graphs "
            f"(chemtrain.neighbors.add_graphs(data, cutoff)), which handle slabs.")
    small = periodic.all(1) & (widths.min(1) < 2 * cutoff)
    if small.any():
        rows = np.nonzero(small)[0]
        k = int(rows[0])
        which = "" if widths.shape[0] == 1 else (
            f" ({rows.size} structure(s), first {rows[:5].tolist()})")
        raise SmallCellError(
            f"{name}{which} has perpendicular widths "
            f"{np.array2string(widths[k], precision=4)} {unit}, narrower than twice the cutoff "
            f"({cutoff:.4g} {unit}, so at least {2 * cutoff:.4g} {unit} needed): a jax-md "
            f"(minimum-image) neighbor list would count one periodic image of each pair where "
            f"several lie within the cutoff, a silently wrong energy. "
            + (fix or f"Precompute graphs instead (chemtrain.neighbors.add_graphs(data, cutoff) "
                      f"and nbrs_init=None), which count every image, or use a supercell at "
                      f"least {2 * cutoff:.4g} {unit} wide."))
