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

The RDF is defined here; the ADF in :mod:`chemtrain.quantity.angles`, and
the helpers both use in :mod:`chemtrain.quantity.common`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..neighbors import list_cutoff, neighbor_pairs
from ..ensemble import box_kwargs, volume
from .common import (as_params, check_list_reach, fixed_sides, is_periodic, smoothed_histogram,
                     snapshot_box)


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


def _farthest_image(sides) -> float:
    """The largest minimum-image distance in a periodic orthorhombic box of
    these side lengths (:func:`fixed_sides`), inf when there are none."""
    return math.inf if sides is None else float(np.sqrt(np.sum((sides / 2) ** 2)))


#: most pair distances (pairs x periodic images) per snapshot that the RDF
#: computes from all pairs instead of a neighbor list (small systems)
DENSE_PAIR_LIMIT = 2_000_000
_IMAGES = ("nearest", "all")


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
        periodic_images: str | None = None, max_all_pairs: int = DENSE_PAIR_LIMIT):
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
    given, small systems (at most ``max_all_pairs`` pair distances) are
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
      max_all_pairs: the most pair distances (pairs x images) per snapshot
        computed from all pairs; beyond it the neighbor list must reach the
        range (default ``DENSE_PAIR_LIMIT``, 2e6).

    Returns:
      ``fn(state, neighbor=None, energy_fn=None, **state_kwargs)`` giving g(r)
      of one snapshot, shape (nbins,), dimensionless; ``energy_fn`` is not
      used. ``fn`` raises ValueError when the range exceeds half the box and
      ``periodic_images`` is None, when ``periodic_images='all'`` needs more
      than ``max_all_pairs`` distances, when a large system has no neighbor
      list or one known to be too short, and when no box is known.

    Raises:
      TypeError: ``rdf_params`` is neither :class:`RDFParams` nor a tuple of
        three.
      ValueError: ``rdf_params`` does not have one more bin edge than bin
        centers, or ``periodic_images`` is not None, 'nearest' or 'all'.
    """
    p = as_params(rdf_params, RDFParams, 3)
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
        sides = None if dkw else fixed_sides(box, dim)
        if sides is not None and not is_periodic(displacement_fn, sides, dim):
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
            if count > max_all_pairs:
                if shifts is not None:
                    raise ValueError(
                        f"periodic_images='all' computes the RDF from every pair and image: "
                        f"{count} distances per snapshot, more than this RDF computes "
                        f"(max_all_pairs = {max_all_pairs}). "
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
        counts = factor * smoothed_histogram(r, use, centers, sigma) * widths
        return counts * vol / (n * n * shell)
    return fn
