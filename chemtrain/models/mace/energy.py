"""MACE as a chemtrain energy function on jax-md neighbor lists.

Unit conversion lives here and only here: chemtrain works in nm and kJ/mol,
MACE (and its published weights) in Angstrom and eV. Positions are multiplied
by :data:`LENGTH_TO_ANGSTROM` on the way in and energies by
:data:`ENERGY_TO_KJ_PER_MOL` on the way out, so forces come out in kJ/mol/nm.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from chemtrain import units
from chemtrain.models.mace.model import MaceConfig, node_energies
from chemtrain.models.pair import neighbor_pairs
from chemtrain.models.template import EnergyTemplate

LENGTH_TO_ANGSTROM = 1.0 / units.ANGSTROM_TO_NM   # nm -> Angstrom
ENERGY_TO_KJ_PER_MOL = units.EV_TO_KJ_PER_MOL      # eV -> kJ/mol

# cuequivariance-jax 0.13 drops JAX's varying-manual-axis type in the
# derivatives of its segmented polynomials, so shard_map's check fails on
# them (NOTES.md: "Expected cotangent type ...{V:data}"). With the check off,
# the trainer's step (chemtrain.learn.step) still casts the parameters to
# varying before differentiating and averages the local gradients with an
# explicit pmean (Strategy.vary / Strategy.mean_gradient), which is correct
# with or without the check. The template carries it as EnergyTemplate.check_vma.
# Remove it (set True) once cuequivariance-jax keeps the varying
# type in both forward- and reverse-mode derivatives.
CHECK_VMA = False


class UnknownElementError(ValueError):
    """A structure holds an element that the model was not trained on."""


def species_to_elements(cfg: MaceConfig, species):
    """Atomic numbers -> the model's element indices (-1 where unknown)."""
    table = jnp.asarray(cfg.element_table())
    return table[jnp.clip(jnp.asarray(species), 0, 118)]


def check_species(cfg: MaceConfig, species, mask=None) -> None:
    """Raise :class:`UnknownElementError` if a real atom's atomic number
    (``species``) is not one of the model's elements."""
    if species is None:
        raise ValueError("The MACE model needs per-atom atomic numbers: add a 'species' array "
                         "(structures x atoms, integers) to the dataset.")
    z = np.asarray(species)
    real = np.ones(z.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    if not np.issubdtype(z.dtype, np.integer):
        raise UnknownElementError(f"species must be integer atomic numbers, got dtype {z.dtype}.")
    known = np.isin(z, cfg.atomic_numbers)
    bad = np.unique(z[real & ~known])
    if bad.size:
        raise UnknownElementError(
            f"The dataset has atomic numbers {bad.tolist()} that the MACE model does not know; "
            f"it was built for {list(cfg.atomic_numbers)}. Remove those structures or use a "
            f"model trained on these elements.")


def energy_fn_template(cfg: MaceConfig, displacement_fn: Callable, method: str | None = None) -> Callable:
    """``params -> energy_fn(positions, neighbor, species=..., mask=..., box=...)``.

    ``species`` are atomic numbers (per atom), ``mask`` marks real atoms
    (padding is False) and ``box`` is passed to ``displacement_fn`` (periodic
    systems; jax-md's ``space.periodic_general`` with fractional coordinates
    works as well as plain ``space.free``). The neighbor list must hold both
    directions of every pair (jax-md Sparse or Dense formats) with a cutoff
    of at least ``cfg.r_max`` Angstrom (``cfg.r_max / 10`` nm); edges longer
    than that, padded edges and edges to masked atoms contribute nothing.
    The energy is NaN if a real atom's element is unknown to the model, so a
    trainer stops rather than learn from it.
    """

    def template(params):
        def energy_fn(positions, neighbor, species=None, mask=None, **kwargs):
            from jax_md import partition
            if species is None:
                raise ValueError("The MACE energy function needs species= (atomic numbers per atom).")
            if neighbor.format is partition.NeighborListFormat.OrderedSparse:
                raise ValueError("MACE needs both directions of each pair: use a jax-md "
                                 "neighbor list in Sparse or Dense format, not OrderedSparse.")
            n = positions.shape[0]
            element = species_to_elements(cfg, species)
            node_mask = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask).astype(bool)
            i, j, _ = neighbor_pairs(neighbor, n)
            ic, jc = jnp.minimum(i, n - 1), jnp.minimum(j, n - 1)
            real = (i < n) & (j < n) & (i != j) & node_mask[ic] & node_mask[jc]
            disp = {"box": kwargs["box"]} if "box" in kwargs else {}
            # receiver i, sender j; the vector points from sender to receiver
            vec = jax.vmap(lambda a, b: displacement_fn(a, b, **disp))(positions[ic], positions[jc])
            e = node_energies(params, cfg, vec * LENGTH_TO_ANGSTROM, senders=jc, receivers=ic,
                              edge_mask=real, element=jnp.maximum(element, 0), node_mask=node_mask,
                              method=method)
            energy = jnp.sum(e) * ENERGY_TO_KJ_PER_MOL
            unknown = jnp.any(node_mask & (element < 0))
            return jnp.where(unknown, jnp.nan, energy)
        return energy_fn

    return EnergyTemplate(template, check_vma=CHECK_VMA,
                          validate_dataset=lambda data: check_species(cfg, data.get("species"),
                                                                      data.get("mask")))
