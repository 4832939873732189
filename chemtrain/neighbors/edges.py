"""Edges: precomputed graphs, edge vectors of graphs and jax-md lists (with
jax-md's strain), and cell geometry (perpendicular widths, the
minimum-image check). See :mod:`chemtrain.neighbors`."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from ..layout import GRAPH_KEYS

FORMATS = {"sparse": "Sparse", "dense": "Dense", "ordered_sparse": "OrderedSparse"}


class SmallCellError(ValueError):
    """A cell that a jax-md (minimum-image) neighbor list would get wrong.

    Raised by :func:`check_minimum_image`, and so by :func:`neighbor_list` and
    the ``allocate`` of its lists, when a periodic cell is narrower than twice
    the cutoff (the list would miss periodic images within the cutoff) or is
    periodic along some directions only. A subclass of ValueError.
    """


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Graph:
    """The edges of one structure, found once for structures that do not move.

    A graph holds both directions of every pair and every periodic image within
    the cutoff (self images of small cells included). The edge vector from
    sender ``s`` to receiver ``r`` is ``R[r] - R[s] + box @ shift`` (``box`` in
    jax-md's layout, whose columns are the cell vectors); :func:`edge_vectors`
    computes it. A frozen dataclass registered as a JAX pytree;
    :func:`graph_from` builds one from the graph keys of a data set.

    Attributes:
      senders: (E,) integer index of the atom each edge starts at; the atom
        count N marks a padded edge.
      receivers: (E,) integer index of the atom each edge ends at (N for a
        padded edge).
      shifts: (E, 3) integer counts of cell vectors added to each edge vector
        (zero for the padded edges of :func:`pad_edges`).
    """
    senders: jax.Array
    receivers: jax.Array
    shifts: jax.Array

    @property
    def idx(self):
        """Not available on a graph: reading it always raises.

        Energy functions written for jax-md neighbor lists read ``neighbor.idx``;
        given a graph they must get their edges from :func:`edge_vectors`, which
        handles both kinds.

        Raises:
          TypeError: always; the message points to :func:`edge_vectors`, or to
            dropping the graph keys from the data and passing a jax-md list.
        """
        raise TypeError(
            "This energy function reads neighbor.idx (a jax-md neighbor list), but the data carry "
            "precomputed graphs (senders, receivers, shifts). Get edges with "
            "chemtrain.neighbors.edge_vectors(displacement_fn, positions, neighbor, box=..., "
            "perturbation=...), which handles both, or drop the graph keys from the data and "
            "pass a jax-md nbrs_init.")


def graph_from(data) -> Graph:
    """The :class:`Graph` held by the graph keys of ``data`` (one structure).

    Args:
      data: mapping with the keys ``senders``, ``receivers`` (E,) and
        ``shifts`` (E, 3) of one structure (``GRAPH_KEYS``), e.g. one row of
        what :func:`add_graphs` adds, taken inside a vmap over structures.

    Returns:
      A :class:`Graph` of those three arrays.
    """
    return Graph(*(data[k] for k in GRAPH_KEYS))


def mask_graph(graph: Graph, mask) -> Graph:
    """Point every edge that touches an atom with ``mask`` False at N.

    Both the sender and the receiver of such an edge become N, the padding
    sentinel, so :func:`edge_vectors` marks the edge not real; shifts are kept.

    Args:
      graph: :class:`Graph` of one structure.
      mask: (N,) array, True (nonzero) for real atoms; its length gives N.

    Returns:
      A new :class:`Graph` whose cut edges point at N.
    """
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

    ``vectors[e]`` points from ``senders[e]`` to ``receivers[e]`` (mace-torch's
    convention). With a :class:`Graph`, ``vectors = R[r] - R[s] + box @ shift``
    (``box`` None: no shifts, free space). With a jax-md list (Sparse, Dense or
    OrderedSparse), ``displacement_fn(R[r], R[s], box=..., perturbation=...)``
    gives them (each keyword passed only when not None), and self pairs are
    dropped (marked not real). ``perturbation`` multiplies every vector, as
    jax-md's displacement functions do: it is the strain whose derivative is
    the stress.

    Args:
      displacement_fn: jax-md displacement function, returning ``Ra - Rb``
        for ``(Ra, Rb, **kwargs)``; required for jax-md lists, unused (may be
        None) for graphs.
      positions: (N, 3) positions in nm (jax-md lists also take (N, d)).
      neighbor: :class:`Graph` or jax-md ``NeighborList`` of this structure.
      box: jax-md box in nm (a side length, (3,) side lengths or a (3, 3)
        matrix whose columns are the cell vectors). For graphs None means free
        space; for jax-md lists it is passed on as ``box=`` when given.
      perturbation: scalar or (3, 3) matrix ``p``; every vector ``d`` becomes
        ``p @ d``. None: no strain.

    Returns:
      A tuple of ``senders`` and ``receivers``, integer (E,) clipped into
      ``[0, N - 1]``, ``vectors`` (E, 3) in nm, and ``real``, boolean (E,),
      False for padded edges (and for self pairs of jax-md lists). E is the
      number of graph edges, the capacity of a Sparse or OrderedSparse list, or
      N times the capacity of a Dense list.

    Raises:
      ValueError: ``neighbor`` is a jax-md list and ``displacement_fn`` is
        None, or ``displacement_fn`` does not return one vector per pair (a
        metric, which returns distances, was passed instead).
    """
    n = positions.shape[0]
    if isinstance(neighbor, Graph):
        s, r = neighbor.senders, neighbor.receivers
        real = (s >= 0) & (s < n) & (r >= 0) & (r < n)
        sc, rc = jnp.clip(s, 0, n - 1), jnp.clip(r, 0, n - 1)
        vec = positions[rc] - positions[sc]
        if box is not None:
            vec = vec + neighbor.shifts.astype(vec.dtype) @ box_matrix(box, vec.dtype).T
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


def disjoint_edges(displacement_fn: Callable | None, positions, neighbor, node_mask, box=None,
                   perturbation=None):
    """A batch of B structures as one graph with no edges between them (as
    mace-torch and sevenn batch), for a model's batched energies.

    Args:
      displacement_fn: as for :func:`edge_vectors` (None for graphs only).
      positions: (B, N, 3) positions in nm.
      neighbor: a :class:`Graph` of (B, E) arrays or a jax-md list with a
        leading axis B (one list per structure).
      node_mask: (B, N) booleans, False for padded or masked-out atoms.
      box: None, or one box per structure (leading axis B).
      perturbation: None, or one strain per structure (leading axis B).

    Returns:
      ``(senders, receivers, vectors, real)`` of :func:`edge_vectors` for
      every structure, flattened to (B * E,) (vectors (B * E, 3)), the atom
      indices of structure b offset by ``b * N`` (they index the flattened
      (B * N,) atoms), and ``real`` also False where either atom is masked
      out.
    """
    b, n = positions.shape[:2]
    in_axes = (0, 0, None if box is None else 0, None if perturbation is None else 0)
    s, r, vec, real = jax.vmap(lambda R, g, bx, pt: edge_vectors(
        displacement_fn, R, g, box=bx, perturbation=pt), in_axes=in_axes)(
            positions, neighbor, box, perturbation)
    take = jax.vmap(lambda m, i: m[i])
    real = real & take(node_mask, s) & take(node_mask, r)
    offset = (jnp.arange(b) * n)[:, None]
    return ((s + offset).reshape(-1), (r + offset).reshape(-1), vec.reshape(-1, vec.shape[-1]),
            real.reshape(-1))


def neighbor_pairs(neighbor, n_atoms: int):
    """Return (i, j, weight) arrays of a Dense, Sparse or OrderedSparse jax-md list.

    Args:
      neighbor: jax-md ``NeighborList``.
      n_atoms: number of atoms N (the rows of a Dense list).

    Returns:
      A tuple ``(i, j, weight)``. For Sparse and OrderedSparse lists ``i`` is
      ``idx[0]`` and ``j`` is ``idx[1]``, shape (capacity,); for Dense lists
      ``i`` is the row and ``j`` the entry, flattened to (N * capacity,).
      Padded entries keep jax-md's padding index N. ``weight`` is 1/2 for
      lists that store each pair twice and 1 for OrderedSparse (see
      :func:`pair_weight`).

    Raises:
      TypeError: ``neighbor`` is a :class:`Graph`, which has no ``idx``.
    """
    from jax_md import partition
    idx = neighbor.idx
    if partition.is_sparse(neighbor.format):
        i, j = idx[0], idx[1]
    else:
        i = jnp.broadcast_to(jnp.arange(n_atoms)[:, None], idx.shape).reshape(-1)
        j = idx.reshape(-1)
    return i, j, pair_weight(neighbor)


def pair_weight(neighbor) -> float:
    """The factor of a pair energy summed over the edges of ``neighbor``.

    Args:
      neighbor: :class:`Graph` or jax-md ``NeighborList``.

    Returns:
      1.0 for a jax-md OrderedSparse list, which holds each pair once, and 0.5
      for edge sets holding both directions of every pair (graphs, jax-md
      Sparse and Dense lists).
    """
    from jax_md import partition
    ordered = getattr(neighbor, "format", None) is partition.NeighborListFormat.OrderedSparse
    return 1.0 if ordered and not isinstance(neighbor, Graph) else 0.5


def box_matrix(box, dtype=None):
    """A jax-md box (scalar side, (3,) sides or (3, 3), columns the cell
    vectors) as a (3, 3) matrix."""
    box = jnp.asarray(box, dtype)
    if box.ndim == 0:
        return box * jnp.eye(3, dtype=box.dtype)
    if box.ndim == 1:
        return jnp.diag(box)
    return box


# ------------------------------------------------------------ cell geometry

def as_matrices(box) -> tuple[np.ndarray, bool]:
    """Boxes as (n, 3, 3) and whether a single box was given."""
    b = np.asarray(box, np.float64)
    if b.ndim == 0 or b.shape in ((3,), (3, 3)):
        return as_matrices(b[None])[0], True
    if b.ndim == 1:                       # one side length per structure
        return b[:, None, None] * np.eye(3), False
    if b.ndim == 2 and b.shape[1] == 3:   # three side lengths per structure
        return np.einsum("ni,ij->nij", b, np.eye(3)), False
    if b.ndim == 3 and b.shape[1:] == (3, 3):
        return b, False
    raise ValueError(f"A box must be a side length, three side lengths or a 3x3 matrix (per "
                     f"structure: shape (n,), (n, 3) or (n, 3, 3)); got shape {np.shape(box)}.")


def perpendicular_widths(box) -> np.ndarray:
    """Distances between opposite faces of each cell.

    Width k is ``V / |a_i x a_j|``, where ``a_i`` and ``a_j`` are the two cell
    vectors other than ``a_k`` (the columns of a jax-md box) and ``V`` is the
    cell volume. A flat cell has width 0.

    Args:
      box: one box (a side length, (3,) side lengths or a (3, 3) matrix whose
        columns are the cell vectors) or one per structure ((n,), (n, 3) or
        (n, 3, 3)), in any length unit (nm in chemtrain). Shapes (3,) and
        (3, 3) are always read as one box.

    Returns:
      numpy array of widths, shape (n, 3), or (3,) for one box, in the unit of
      ``box``.

    Raises:
      ValueError: ``box`` has none of these shapes.
    """
    b, single = as_matrices(box)
    a = np.swapaxes(b, 1, 2)              # rows are cell vectors
    vol = np.abs(np.linalg.det(a))
    out = np.empty(a.shape[:2])
    for k in range(3):
        area = np.linalg.norm(np.cross(a[:, (k + 1) % 3], a[:, (k + 2) % 3]), axis=-1)
        out[:, k] = np.where(area > 0, vol / np.where(area > 0, area, 1.0), 0.0)
    return out[0] if single else out


def check_minimum_image(box, cutoff: float, pbc=None, name: str = "the cell",
                        unit: str = "nm", fix: str | None = None) -> None:
    """Refuse a cell that a jax-md (minimum-image) neighbor list would get wrong.

    Raises :class:`SmallCellError` if a periodic cell is narrower than twice
    ``cutoff`` along a periodic direction (the list would count one periodic
    image of each pair where several lie within the cutoff), or is periodic
    only in some directions, which jax-md's periodic spaces cannot do. Cells
    periodic in no direction pass.

    Args:
      box: one box or one per structure, in jax-md's layout (see
        :func:`perpendicular_widths`), in the unit ``unit``.
      cutoff: neighbor-list cutoff, in the unit ``unit``.
      pbc: None (periodic in all three directions), or (3,) or (n, 3)
        booleans.
      name: what the error message calls the cell.
      unit: length unit named in the error message.
      fix: advice that replaces the end of the message (by default: precompute
        graphs, or use a supercell).

    Raises:
      SmallCellError: a cell is periodic along some directions only, or is
        periodic in all three and narrower than ``2 * cutoff`` in one; the
        message names the perpendicular widths and the cutoff.
      ValueError: ``box`` does not have the shape of a box
        (:func:`perpendicular_widths`).
    """
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
