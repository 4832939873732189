"""MACE as a chemtrain energy function on precomputed graphs or jax-md
neighbor lists.

Unit conversion lives here and only here: chemtrain works in nm and kJ/mol,
MACE (and its published weights) in Angstrom and eV. Positions are multiplied
by :data:`LENGTH_TO_ANGSTROM` on the way in and energies by
:data:`ENERGY_TO_KJ_PER_MOL` on the way out, so forces come out in kJ/mol/nm.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import jax.numpy as jnp

from chemtrain import units
from chemtrain.models.mace.model import MaceConfig, node_energies
from chemtrain.neighbors import GRAPH_KEYS, check_minimum_image, edge_vectors
from chemtrain.models.template import EnergyTemplate, periodic

LENGTH_TO_ANGSTROM = 1.0 / units.ANGSTROM_TO_NM   # nm -> Angstrom
ENERGY_TO_KJ_PER_MOL = units.EV_TO_KJ_PER_MOL      # eV -> kJ/mol

# cuequivariance-jax 0.13 drops JAX's varying-manual-axis type in the
# derivatives of its segmented polynomials, so shard_map's check fails on
# them (JAX raises "Expected cotangent type ...{V:data}"; see the docs'
# "Architecture" page, parallel training of MACE). With the check off,
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


def check_species(cfg: MaceConfig, species, mask=None, what: str = "The dataset has",
                  fix: str = "Remove those structures or use a model trained on these "
                             "elements.") -> None:
    """Raise :class:`UnknownElementError` if a real atom's atomic number
    (``species``) is not one of the model's elements; the message starts with
    ``what`` and ends with ``fix``."""
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
            f"{what} atomic numbers {_with_symbols(bad.tolist())} that the MACE model does not "
            f"know; it was built for {list(cfg.atomic_numbers)}. {fix}")


def _with_symbols(numbers) -> str:
    """``[9, 17]`` -> ``'9 (F), 17 (Cl)'``."""
    from ase.data import chemical_symbols
    return ", ".join(f"{z} ({chemical_symbols[z]})" if 0 < z < len(chemical_symbols) else str(z)
                     for z in numbers)


def check_cells(cfg: MaceConfig, data) -> None:
    """Refuse periodic cells narrower than twice ``r_max`` unless the data
    carry precomputed graphs (a jax-md neighbor list counts one periodic
    image per pair; mace-torch counts all of them)."""
    if "box" in data and not all(k in data for k in GRAPH_KEYS):
        check_minimum_image(data["box"], cfg.r_max / LENGTH_TO_ANGSTROM, data.get("pbc"),
                            name="The MACE data's box")


def energy_fn_template(cfg: MaceConfig, displacement_fn: Callable | None = None,
                       method: str | None = None) -> Callable:
    """``params -> energy_fn(positions, neighbor, species=..., mask=..., box=...)``.

    ``species`` are atomic numbers (per atom), ``mask`` marks real atoms
    (padding is False). ``neighbor`` is either a precomputed
    :class:`chemtrain.neighbors.Graph` (every periodic image as an edge,
    exactly as mace-torch counts them; ``box`` gives the cell the shifts
    refer to, and ``displacement_fn`` may be None) or a jax-md neighbor list
    holding both directions of every pair (Sparse or Dense) with a cutoff of
    at least ``cfg.r_max`` Angstrom (``cfg.r_max / 10`` nm), used with
    ``displacement_fn`` (``space.free``, or ``space.periodic_general`` for
    cells at least ``2 r_max`` wide; ``box`` is passed on). ``perturbation``
    (jax-md's strain of every edge vector) is honoured in both cases, so the
    stress is the derivative with respect to it. Edges longer than ``r_max``,
    padded edges and edges to masked atoms contribute nothing. The energy is
    NaN if a real atom's element is unknown to the model, so a trainer stops
    rather than learn from it.
    """

    def template(params):
        def energy_fn(positions, neighbor, species=None, mask=None, **kwargs):
            from jax_md import partition
            if species is None:
                raise ValueError("The MACE energy function needs species= (atomic numbers per atom).")
            if getattr(neighbor, "format", None) is partition.NeighborListFormat.OrderedSparse:
                raise ValueError("MACE needs both directions of each pair: use a jax-md "
                                 "neighbor list in Sparse or Dense format, not OrderedSparse.")
            n = positions.shape[0]
            element = species_to_elements(cfg, species)
            node_mask = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask).astype(bool)
            senders, receivers, vec, real = edge_vectors(
                displacement_fn, positions, neighbor, box=kwargs.get("box"),
                perturbation=kwargs.get("perturbation"))
            real = real & node_mask[senders] & node_mask[receivers]
            e = node_energies(params, cfg, vec * LENGTH_TO_ANGSTROM, senders=senders,
                              receivers=receivers, edge_mask=real,
                              element=jnp.maximum(element, 0), node_mask=node_mask, method=method)
            energy = jnp.sum(e) * ENERGY_TO_KJ_PER_MOL
            unknown = jnp.any(node_mask & (element < 0))
            return jnp.where(unknown, jnp.nan, energy)
        return energy_fn

    def validate(data):
        check_species(cfg, data.get("species"), data.get("mask"))
        check_cells(cfg, data)

    return EnergyTemplate(template, check_vma=CHECK_VMA, validate_dataset=validate,
                          cutoff=cfg.r_max / LENGTH_TO_ANGSTROM, periodic=periodic(displacement_fn))
