"""The angular distribution function (ADF) of one snapshot, a
Gaussian-smoothed histogram of the angles of the triplets j-i-k whose two
neighbors lie within ``r_outer`` of the central particle, from the neighbor
list (see :mod:`chemtrain.quantity.structure` for what the structural
quantities share): its bins (:class:`ADFParams`, :func:`adf_discretization`),
the per-particle neighbor table and :func:`adf` itself.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import box_kwargs
from .common import as_params, check_list_reach, fixed_sides, is_periodic, smoothed_histogram


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
    p = as_params(adf_params, ADFParams, 3)
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
        sides = None if dkw else fixed_sides(box, dim)
        if (sides is not None and r_outer > sides.min() / 2 + 1e-12
                and is_periodic(displacement_fn, sides, dim)):
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
        hist = smoothed_histogram(theta.reshape(-1), pair.reshape(-1), centers, sigma)
        n_triplets = jnp.sum(pair)
        result = hist / jnp.maximum(n_triplets, 1)
        return jnp.where(too_many, jnp.nan, result)
    fn.nan_reason = (f"the ADF is NaN when a particle has more than max_neighbors="
                     f"{max_neighbors} neighbors within r_outer={r_outer:g} nm: raise "
                     f"max_neighbors" if max_neighbors is not None else None)
    return fn
