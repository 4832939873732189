"""Graphs found on the host: every edge of a structure, periodic images
included (matscipy or ASE), padded to fixed shapes. See
:mod:`chemtrain.neighbors`."""
from __future__ import annotations

import numpy as np

from .edges import as_matrices

# ------------------------------------------------------ graphs on the host

def host_edges(positions, cell, pbc, cutoff: float, backend: str = "auto"):
    """Every edge of one structure, periodic images included.

    The edges are all ``(i, j, S)`` with ``|R[j] - R[i] + S @ cell| < cutoff``
    except ``i == j`` with ``S == 0``, so both directions of every pair and the
    self images of small cells. ``S`` is zero along non-periodic directions.
    Positions may lie outside the cell.

    Args:
      positions: (atoms, 3) positions, in the unit of ``cutoff`` (nm in
        chemtrain).
      cell: (3, 3) matrix whose rows are the cell vectors (ASE's layout, the
        transpose of jax-md's), or None for no cell; rows along non-periodic
        directions are not used.
      pbc: periodicity, one boolean or (3,) booleans.
      cutoff: the distance below which two atoms share an edge.
      backend: 'matscipy', 'ase' or 'auto' (matscipy when installed, else
        ASE).

    Returns:
      A tuple ``(senders, receivers, shifts)``, the ``i`` and ``j`` as int32
      arrays (E,) and the cell-shift counts ``S`` as an int64 array (E, 3).

    Raises:
      ValueError: the periodic cell vectors are zero or linearly dependent, or
        ``backend`` is none of the three names.
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
    """Stack per-structure edges into the graph keys, padded to one edge count.

    Padded edges get the sentinel ``n_atoms`` as sender and receiver and zero
    shifts.

    Args:
      edges: sequence of ``(senders, receivers, shifts)``, one per structure,
        as :func:`host_edges` returns them ((E_k,), (E_k,) and (E_k, 3)).
      n_atoms: atoms per structure, the sentinel index of padded edges.
      capacity: edges per structure; default the most any structure has.

    Returns:
      A dict of ``senders`` and ``receivers``, int32 (structures, capacity),
      and ``shifts`` (structures, capacity, 3) in the smallest of int8, int16
      and int32 that holds every shift.

    Raises:
      ValueError: a structure has more edges than ``capacity``, or a shift
        does not fit in int32 (a cutoff far larger than the cell).
    """
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
    """The graph keys (``senders``, ``receivers``, ``shifts``) of every structure.

    They are computed once on the host by :func:`host_edges` (matscipy or ASE)
    for the real atoms of each structure and padded by :func:`pad_edges`.
    Atom indices count the atoms of the full (padded) structure.

    Args:
      R: (structures, atoms, 3) positions, in the unit of ``cutoff`` (nm in
        chemtrain).
      box: None (free space), one box for all structures (a side length, (3,)
        side lengths or a (3, 3) matrix) or one per structure ((n,), (n, 3) or
        (n, 3, 3)), in jax-md's layout (the columns are the cell vectors);
        shapes (3,) and (3, 3) are read as one box. A structure whose box is
        all zeros is free space.
      cutoff: the edge cutoff, a positive length (nm in chemtrain).
      pbc: None (periodic in all three directions where there is a box), (3,)
        or (n, 3) booleans.
      mask: (n, atoms) booleans marking real atoms; padded atoms get no edges.
        None: every atom is real.
      capacity: edges per structure; default the largest need.
      progress: show a progress bar over the structures.
      backend: 'matscipy', 'ase' or 'auto', as for :func:`host_edges`.

    Returns:
      A dict of ``senders``, ``receivers`` (structures, edges) and ``shifts``
      (structures, edges, 3), as :func:`pad_edges` gives them, padded edges
      pointing at ``atoms``.

    Raises:
      ValueError: ``cutoff`` is not a positive finite number; ``R`` is not
        (structures, atoms, 3); ``box`` has the wrong shape or another number
        of boxes than of structures; a periodic cell is degenerate;
        ``backend`` is unknown; or a structure has more than ``capacity``
        edges.
    """
    if cutoff is None or not np.isfinite(cutoff) or cutoff <= 0:
        raise ValueError(f"cutoff must be a positive length (nm in chemtrain), got {cutoff!r}.")
    R = np.asarray(R, np.float64)
    if R.ndim != 3 or R.shape[2] != 3:
        raise ValueError(f"R must have shape (structures, atoms, 3), got {R.shape}.")
    n, atoms = R.shape[:2]
    cells = np.zeros((n, 3, 3))
    if box is not None:
        b, single = as_matrices(box)
        if not single and len(b) != n:
            raise ValueError(f"box holds {len(b)} boxes for {n} structures.")
        cells = np.broadcast_to(np.swapaxes(b, 1, 2), (n, 3, 3))   # rows: cell vectors
    has_cell = np.abs(cells).sum(axis=(1, 2)) > 0
    periodic = np.broadcast_to(np.asarray(True if pbc is None else pbc, bool), (n, 3)) & \
        has_cell[:, None]
    real = np.ones((n, atoms), bool) if mask is None else np.asarray(mask, bool)
    from ..progress import progress_bar
    edges = []
    for k in progress_bar(range(n), desc="neighbor graphs", disable=not progress):
        keep = np.nonzero(real[k])[0]
        s, r, S = host_edges(R[k, keep], cells[k], periodic[k], cutoff, backend)
        edges.append((keep[s], keep[r], S))
    return pad_edges(edges, atoms, capacity)


def add_graphs(data, cutoff: float, capacity: int | None = None, progress: bool = False) -> dict:
    """``data`` with precomputed graphs added.

    The graphs come from :func:`precompute_graphs` (backend 'auto') applied to
    the data's ``R`` and, where present, its ``box``, ``pbc`` and ``mask``.

    Args:
      data: mapping with ``R`` (structures, atoms, 3) in nm and optionally
        ``box``, ``pbc`` and ``mask``, laid out as :func:`precompute_graphs`
        takes them.
      cutoff: edge cutoff in nm.
      capacity: edges per structure; default the largest need.
      progress: show a progress bar over the structures.

    Returns:
      A new dict of the entries of ``data`` and ``senders``, ``receivers``
      (structures, edges) and ``shifts`` (structures, edges, 3); ``data``
      itself is not changed.

    Raises:
      ValueError: for the reasons :func:`precompute_graphs` gives.
    """
    graphs = precompute_graphs(data["R"], data.get("box"), cutoff, data.get("pbc"),
                               data.get("mask"), capacity, progress)
    return {**data, **graphs}
