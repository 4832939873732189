"""Neighbors: who interacts with whom, decided in one place.

Two ways for an energy function to get its edges:

- **Precomputed graphs** (:class:`Graph`) for structures that do not move
  during training: every edge, periodic images included, found once on the
  host (matscipy when installed, else ASE) by :func:`precompute_graphs` or
  :func:`add_graphs` and stored with the data as ``senders``, ``receivers``
  (structures, edges) and ``shifts`` (structures, edges, 3). ``shifts`` are
  integer counts of cell vectors: the edge vector from sender ``s`` to
  receiver ``r`` is ``R[r] - R[s] + box @ shift`` (``box`` in jax-md's
  layout, the columns are the cell vectors). Padded edges point at the
  sentinel index N (the number of atoms). Cells of any size and shape work,
  partly periodic ones (slabs) too.
- **jax-md neighbor lists** for moving atoms, from :func:`neighbor_list`,
  which chooses the settings (format, capacity, cell list on or off, free
  space or periodic) in one place. jax-md finds one periodic image per pair
  (the minimum image), which is wrong when a cell is narrower than twice
  the cutoff: :func:`check_minimum_image` refuses such cells with an error
  naming their perpendicular widths and the cutoff.

:func:`edge_vectors` turns either kind into ``(senders, receivers, vectors,
real)`` with vectors pointing from sender to receiver (mace-torch's
convention), applying jax-md's ``perturbation`` (the strain whose derivative
is the stress) in both cases. Lengths are in whatever unit the positions
are (nm inside chemtrain).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from .data.dataset import GRAPH_KEYS  # the data layout owns the names

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
                        unit: str = "nm") -> None:
    """Raise :class:`SmallCellError` if a periodic cell is narrower than
    twice ``cutoff`` along a periodic direction (or periodic only in some
    directions, which jax-md's periodic spaces cannot do).

    ``box``: one box or one per structure (jax-md layout); ``pbc``: None
    (periodic in all three directions) or (3,) / (n, 3) booleans."""
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
            f"several lie within the cutoff, a silently wrong energy. Precompute graphs instead "
            f"(chemtrain.neighbors.add_graphs(data, cutoff) and nbrs_init=None), which count "
            f"every image, or use a supercell at least {2 * cutoff:.4g} {unit} wide.")


# ------------------------------------------------------- jax-md neighbor lists

def make_space(box=None, fractional_coordinates: bool = False):
    """``(displacement, shift)``: ``space.free()`` for ``box`` None, else
    ``space.periodic_general(box)`` (which also takes ``box=`` per call)."""
    from jax_md import space
    if box is None:
        return space.free()
    return space.periodic_general(jnp.asarray(_box_matrix(box)),
                                  fractional_coordinates=fractional_coordinates)


def neighbor_list(displacement_fn: Callable, box, cutoff: float, *, format: str = "sparse",
                  dr_threshold: float = 0.0, capacity_multiplier: float = 1.25,
                  fractional_coordinates: bool = False, cell_list: bool | None = None,
                  cell_list_min_atoms: int = 2048):
    """A jax-md neighbor list (``allocate``, ``update``) with the settings
    chosen here.

    ``box`` None means free space (no cell list: a cell list over a large
    dummy box allocates millions of cells); a periodic ``box`` (jax-md
    layout) must be at least ``2 * cutoff`` wide in every perpendicular
    direction (:class:`SmallCellError` otherwise; use :func:`add_graphs`
    for small cells). ``format``: 'sparse' (both directions of each pair, as
    MACE needs), 'dense' or 'ordered_sparse'. ``cell_list`` None decides at
    ``allocate``: on only for periodic boxes holding at least 3 cells per
    side and at least ``cell_list_min_atoms`` atoms (below that the all-pairs
    search is as fast). A list with a cell list cannot take a different
    ``box=`` per call unless ``fractional_coordinates``. ``box=`` given to
    ``allocate`` is checked too. The lists it allocates (and their
    updates) carry ``cutoff``: :func:`list_cutoff`, so that trainers and
    quantities can check what the list reaches.
    """
    from jax_md import partition
    if format not in _FORMATS:
        raise ValueError(f"format must be one of {list(_FORMATS)}, got {format!r}.")
    fmt = getattr(partition, _FORMATS[format])
    if box is not None:
        check_minimum_image(box, cutoff, name="The box given to neighbor_list")
    built = {}

    def fns(n_atoms, box_now):
        side = box_now
        if box_now is not None and not fractional_coordinates:
            m = np.asarray(_box_matrix(box_now))   # jax-md's cell list takes side lengths here
            side = np.diag(m) if np.allclose(m, np.diag(np.diag(m))) else None
        use = cell_list
        if use is None:
            use = (side is not None and n_atoms >= cell_list_min_atoms and
                   bool(np.min(perpendicular_widths(box_now)) >= 3 * (cutoff + dr_threshold)))
        elif use and box_now is not None and side is None:
            raise ValueError("A cell list in a triclinic box needs fractional_coordinates=True "
                             "(jax-md); pass cell_list=False or fractional coordinates.")
        if use not in built:
            built[use] = partition.neighbor_list(
                displacement_fn, 1.0 if box_now is None else (side if use else box_now), cutoff,
                dr_threshold=dr_threshold, capacity_multiplier=capacity_multiplier, format=fmt,
                disable_cell_list=not use, fractional_coordinates=fractional_coordinates)
        return built[use]

    def allocate(positions, extra_capacity: int = 0, **kwargs):
        box_now = kwargs.get("box", box)
        if "box" in kwargs and not isinstance(kwargs["box"], jax.core.Tracer):
            check_minimum_image(kwargs["box"], cutoff, name="The box given to allocate")
        nbrs = fns(int(np.shape(positions)[0]), box_now).allocate(
            positions, extra_capacity=extra_capacity, **kwargs)
        return dataclasses.replace(nbrs, update_fn=_UpdateWithCutoff(nbrs.update_fn, cutoff))

    def update(positions, nbrs, **kwargs):
        return nbrs.update(positions, **kwargs)

    return partition.NeighborListFns(allocate, update)


class _UpdateWithCutoff:
    """The ``update_fn`` of a list from :func:`neighbor_list`: jax-md's,
    with the list's cutoff attached; every updated list carries it again.
    Compared by value (it is a static field of the list's pytree)."""

    def __init__(self, fn: Callable, cutoff: float):
        self.fn, self.cutoff = fn, float(cutoff)

    def __call__(self, positions, nbrs, **kwargs):
        out = self.fn(positions, nbrs, **kwargs)
        return dataclasses.replace(out, update_fn=self)

    def __eq__(self, other):
        return (isinstance(other, _UpdateWithCutoff) and other.fn is self.fn
                and other.cutoff == self.cutoff)

    def __hash__(self):
        return hash((id(self.fn), self.cutoff))


def list_cutoff(nbrs) -> float | None:
    """The cutoff of a jax-md neighbor list: the one a list from
    :func:`neighbor_list` carries, else the reach (``r_cutoff +
    dr_threshold``) that jax-md's own ``neighbor_list`` closes over (jax-md
    stores it nowhere else), else None (unknown)."""
    update_fn = getattr(nbrs, "update_fn", None)
    if isinstance(update_fn, _UpdateWithCutoff):
        return update_fn.cutoff
    if update_fn is None:
        return None
    import inspect
    try:
        value = inspect.getclosurevars(update_fn).nonlocals.get("cutoff")
    except (TypeError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float, np.floating)) else None


# ------------------------------------------------------ graphs on the host

def host_edges(positions, cell, pbc, cutoff: float, backend: str = "auto"):
    """Every edge of one structure, periodic images included.

    Returns ``(senders, receivers, shifts)``: all ``(i, j, S)`` with
    ``|R[j] - R[i] + S @ cell| < cutoff`` except ``i == j`` with ``S == 0``
    (``cell`` rows are the cell vectors, ASE's layout; ``S`` is zero along
    non-periodic directions). ``backend``: 'matscipy', 'ase' or 'auto'
    (matscipy when installed). Positions may lie outside the cell.
    """
    pos = np.asarray(positions, np.float64).reshape(-1, 3)
    cell = np.zeros((3, 3)) if cell is None else np.asarray(cell, np.float64).reshape(3, 3)
    pbc = np.broadcast_to(np.asarray(pbc, bool), (3,)).copy()
    if pbc.any():
        lengths = np.linalg.norm(cell[pbc], axis=1)
        if (lengths == 0).any() or np.linalg.matrix_rank(cell[pbc], tol=1e-9 * lengths.max()) < pbc.sum():
            raise ValueError(f"The cell {cell.tolist()} is periodic along {pbc.tolist()} but its "
                             f"periodic vectors are zero or linearly dependent.")
    # the search needs a non-singular cell: non-periodic vectors are replaced
    # by vectors normal to the periodic ones, long enough to hold the atoms
    search = cell.copy()
    origin = pos.min(axis=0) if len(pos) else np.zeros(3)
    free = np.nonzero(~pbc)[0]
    if free.size:
        span = float(np.ptp(pos, axis=0).max(initial=0.0)) * np.sqrt(3) + 2 * cutoff + 1.0
        basis = np.linalg.svd(cell[pbc])[2] if pbc.any() else np.eye(3)
        normals = basis[pbc.sum():]                        # orthonormal complement
        for k, v in zip(free, normals):
            search[k] = v * span
        centre = pos.mean(axis=0) if len(pos) else np.zeros(3)
        origin = centre - 0.5 * search[free].sum(axis=0)
    pos = pos - origin
    if backend == "auto":
        import importlib.util
        backend = "matscipy" if importlib.util.find_spec("matscipy") else "ase"
    if backend == "matscipy":
        from matscipy.neighbours import neighbour_list
        i, j, S = neighbour_list("ijS", positions=pos, cell=search, pbc=pbc, cutoff=float(cutoff))
    elif backend == "ase":
        from ase.neighborlist import primitive_neighbor_list
        i, j, S = primitive_neighbor_list("ijS", pbc, search, pos, float(cutoff),
                                          self_interaction=False)
    else:
        raise ValueError(f"backend must be 'auto', 'matscipy' or 'ase', got {backend!r}.")
    return i.astype(np.int32), j.astype(np.int32), np.asarray(S, np.int64)


def _shift_dtype(max_abs: int):
    for dt in (np.int8, np.int16, np.int32):
        if max_abs <= np.iinfo(dt).max:
            return dt
    raise ValueError(f"Cell shifts of {max_abs} cell vectors: the cutoff is far larger than the cell.")


def pad_edges(edges, n_atoms: int, capacity: int | None = None) -> dict:
    """Stack per-structure ``(senders, receivers, shifts)`` into the graph
    keys, padded to ``capacity`` edges (default: the most any structure
    has) with the sentinel ``n_atoms`` and zero shifts."""
    need = max((len(e[0]) for e in edges), default=0)
    if capacity is None:
        capacity = need
    elif capacity < need:
        worst = int(np.argmax([len(e[0]) for e in edges]))
        raise ValueError(f"Structure {worst} has {need} edges, more than capacity={capacity}; "
                         f"raise the capacity (or leave it unset for the largest need).")
    n = len(edges)
    max_abs = max((int(np.abs(e[2]).max(initial=0)) for e in edges), default=0)
    out = {"senders": np.full((n, capacity), n_atoms, np.int32),
           "receivers": np.full((n, capacity), n_atoms, np.int32),
           "shifts": np.zeros((n, capacity, 3), _shift_dtype(max_abs))}
    for k, (s, r, S) in enumerate(edges):
        out["senders"][k, :len(s)] = s
        out["receivers"][k, :len(r)] = r
        out["shifts"][k, :len(S)] = S
    return out


def precompute_graphs(R, box=None, cutoff: float = None, pbc=None, mask=None,
                      capacity: int | None = None, progress: bool = False,
                      backend: str = "auto") -> dict:
    """The graph keys (``senders``, ``receivers``, ``shifts``) of every
    structure, computed once on the host.

    ``R`` (n, atoms, 3) and ``cutoff`` in one length unit (nm in chemtrain);
    ``box`` None (free space), one box for all or one per structure in
    jax-md's layout (columns are the cell vectors; (n,), (n, 3) or
    (n, 3, 3)); a structure whose box is all zeros is free space. ``pbc``:
    None (periodic in all three directions where there is a box), (3,) or
    (n, 3) booleans. ``mask`` (n, atoms) marks real atoms; padded atoms get
    no edges. ``capacity``: edges per structure (default: the largest need).
    """
    if cutoff is None or not np.isfinite(cutoff) or cutoff <= 0:
        raise ValueError(f"cutoff must be a positive length (nm in chemtrain), got {cutoff!r}.")
    R = np.asarray(R, np.float64)
    if R.ndim != 3 or R.shape[2] != 3:
        raise ValueError(f"R must have shape (structures, atoms, 3), got {R.shape}.")
    n, atoms = R.shape[:2]
    cells = np.zeros((n, 3, 3))
    if box is not None:
        b, single = _as_matrices(box)
        if not single and len(b) != n:
            raise ValueError(f"box holds {len(b)} boxes for {n} structures.")
        cells = np.broadcast_to(np.swapaxes(b, 1, 2), (n, 3, 3))   # rows: cell vectors
    has_cell = np.abs(cells).sum(axis=(1, 2)) > 0
    periodic = np.broadcast_to(np.asarray(True if pbc is None else pbc, bool), (n, 3)) & \
        has_cell[:, None]
    real = np.ones((n, atoms), bool) if mask is None else np.asarray(mask, bool)
    from tqdm.auto import tqdm
    edges = []
    for k in tqdm(range(n), desc="neighbor graphs", disable=not progress):
        keep = np.nonzero(real[k])[0]
        s, r, S = host_edges(R[k, keep], cells[k], periodic[k], cutoff, backend)
        edges.append((keep[s], keep[r], S))
    return pad_edges(edges, atoms, capacity)


def add_graphs(data, cutoff: float, capacity: int | None = None, progress: bool = False) -> dict:
    """``data`` with precomputed graphs added (from its ``R`` and, where
    present, ``box``, ``pbc`` and ``mask``); see :func:`precompute_graphs`."""
    graphs = precompute_graphs(data["R"], data.get("box"), cutoff, data.get("pbc"),
                               data.get("mask"), capacity, progress)
    return {**data, **graphs}
