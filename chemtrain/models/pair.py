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
    """Sum ``pair_fn(r)`` over the real edges of a jax-md neighbor list or a
    precomputed :class:`chemtrain.neighbors.Graph` (``box`` and
    ``perturbation`` among ``displacement_kwargs``)."""
    _, _, dr, real = edge_vectors(displacement_fn, positions, neighbor, **displacement_kwargs)
    d2 = jnp.sum(dr * dr, axis=-1)
    r = jnp.sqrt(jnp.where(real, d2, 1.0))  # safe gradient on unused edges
    return pair_weight(neighbor) * jnp.sum(jnp.where(real, pair_fn(r), 0.0))


def cosine_cutoff(r, r_cutoff):
    return jnp.where(r < r_cutoff, 0.5 * (jnp.cos(jnp.pi * r / r_cutoff) + 1.0), 0.0)


def lennard_jones_template(displacement_fn: Callable, r_cutoff: float,
                           r_onset: float | None = None) -> Callable:
    """Lennard-Jones with parameters ``{'sigma', 'epsilon'}``, smoothly switched
    to zero between ``r_onset`` (default 0.9 r_cutoff) and ``r_cutoff``.
    ``displacement_fn`` may be None for precomputed graphs."""
    from jax_md import energy as jmd_energy
    r_onset = 0.9 * r_cutoff if r_onset is None else r_onset
    switch = jmd_energy.multiplicative_isotropic_cutoff(
        lambda r, sigma, epsilon: jmd_energy.lennard_jones(r, sigma, epsilon), r_onset, r_cutoff)

    def template(params):
        def energy_fn(positions, neighbor, **kwargs):
            return pair_energy(lambda r: switch(r, params["sigma"], params["epsilon"]),
                               displacement_fn, positions, neighbor, **_box(kwargs))
        return energy_fn
    return EnergyTemplate(template, cutoff=float(r_cutoff), periodic=periodic(displacement_fn))


def init_pair_mlp(key, hidden: Sequence[int] = (32, 32), n_basis: int = 16, dtype=jnp.float32):
    """Initial parameters of :func:`pair_mlp_template`."""
    sizes = (n_basis, *hidden, 1)
    keys = jax.random.split(key, len(sizes) - 1)
    layers = [{"w": jax.random.normal(k, (a, b), dtype) / jnp.sqrt(a), "b": jnp.zeros((b,), dtype)}
              for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
    return {"layers": layers}


def pair_mlp_template(displacement_fn: Callable, r_cutoff: float, n_basis: int = 16,
                      r_min: float = 0.0) -> Callable:
    """A small neural pair potential: an MLP on a Gaussian distance basis,
    multiplied by a cosine cutoff so energy and forces vanish at ``r_cutoff``."""
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
            return pair_energy(pair_fn, displacement_fn, positions, neighbor, **_box(kwargs))
        return energy_fn
    return template


def harmonic_bond_template(displacement_fn: Callable, bonds) -> Callable:
    """Harmonic bonds ``0.5 k (r - r0)^2`` with parameters ``{'k', 'r0'}``
    (kJ/mol/nm^2 and nm; scalars, or one value per bond).

    ``bonds`` is an (n_bonds, 2) array of particle indices. The bonds are
    fixed, so the energy function ignores the neighbor list it is given (it
    accepts one, like every template here, so simulators and quantities can
    pass theirs).
    """
    bonds = jnp.asarray(bonds)
    if bonds.ndim != 2 or bonds.shape[1] != 2:
        raise ValueError(f"bonds must be an (n_bonds, 2) array of particle indices, got shape "
                         f"{bonds.shape}.")

    def template(params):
        def energy_fn(positions, neighbor=None, **kwargs):
            disp = _box(kwargs)
            dr = jax.vmap(lambda a, b: displacement_fn(a, b, **disp))(
                positions[bonds[:, 0]], positions[bonds[:, 1]])
            r = jnp.sqrt(jnp.sum(dr * dr, axis=-1))
            return jnp.sum(0.5 * params["k"] * (r - params["r0"]) ** 2)
        return energy_fn
    return template


def _box(kwargs):
    """Displacement keyword arguments among an energy function's inputs: a
    dataset's or NPT simulator's ``box`` and jax-md's ``perturbation``."""
    return {k: kwargs[k] for k in ("box", "perturbation") if k in kwargs}
