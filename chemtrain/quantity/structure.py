"""Structural per-snapshot quantities: the radial distribution function
(RDF) and the angular distribution function (ADF).

Both are Gaussian-smoothed histograms, so they are smooth functions of the
positions and their ensemble averages can be reweighted. Pairs come from the
neighbor list, whose cutoff must reach the largest distance the quantity
uses (``r_cut`` of the RDF, ``r_outer`` of the ADF); neither ever drops a
pair silently: the RDF of a small system is computed from all pairs when the
list is too short, and otherwise a list known to be too short is refused.
A range beyond half the box, where periodic images matter, must be asked for
explicitly (RDF) or is refused (ADF).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..neighbors import list_cutoff, neighbor_pairs
from ..ensemble import box_kwargs, volume
from ._common import snapshot_box

_WINDOW = 6.0  # Gaussian kernels are cut at this many standard deviations


class RDFParams(NamedTuple):
    """Bins of an RDF: centers and edges (nm) and the smoothing width.

    Made by :func:`rdf_discretization`; :func:`rdf` also takes a plain tuple
    of the three fields.

    Attributes:
      bin_centers: (nbins,) bin centers in nm.
      bin_edges: (nbins + 1,) bin edges in nm.
      sigma: standard deviation of the Gaussian smoothing in nm.
    """
    bin_centers: jnp.ndarray
    bin_edges: jnp.ndarray
    sigma: float


class ADFParams(NamedTuple):
    """Bins of an ADF: angle centers, smoothing width and the triplet radius.

    Made by :func:`adf_discretization`; :func:`adf` also takes a plain tuple
    of the three fields.

    Attributes:
      bin_centers: (nbins,) angle bin centers in rad, on [0, pi].
      sigma: standard deviation of the Gaussian smoothing in rad.
      r_outer: radius in nm within which both neighbors of a triplet must lie.
    """
    bin_centers: jnp.ndarray
    sigma: float
    r_outer: float


def rdf_discretization(rdf_cut: float, nbins: int = 300, rdf_start: float = 0.0) -> RDFParams:
    """Uniform RDF bins between ``rdf_start`` and ``rdf_cut`` (nm).

    Each bin is smoothed with a Gaussian as wide as one bin (upstream
    chemtrain's choice).

    Args:
      rdf_cut: upper edge of the last bin in nm.
      nbins: number of bins, at least 1.
      rdf_start: lower edge of the first bin in nm, at least 0.

    Returns:
      :class:`RDFParams` with ``nbins`` bins and ``sigma = (rdf_cut -
      rdf_start) / nbins``.

    Raises:
      ValueError: unless ``0 <= rdf_start < rdf_cut`` and ``nbins >= 1``.
    """
    if not rdf_cut > rdf_start >= 0 or nbins < 1:
        raise ValueError(f"Need 0 <= rdf_start < rdf_cut and nbins >= 1, got rdf_start="
                         f"{rdf_start}, rdf_cut={rdf_cut}, nbins={nbins}.")
    width = (rdf_cut - rdf_start) / nbins
    edges = np.linspace(rdf_start, rdf_cut, nbins + 1)
    return RDFParams(jnp.asarray(0.5 * (edges[1:] + edges[:-1])), jnp.asarray(edges), width)


def adf_discretization(r_outer: float, nbins: int = 150) -> ADFParams:
    """Uniform angle bins on [0, pi] for the ADF.

    Each bin is smoothed with a Gaussian as wide as one bin; triplets whose two
    neighbors lie within ``r_outer`` of the central particle count.

    Args:
      r_outer: triplet radius in nm.
      nbins: number of angle bins.

    Returns:
      :class:`ADFParams` with ``nbins`` bins of width ``pi / nbins`` rad and
      ``sigma`` equal to that width.
    """
    width = math.pi / nbins
    centers = jnp.asarray(width * (np.arange(nbins) + 0.5))
    return ADFParams(centers, width, float(r_outer))


def _uniform(centers) -> bool:
    c = np.asarray(centers, np.float64)
    if c.size < 2:
        return False
    d = np.diff(c)
    return bool(np.all(d > 0) and np.allclose(d, d[0], rtol=1e-9, atol=0.0))


def _smoothed_histogram(x, use, centers, sigma):
    """sum over samples of the normalised Gaussian ``N(center; x, sigma)``,
    for each center; samples with ``use`` False are skipped. For uniform
    centers only the bins within _WINDOW sigma of a sample are touched."""
    norm = 1.0 / (math.sqrt(2.0 * math.pi) * sigma)
    if not _uniform(centers):
        k = jnp.exp(-0.5 * ((x[:, None] - centers[None, :]) / sigma) ** 2)
        return norm * jnp.sum(jnp.where(use[:, None], k, 0.0), axis=0)
    c = np.asarray(centers, np.float64)
    step = float(c[1] - c[0])
    m = int(math.ceil(_WINDOW * sigma / step))
    nearest = jnp.round((x - c[0]) / step).astype(jnp.int32)
    offsets = jnp.arange(-m, m + 1, dtype=jnp.int32)
    bins = nearest[:, None] + offsets[None, :]
    inside = use[:, None] & (bins >= 0) & (bins < c.size)
    where_c = c[0] + step * bins.astype(x.dtype)
    k = jnp.where(inside, norm * jnp.exp(-0.5 * ((x[:, None] - where_c) / sigma) ** 2), 0.0)
    return jnp.zeros(c.size, x.dtype).at[jnp.where(inside, bins, 0)].add(k)


def _farthest_image(sides) -> float:
    """The largest minimum-image distance in a periodic orthorhombic box of
    these side lengths (:func:`_fixed_sides`), inf when there are none."""
    return math.inf if sides is None else float(np.sqrt(np.sum((sides / 2) ** 2)))


def check_list_reach(neighbor, needed: float, what: str, fix: str) -> None:
    """Refuse a neighbor list whose cutoff (when known) is shorter than the
    distance ``needed`` up to which a quantity counts pairs: the pairs
    beyond the list's cutoff would be missing without a word."""
    cutoff = list_cutoff(neighbor)
    if cutoff is not None and cutoff < needed - 1e-9:
        raise ValueError(
            f"{what} counts pairs up to {needed:g} nm, but the neighbor list's cutoff is "
            f"{cutoff:g} nm: the pairs between {cutoff:g} and {needed:g} nm would be missing. "
            f"Build the neighbor list with a cutoff of at least {needed:g} nm, or {fix}.")


def _as_params(params, cls, n):
    if isinstance(params, cls):
        return params
    if isinstance(params, (tuple, list)) and len(params) == n:
        return cls(*params)
    raise TypeError(f"Expected {cls.__name__} (or a tuple of {n}: {', '.join(cls._fields)}), "
                    f"got {type(params).__name__}.")


#: most pair distances (pairs x periodic images) per snapshot that the RDF
#: computes from all pairs instead of a neighbor list (small systems)
DENSE_PAIR_LIMIT = 2_000_000
_IMAGES = ("nearest", "all")


def _fixed_sides(box, dim: int):
    """Side lengths of a fixed orthorhombic ``box`` (scalar or ``dim``
    sides), None when the box is unknown, traced or general."""
    if box is None:
        return None
    try:
        sides = np.asarray(box, dtype=float)
    except (TypeError, jax.errors.TracerArrayConversionError):
        return None
    if sides.ndim > 1:
        diag = np.diag(np.diag(sides)) if sides.shape == (dim, dim) else None
        if diag is None or not np.allclose(sides, diag):
            return None
        sides = np.diag(sides)
    return np.broadcast_to(sides, (dim,)).astype(float)


def _is_periodic(displacement_fn, sides, dim: int, **kwargs) -> bool:
    """Whether ``displacement_fn`` wraps across the box (a particle and its
    image one box length away coincide), for real or fractional
    coordinates; probed on host values at trace time."""
    with jax.ensure_compile_time_eval():
        zero = jnp.zeros(dim)
        for step in (float(sides[0]), 1.0):
            d = displacement_fn(zero, zero.at[0].set(step), **kwargs)
            if float(jnp.sum(jnp.asarray(d) ** 2)) < 1e-12 * float(sides[0]) ** 2:
                return True
    return False


def _image_shifts(sides, r_cut: float) -> np.ndarray:
    """Lattice vectors n * L of every periodic image that can hold a pair
    closer than ``r_cut`` to a minimum-image distance (|component| <= L/2)."""
    k = [int(math.ceil(r_cut / side + 0.5)) - 1 for side in sides]   # |n| L - L/2 < r_cut
    grid = np.meshgrid(*[np.arange(-m, m + 1) for m in k], indexing="ij")
    return np.stack([g.reshape(-1) for g in grid], -1) * np.asarray(sides)[None, :]


def _all_pair_distances(R, displacement_fn, dkw, shifts):
    """Distances of every ordered pair (i, j), i != j, and, with ``shifts``
    (lattice vectors, the zero vector among them), of every periodic image
    of every pair and of every particle's own images: (distances, use)."""
    n = R.shape[0]
    dR = jax.vmap(lambda a: jax.vmap(lambda b: displacement_fn(a, b, **dkw))(R))(R)
    self_pair = jnp.eye(n, dtype=bool)
    if shifts is None:
        d2, use = jnp.sum(dR * dR, axis=-1), ~self_pair
    else:
        shifts = jnp.asarray(shifts, R.dtype)
        dR = dR[:, :, None, :] + shifts[None, None, :, :]
        d2 = jnp.sum(dR * dR, axis=-1)
        zero = jnp.all(shifts == 0, axis=-1)
        use = ~(self_pair[:, :, None] & zero[None, None, :])
    r = jnp.sqrt(jnp.where(use, d2, 1.0))
    return r.reshape(-1), use.reshape(-1)


def rdf(displacement_fn, rdf_params, box=None, r_cut: float | None = None,
        periodic_images: str | None = None):
    """Radial distribution function g(r) of one snapshot.

    Every ordered pair (i, j), i != j, at distance ``r < r_cut`` adds a
    normalised Gaussian of width ``sigma`` centred at ``r``; bin ``k`` (centre
    ``c_k``, width ``dr_k``, shell volume ``V_k``) gets::

        g_k = V / N^2 * sum_pairs N(c_k; r_ij, sigma) dr_k / V_k

    i.e. the smoothed pair count relative to an ideal gas of the same density
    (the normalisation of ASE's ``get_rdf`` and upstream chemtrain).

    Pairs come from the neighbor list, whose cutoff must reach ``r_cut`` (or,
    in a fixed orthorhombic box, the largest minimum-image distance, if
    smaller). When the list's cutoff is known to be shorter, or no list is
    given, small systems (at most ``DENSE_PAIR_LIMIT`` pair distances) are
    computed from all pairs instead, as upstream chemtrain does; larger ones
    are refused with a ValueError naming both distances.

    An RDF range beyond half the (fixed, orthorhombic, periodic) box meets
    pairs that several periodic images bring within ``r_cut``; say which
    g(r) is meant with ``periodic_images``, or a ValueError says so at the
    first evaluation.

    Args:
      displacement_fn: jax-md displacement function of the simulation (nm).
      rdf_params: :class:`RDFParams`, or a tuple ``(bin_centers, bin_edges,
        sigma)``.
      box: the fixed simulation box (NVT) in nm, a side length, side lengths
        or a box matrix; NPT snapshots use their own box. A box given only
        as ``box=`` in the call's ``state_kwargs`` sets the volume but not the
        periodic-image checks above.
      r_cut: the largest pair distance counted, in nm; default the last bin
        edge.
      periodic_images: None (refuse a range beyond half the box), ``'all'``
        (count every image: the RDF of the infinite periodic system; from all
        pairs, small systems only) or ``'nearest'`` (count each pair once at
        its minimum-image distance: upstream chemtrain's RDF, which misses the
        other images beyond half the box).

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving g(r)
      of one snapshot, shape (nbins,), dimensionless; ``energy_fn`` is not
      used. ``fn`` raises ValueError when the range exceeds half the box and
      ``periodic_images`` is None, when ``periodic_images='all'`` needs more
      than ``DENSE_PAIR_LIMIT`` distances, when a large system has no neighbor
      list or one known to be too short, and when no box is known.

    Raises:
      TypeError: ``rdf_params`` is neither :class:`RDFParams` nor a tuple of
        three.
      ValueError: ``rdf_params`` does not have one more bin edge than bin
        centers, or ``periodic_images`` is not None, 'nearest' or 'all'.
    """
    p = _as_params(rdf_params, RDFParams, 3)
    centers, edges = np.asarray(p.bin_centers), np.asarray(p.bin_edges)
    if edges.shape != (centers.shape[0] + 1,):
        raise ValueError(f"rdf needs one more bin edge than bin centers, got {edges.shape[0]} "
                         f"edges for {centers.shape[0]} centers.")
    if periodic_images not in (None, *_IMAGES):
        raise ValueError(f"periodic_images must be None, 'nearest' or 'all', got "
                         f"{periodic_images!r}.")
    sigma = float(p.sigma)
    r_cut = float(edges[-1]) if r_cut is None else float(r_cut)
    widths = np.diff(edges)
    fix_range = f"lower the RDF's range (rdf_discretization(rdf_cut=..., now {r_cut:g}))"

    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        R = state.position
        n, dim = R.shape
        dkw = box_kwargs(state)
        sides = None if dkw else _fixed_sides(box, dim)
        if sides is not None and not _is_periodic(displacement_fn, sides, dim):
            sides = None   # free space: no images
        shifts = None
        if sides is not None and r_cut > sides.min() / 2 + 1e-12:
            if periodic_images is None:
                raise ValueError(
                    f"The RDF's range ({r_cut:g} nm) exceeds half the box ({sides.min():g} nm "
                    f"wide): beyond {sides.min() / 2:g} nm several periodic images of a pair "
                    f"lie within the range. Say which g(r) you want: "
                    f"quantity.rdf(..., periodic_images='all') counts every image (the RDF of "
                    f"the periodic system), periodic_images='nearest' counts each pair once at "
                    f"its minimum-image distance (upstream chemtrain's RDF). Or {fix_range}.")
            if periodic_images == "all":
                shifts = _image_shifts(sides, r_cut)
        needed = min(r_cut, _farthest_image(sides))
        cutoff = None if neighbor is None else list_cutoff(neighbor)
        short = neighbor is None or (cutoff is not None and cutoff < needed - 1e-9)
        vol = volume(snapshot_box(state, box, kwargs), dim)
        shell = (math.pi ** (dim / 2) / math.gamma(dim / 2 + 1)) * (edges[1:] ** dim
                                                                     - edges[:-1] ** dim)
        if shifts is not None or short:
            count = n * n * (1 if shifts is None else shifts.shape[0])
            if count > DENSE_PAIR_LIMIT:
                if shifts is not None:
                    raise ValueError(
                        f"periodic_images='all' computes the RDF from every pair and image: "
                        f"{count} distances per snapshot, more than this RDF computes "
                        f"(chemtrain.quantity.structure.DENSE_PAIR_LIMIT = {DENSE_PAIR_LIMIT}). "
                        f"Use a box at least {2 * r_cut:g} nm wide, or {fix_range}.")
                if neighbor is None:
                    raise ValueError("rdf of a large system is computed from the neighbor list: "
                                     "call it as fn(state, neighbor=nbrs).")
                check_list_reach(neighbor, needed, "The RDF", fix_range)
            r, use = _all_pair_distances(R, displacement_fn, dkw, shifts)
            factor = 1.0
        else:
            i, j, weight = neighbor_pairs(neighbor, n)
            real = (i < n) & (j < n)
            dR = jax.vmap(lambda a, b: displacement_fn(a, b, **dkw))(
                R[jnp.minimum(i, n - 1)], R[jnp.minimum(j, n - 1)])
            r = jnp.sqrt(jnp.where(real, jnp.sum(dR * dR, axis=-1), 1.0))
            use, factor = real, 2.0 * weight
        use = use & (r < r_cut)
        counts = factor * _smoothed_histogram(r, use, centers, sigma) * widths
        return counts * vol / (n * n * shell)
    return fn


def _neighbor_table(neighbor, n: int, max_neighbors: int | None, active_fn):
    """(n, M) table of each particle's neighbors j (n = none) among edges for
    which ``active_fn(i, j)`` holds, and whether any particle had more than M."""
    from jax_md import partition
    idx = neighbor.idx
    if not partition.is_sparse(neighbor.format):
        i = jnp.broadcast_to(jnp.arange(n)[:, None], idx.shape).reshape(-1)
        j = idx.reshape(-1)
        M = idx.shape[1] if max_neighbors is None else int(max_neighbors)
    else:
        if max_neighbors is None:
            raise ValueError("adf on a Sparse neighbor list needs max_neighbors= (the most "
                             "neighbors any particle has within r_outer), or use a Dense list.")
        i, j = idx[0], idx[1]
        if neighbor.format is partition.NeighborListFormat.OrderedSparse:
            i, j = jnp.concatenate([i, j]), jnp.concatenate([j, i])
        M = int(max_neighbors)
    active = (i < n) & (j < n) & active_fn(jnp.minimum(i, n - 1), jnp.minimum(j, n - 1))
    key = jnp.where(active, i, n)
    order = jnp.argsort(key, stable=True)
    key, j = key[order], j[order]
    rank = jnp.arange(key.shape[0]) - jnp.searchsorted(key, key, side="left")
    too_many = jnp.any((key < n) & (rank >= M))
    table = jnp.full((n + 1, M), n, dtype=j.dtype)
    table = table.at[key, jnp.minimum(rank, M)].set(j, mode="drop")
    return table[:n], too_many


def adf(displacement_fn, adf_params, box=None, max_neighbors: int | None = None):
    """Angular distribution function of one snapshot, from its neighbor list.

    Every triplet j-i-k (j != k) with both neighbors within ``r_outer`` of
    the central particle i adds a normalised Gaussian of width ``sigma`` at
    its angle; the sum is divided by the number of triplets, so the result
    is a probability density over [0, pi] (rad^-1). Dense lists are used as
    they are; Sparse lists need ``max_neighbors`` (the most neighbors within
    ``r_outer`` any particle has). If a particle has more, the result is NaN.

    Args:
      displacement_fn: jax-md displacement function of the simulation (nm).
      adf_params: :class:`ADFParams`, or a tuple ``(bin_centers, sigma,
        r_outer)``.
      box: the fixed simulation box (NVT) in nm, a side length, side lengths
        or a box matrix; only used to refuse an ``r_outer`` beyond half a
        periodic orthorhombic box (NPT snapshots are not checked).
      max_neighbors: the most neighbors within ``r_outer`` that any particle
        has; required for Sparse and OrderedSparse lists, and for Dense lists
        it replaces the list's own width.

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving the
      ADF of one snapshot, shape (nbins,), in rad^-1; ``energy_fn`` is not
      used. ``fn.nan_reason`` is a sentence explaining a NaN result (None
      without ``max_neighbors``). ``fn`` raises ValueError without a neighbor
      list, for a list whose cutoff is known to be shorter than ``r_outer``,
      for an ``r_outer`` beyond half a fixed periodic orthorhombic ``box``, and
      for a Sparse list without ``max_neighbors``.

    Raises:
      TypeError: ``adf_params`` is neither :class:`ADFParams` nor a tuple of
        three.
    """
    p = _as_params(adf_params, ADFParams, 3)
    centers, sigma, r_outer = np.asarray(p.bin_centers), float(p.sigma), float(p.r_outer)

    def fn(state, neighbor=None, energy_fn=None, **kwargs):
        if neighbor is None:
            raise ValueError("adf is computed from the neighbor list: call it as "
                             "fn(state, neighbor=nbrs).")
        check_list_reach(neighbor, r_outer, "The ADF",
                         "lower the ADF's r_outer (adf_discretization(r_outer=...))")
        R = state.position
        n, dim = R.shape
        dkw = box_kwargs(state)
        sides = None if dkw else _fixed_sides(box, dim)
        if (sides is not None and r_outer > sides.min() / 2 + 1e-12
                and _is_periodic(displacement_fn, sides, dim)):
            raise ValueError(
                f"The ADF's r_outer ({r_outer:g} nm) exceeds half the box ({sides.min():g} nm "
                f"wide): a neighbor list holds one periodic image of each pair, so triplets "
                f"with other images within r_outer would be missing. Lower r_outer "
                f"(adf_discretization(r_outer=...)) to at most {sides.min() / 2:g} nm or use a "
                f"larger box.")
        disp = jax.vmap(lambda a, b: displacement_fn(a, b, **dkw))

        def within(i, j):
            dR = disp(R[i], R[j])
            return jnp.sum(dR * dR, axis=-1) < r_outer ** 2

        table, too_many = _neighbor_table(neighbor, n, max_neighbors, within)
        M = table.shape[1]
        real = table < n
        dR = jax.vmap(lambda a, b: disp(jnp.broadcast_to(a, b.shape), b))(
            R, R[jnp.minimum(table, n - 1)])   # (n, M, d): R_i - R_j (jax-md's Ra - Rb)
        r = jnp.sqrt(jnp.where(real, jnp.sum(dR * dR, axis=-1), 1.0))
        unit = dR / r[..., None]
        cos = jnp.einsum("nad,nbd->nab", unit, unit)
        pair = real[:, :, None] & real[:, None, :] & ~jnp.eye(M, dtype=bool)[None]
        theta = jnp.arccos(jnp.clip(jnp.where(pair, cos, 0.0), -1.0, 1.0))
        hist = _smoothed_histogram(theta.reshape(-1), pair.reshape(-1), centers, sigma)
        n_triplets = jnp.sum(pair)
        result = hist / jnp.maximum(n_triplets, 1)
        return jnp.where(too_many, jnp.nan, result)
    fn.nan_reason = (f"the ADF is NaN when a particle has more than max_neighbors="
                     f"{max_neighbors} neighbors within r_outer={r_outer:g} nm: raise "
                     f"max_neighbors" if max_neighbors is not None else None)
    return fn
