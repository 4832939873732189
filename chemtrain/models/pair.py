"""Pair potentials on jax-md neighbor lists, as ``params -> energy_fn``
templates for the trainers.

Energy functions accept ``mask`` (real atoms), ``species`` and other keyword
arguments from a dataset; edges that point at the sentinel index N (padding,
or atoms masked by the trainer) contribute nothing. ``box`` and jax-md's
``perturbation`` (a scalar or matrix that scales every displacement, used by
``chemtrain.quantity.pressure`` and jax-md's NPT simulator for the virial)
are forwarded to the displacement function.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from ..neighbors import edge_vectors, pair_weight
from .template import EnergyTemplate, periodic


def pair_energy(pair_fn: Callable, displacement_fn: Callable, positions, neighbor,
                **displacement_kwargs):
    """Sum a pair potential over the edges of a neighbor list or graph.

    Each pair is counted once: the sum over edges is halved for edge sets that
    hold both directions of every pair (a precomputed
    :class:`chemtrain.neighbors.Graph`, jax-md Sparse and Dense lists) and
    taken as is for jax-md OrderedSparse lists. Padded edges, edges that
    point at the sentinel index N and, in jax-md lists, self pairs contribute
    nothing (their distance is replaced by a dummy 1 before ``pair_fn`` is
    called, which keeps the gradient finite).

    Args:
      pair_fn: ``r -> energies``: maps the distances of all edges, shape
        (n_edges,) in nm, to the pair energies, shape (n_edges,) in kJ/mol.
      displacement_fn: jax-md displacement function, used with a jax-md
        neighbor list; may be None with a precomputed graph.
      positions: particle positions (N, 3) in nm.
      neighbor: a jax-md neighbor list (Sparse, Dense or OrderedSparse) or a
        precomputed :class:`chemtrain.neighbors.Graph`.
      **displacement_kwargs: passed on to the displacement function (for a
        graph: ``box`` applies the periodic shifts): ``box`` and jax-md's
        ``perturbation`` (a scalar or matrix that scales every displacement).

    Returns:
      The total pair energy, a scalar in kJ/mol.

    Raises:
      ValueError: (from :func:`chemtrain.neighbors.edge_vectors`) if a jax-md
        neighbor list is given with ``displacement_fn`` None, or if
        ``displacement_fn`` does not return one vector per pair.
    """
    if neighbor is None:
        raise ValueError("This pair potential sums over a neighbor list or graph, but none was "
                         "given (neighbor=None). Pass one, or build the template on all pairs "
                         "(e.g. lennard_jones_template(..., all_pairs=True)).")
    _, _, dr, real = edge_vectors(displacement_fn, positions, neighbor, **displacement_kwargs)
    d2 = jnp.sum(dr * dr, axis=-1)
    r = jnp.sqrt(jnp.where(real, d2, 1.0))  # safe gradient on unused edges
    return pair_weight(neighbor) * jnp.sum(jnp.where(real, pair_fn(r), 0.0))


def cosine_cutoff(r, r_cutoff):
    return jnp.where(r < r_cutoff, 0.5 * (jnp.cos(jnp.pi * r / r_cutoff) + 1.0), 0.0)


def lennard_jones_template(displacement_fn: Callable, r_cutoff: float,
                           r_onset: float | None = None, all_pairs: bool = False) -> Callable:
    """Lennard-Jones pair energy template, smoothly switched off at ``r_cutoff``.

    The pair energy is jax-md's ``4 epsilon ((sigma / r)^12 - (sigma / r)^6)``
    multiplied by jax-md's smooth switch from 1 at ``r_onset`` to 0 at
    ``r_cutoff``, summed over the pairs of a neighbor list or graph (see
    :func:`pair_energy`). The template's parameters are ``{'sigma': nm,
    'epsilon': kJ/mol}`` (scalars). Its energy function
    ``energy_fn(positions, neighbor, **kwargs)`` takes positions (N, 3) in nm,
    forwards ``box`` and ``perturbation`` from ``kwargs`` to the displacement
    function, ignores other keyword arguments (``mask``, ``species``, ...) and
    returns the total energy (a scalar, kJ/mol).

    Args:
      displacement_fn: jax-md displacement function; may be None for
        precomputed graphs.
      r_cutoff: distance in nm beyond which the energy is zero.
      r_onset: distance in nm where the switch starts; default
        ``0.9 * r_cutoff``.
      all_pairs: sum over all pairs of atoms (minimum image) and ignore the
        neighbor list: N^2 distances without gathers. For 864 argon atoms
        on a TPU this is 90 times faster than a Dense list, on a CPU about
        twice as slow (``benchmarks/argon_costs.py``). Needs ``r_cutoff`` at
        most half the box; honours ``mask``.

    Returns:
      An :class:`~chemtrain.models.EnergyTemplate` with ``cutoff=r_cutoff``
      and ``periodic`` inferred from ``displacement_fn``.
    """
    from jax_md import energy as jmd_energy
    r_onset = 0.9 * r_cutoff if r_onset is None else r_onset
    switch = jmd_energy.multiplicative_isotropic_cutoff(
        lambda r, sigma, epsilon: jmd_energy.lennard_jones(r, sigma, epsilon), r_onset, r_cutoff)

    def template(params):
        def energy_fn(positions, neighbor, **kwargs):
            fn = lambda r: switch(r, params["sigma"], params["epsilon"])  # noqa: E731
            if all_pairs:
                return all_pair_energy(fn, displacement_fn, positions, kwargs.get("mask"),
                                       **displacement_kwargs(kwargs))
            return pair_energy(fn, displacement_fn, positions, neighbor,
                               **displacement_kwargs(kwargs))
        return energy_fn
    return EnergyTemplate(template, cutoff=float(r_cutoff), periodic=periodic(displacement_fn))


def all_pair_energy(pair_fn: Callable, displacement_fn: Callable, positions, mask=None,
                    **displacement_kwargs):
    """Sum a pair potential over all pairs of atoms (each once; minimum image
    of ``displacement_fn``), of real atoms only where ``mask`` is given."""
    d = lambda a, b: displacement_fn(a, b, **displacement_kwargs)  # noqa: E731
    dr = jax.vmap(jax.vmap(d, (None, 0)), (0, None))(positions, positions)
    n = positions.shape[0]
    real = ~jnp.eye(n, dtype=bool)
    if mask is not None:
        real = real & mask[:, None] & mask[None, :]
    r = jnp.sqrt(jnp.where(real, jnp.sum(dr * dr, axis=-1), 1.0))
    return 0.5 * jnp.sum(jnp.where(real, pair_fn(r), 0.0))


def init_pair_mlp(key, hidden: Sequence[int] = (32, 32), n_basis: int = 16, dtype=jnp.float32):
    """Initial parameters of :func:`pair_mlp_template`.

    Weights are standard normal over sqrt(fan-in), biases zero.

    Args:
      key: a JAX PRNG key.
      hidden: widths of the hidden layers.
      n_basis: number of Gaussian basis functions (the input width); must
        match ``n_basis`` of :func:`pair_mlp_template`.
      dtype: dtype of the arrays.

    Returns:
      ``{"layers": [{"w": (n_in, n_out), "b": (n_out,)}, ...]}``, one entry per
      layer of widths ``n_basis -> *hidden -> 1``.
    """
    sizes = (n_basis, *hidden, 1)
    keys = jax.random.split(key, len(sizes) - 1)
    layers = [{"w": jax.random.normal(k, (a, b), dtype) / jnp.sqrt(a), "b": jnp.zeros((b,), dtype)}
              for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
    return {"layers": layers}


def pair_mlp_template(displacement_fn: Callable, r_cutoff: float, n_basis: int = 16,
                      r_min: float = 0.0) -> Callable:
    """A small neural pair potential on a Gaussian distance basis.

    The distance r (nm) is expanded in ``n_basis`` Gaussians
    ``exp(-((r - c) / w)^2)`` with centres ``c`` evenly spaced from ``r_min`` to
    ``r_cutoff`` and width ``w = (r_cutoff - r_min) / n_basis``; an MLP (softplus
    between layers, linear output) maps them to one pair energy (kJ/mol), which
    is multiplied by the cosine cutoff ``0.5 (cos(pi r / r_cutoff) + 1)`` (zero
    beyond ``r_cutoff``) so that energy and forces vanish at ``r_cutoff``. The
    pair energies are summed with :func:`pair_energy`. Parameters come from
    :func:`init_pair_mlp`. The energy function ``energy_fn(positions, neighbor,
    **kwargs)`` takes positions (N, 3) in nm, forwards ``box`` and
    ``perturbation`` to the displacement function and returns a scalar
    (kJ/mol).

    Args:
      displacement_fn: jax-md displacement function; may be None for
        precomputed graphs.
      r_cutoff: range of the potential in nm.
      n_basis: number of Gaussian basis functions (must match the parameters).
      r_min: centre of the first Gaussian in nm.

    Returns:
      A plain template ``params -> energy_fn`` (not an
      :class:`~chemtrain.models.EnergyTemplate`: it carries no cutoff or
      periodicity for trainers to check).
    """
    centers = jnp.linspace(r_min, r_cutoff, n_basis)
    width = (r_cutoff - r_min) / n_basis

    def template(params):
        def pair_fn(r):
            h = jnp.exp(-((r[:, None] - centers) / width) ** 2)
            for layer in params["layers"][:-1]:
                h = jax.nn.softplus(h @ layer["w"] + layer["b"])
            last = params["layers"][-1]
            return (h @ last["w"] + last["b"])[:, 0] * cosine_cutoff(r, r_cutoff)

        def energy_fn(positions, neighbor, **kwargs):
            return pair_energy(pair_fn, displacement_fn, positions, neighbor, **displacement_kwargs(kwargs))
        return energy_fn
    return template


def harmonic_bond_template(displacement_fn: Callable, bonds) -> Callable:
    """Harmonic bond energy template ``0.5 k (r - r0)^2``, summed over fixed bonds.

    The parameters are ``{'k': kJ/mol/nm^2, 'r0': nm}``, scalars or arrays of
    shape (n_bonds,) with one value per bond. The bonds are fixed, so the
    energy function ``energy_fn(positions, neighbor=None, **kwargs)`` ignores
    the neighbor list it is given (it accepts one, like every template here, so
    simulators and quantities can pass theirs). It takes positions (N, 3) in
    nm, forwards ``box`` and ``perturbation`` from ``kwargs`` to the
    displacement function and returns the total bond energy (a scalar, kJ/mol).

    Args:
      displacement_fn: jax-md displacement function (required: bond vectors are
        computed with it).
      bonds: integer array (n_bonds, 2) of particle indices.

    Returns:
      A plain template ``params -> energy_fn``.

    Raises:
      ValueError: if ``bonds`` does not have shape (n_bonds, 2).
    """
    bonds = jnp.asarray(bonds)
    if bonds.ndim != 2 or bonds.shape[1] != 2:
        raise ValueError(f"bonds must be an (n_bonds, 2) array of particle indices, got shape "
                         f"{bonds.shape}.")

    def template(params):
        def energy_fn(positions, neighbor=None, **kwargs):
            disp = displacement_kwargs(kwargs)
            dr = jax.vmap(lambda a, b: displacement_fn(a, b, **disp))(
                positions[bonds[:, 0]], positions[bonds[:, 1]])
            r = jnp.sqrt(jnp.sum(dr * dr, axis=-1))
            return jnp.sum(0.5 * params["k"] * (r - params["r0"]) ** 2)
        return energy_fn
    return template


def displacement_kwargs(kwargs):
    """Displacement keyword arguments among an energy function's inputs: a
    dataset's or NPT simulator's ``box`` and jax-md's ``perturbation``."""
    return {k: kwargs[k] for k in ("box", "perturbation") if k in kwargs}
