"""Helpers shared by the quantity modules: the box of a snapshot and the
masses of a state; for the structural quantities (the RDF in
:mod:`chemtrain.quantity.structure`, the ADF in
:mod:`chemtrain.quantity.angles`) the Gaussian-smoothed histogram, reading
their parameter tuples, the refusal of a neighbor list too short for a
quantity, and the side lengths and periodicity of a fixed box. The keyword
arguments a state gives and volumes are in :mod:`chemtrain.ensemble`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import is_npt
from ..neighbors import list_cutoff


def snapshot_box(state, box, kwargs):
    """The box of one snapshot: an NPT state's own box, else the box given to
    the quantity's factory, else ``box`` among the call's keyword arguments."""
    if is_npt(state):
        from jax_md import simulate
        return simulate.npt_box(state)
    if box is not None:
        return jnp.asarray(box)
    if kwargs.get("box") is not None:
        return jnp.asarray(kwargs["box"])
    raise ValueError("This quantity needs the simulation box: pass box=... to its factory (a "
                     "scalar side, a vector of sides or a box matrix, in nm), or in "
                     "state_kwargs.")


def masses(state):
    """Per-particle masses (N,) of a jax-md state (scalar or (N,)/(N, 1) mass)."""
    n = state.position.shape[0]
    m = jnp.asarray(state.mass)
    return jnp.broadcast_to(m.reshape(-1) if m.ndim else m, (n,))


WINDOW = 6.0  # Gaussian kernels are cut at this many standard deviations


def uniform_bins(centers) -> bool:
    c = np.asarray(centers, np.float64)
    if c.size < 2:
        return False
    d = np.diff(c)
    return bool(np.all(d > 0) and np.allclose(d, d[0], rtol=1e-9, atol=0.0))


def smoothed_histogram(x, use, centers, sigma):
    """sum over samples of the normalised Gaussian ``N(center; x, sigma)``,
    for each center; samples with ``use`` False are skipped. For uniform
    centers only the bins within WINDOW sigma of a sample are touched."""
    norm = 1.0 / (math.sqrt(2.0 * math.pi) * sigma)
    if not uniform_bins(centers):
        k = jnp.exp(-0.5 * ((x[:, None] - centers[None, :]) / sigma) ** 2)
        return norm * jnp.sum(jnp.where(use[:, None], k, 0.0), axis=0)
    c = np.asarray(centers, np.float64)
    step = float(c[1] - c[0])
    m = int(math.ceil(WINDOW * sigma / step))
    nearest = jnp.round((x - c[0]) / step).astype(jnp.int32)
    offsets = jnp.arange(-m, m + 1, dtype=jnp.int32)
    bins = nearest[:, None] + offsets[None, :]
    inside = use[:, None] & (bins >= 0) & (bins < c.size)
    where_c = c[0] + step * bins.astype(x.dtype)
    k = jnp.where(inside, norm * jnp.exp(-0.5 * ((x[:, None] - where_c) / sigma) ** 2), 0.0)
    return jnp.zeros(c.size, x.dtype).at[jnp.where(inside, bins, 0)].add(k)


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


def as_params(params, cls, n):
    if isinstance(params, cls):
        return params
    if isinstance(params, (tuple, list)) and len(params) == n:
        return cls(*params)
    raise TypeError(f"Expected {cls.__name__} (or a tuple of {n}: {', '.join(cls._fields)}), "
                    f"got {type(params).__name__}.")


def fixed_sides(box, dim: int):
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


def is_periodic(displacement_fn, sides, dim: int, **kwargs) -> bool:
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
