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
import jax
import jax.numpy as jnp

from chemtrain import units
from chemtrain.models.mace.model import MaceConfig, node_energies
from chemtrain.models.mace.heads import default_head
from chemtrain.neighbors import GRAPH_KEYS, check_minimum_image, disjoint_edges, edge_vectors
from chemtrain.models.template import EnergyTemplate, periodic
from chemtrain.models.species import check_species as species_check

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


def species_to_elements(cfg: MaceConfig, species):
    """Map atomic numbers to the model's element indices.

    Args:
      cfg: the model configuration.
      species: integer atomic numbers, any shape (e.g. (N,) or
        (n_structures, N)). Values are clipped to 0..118 before the lookup.

    Returns:
      An int32 array of the shape of ``species`` holding the index of each
      atomic number in ``cfg.atomic_numbers``, -1 where the model does not
      know it.
    """
    table = jnp.asarray(cfg.element_table())
    return table[jnp.clip(jnp.asarray(species), 0, 118)]


def check_species(cfg: MaceConfig, species, mask=None, what: str = "The dataset has",
                  fix: str = "Remove those structures or use a model trained on these "
                             "elements.") -> None:
    """Check that every real atom's element is one the model knows
    (:func:`chemtrain.models.species.check_species` with ``cfg.atomic_numbers``).

    Args:
      cfg: the model configuration.
      species: integer atomic numbers, any shape (e.g. (n_structures, N)).
      mask: bool array of the shape of ``species``, True for real atoms;
        None: every atom is real.
      what: start of the error message, before the unknown atomic numbers.
      fix: end of the error message (what to do).

    Raises:
      ValueError: if ``species`` is None (the dataset has no ``'species'``).
      UnknownElementError: non-integer species, or a real atom's atomic
        number is not one of ``cfg.atomic_numbers`` (named with its symbol).
    """
    species_check(cfg.atomic_numbers, species, mask, model="MACE", what=what, fix=fix)


def check_heads(cfg: MaceConfig, head) -> None:
    """Check a dataset's ``'head'`` column: integer indices of the model's heads.

    Args:
      cfg: the model configuration.
      head: None (no column: every structure uses the default head, see
        :func:`chemtrain.models.mace.default_head`) or integer head indices,
        any shape (e.g. (n_structures,)).

    Raises:
      ValueError: naming the model's heads, if ``head`` is not of an integer
        dtype or an index is out of range (``0 <= head < num_heads``), or is
        None for a model of several heads none of which is ``'Default'``.
    """
    if head is None:
        if cfg.num_heads > 1:
            try:
                default_head(cfg)
            except ValueError as e:
                raise ValueError(f"{e} Give the dataset a 'head' column (one head index per "
                                 f"structure).") from None
        return
    h = np.asarray(head)
    if not np.issubdtype(h.dtype, np.integer):
        raise ValueError(f"The dataset's 'head' must be integer head indices, got dtype {h.dtype}; "
                         f"the MACE model's heads are {list(cfg.heads)} (index 0..{cfg.num_heads - 1}).")
    bad = np.unique(h[(h < 0) | (h >= cfg.num_heads)])
    if bad.size:
        raise ValueError(f"The dataset's 'head' holds indices {bad.tolist()[:8]} out of range: the "
                         f"MACE model has {cfg.num_heads} head(s) {list(cfg.heads)} (index "
                         f"0..{cfg.num_heads - 1}).")


def _head_index(cfg: MaceConfig, head):
    """(index, out of range) of the energy function's ``head`` argument:
    names and untraced indices are checked here, a traced index gives NaN
    energies when out of range."""
    if head is None:
        if cfg.num_heads == 1:
            return None, False
        head = default_head(cfg)   # as mace-torch's calculator: 'Default'
    if isinstance(head, str):
        return cfg.head_index(head), False
    h = jnp.asarray(head)
    if h.shape != () or not jnp.issubdtype(h.dtype, jnp.integer):
        raise ValueError(f"head must be an integer scalar (one structure's head index), got "
                         f"{h.dtype} of shape {h.shape}; the MACE model's heads are "
                         f"{list(cfg.heads)}.")
    if not isinstance(head, jax.core.Tracer) and not 0 <= int(head) < cfg.num_heads:
        raise ValueError(f"Head index {int(head)} is out of range: the MACE model has "
                         f"{cfg.num_heads} head(s) {list(cfg.heads)} (index 0..{cfg.num_heads - 1}).")
    return h, (h < 0) | (h >= cfg.num_heads)


def check_cells(cfg: MaceConfig, data) -> None:
    """Refuse periodic cells narrower than twice ``r_max`` unless the data
    carry precomputed graphs (a jax-md neighbor list counts one periodic
    image per pair; mace-torch counts all of them)."""
    if "box" in data and not all(k in data for k in GRAPH_KEYS):
        check_minimum_image(data["box"], cfg.r_max / LENGTH_TO_ANGSTROM, data.get("pbc"),
                            name="The MACE data's box")


def energy_fn_template(cfg: MaceConfig, displacement_fn: Callable | None = None,
                       method: str | None = None) -> Callable:
    """The chemtrain energy template of a MACE model (nm and kJ/mol).

    The template maps ``params`` (the pytree of
    :func:`chemtrain.models.mace.init_params`, :func:`chemtrain.models.mace.load`
    or :func:`chemtrain.models.mace.load_mace_torch`) to ``energy_fn(positions, neighbor,
    species=..., mask=..., box=...)``, whose arguments are:

    - ``positions``: (N, 3) in nm (multiplied by :data:`LENGTH_TO_ANGSTROM`
      for the model).
    - ``neighbor``: either a precomputed :class:`chemtrain.neighbors.Graph`
      (every periodic image as an edge, exactly as mace-torch counts them;
      ``box`` gives the cell the shifts refer to, and ``displacement_fn`` may
      be None) or a jax-md neighbor list holding both directions of every
      pair (Sparse or Dense) with a cutoff of at least ``cfg.r_max`` Angstrom
      (``cfg.r_max / 10`` nm), used with ``displacement_fn`` (``space.free``,
      or ``space.periodic_general`` for cells at least ``2 r_max`` wide;
      ``box`` is passed on).
    - ``species``: atomic numbers per atom, integers (N,); required.
    - ``mask``: bool (N,), True for real atoms (padding is False); default:
      all atoms real.
    - ``head``: the head of a model with several heads (see
      :attr:`MaceConfig.heads`), an integer index, a scalar per structure (a
      dataset column ``'head'`` of shape (n_structures,) reaches the energy
      function this way); a head name is also taken outside traced code.
      Only that head's E0s, scale, shift and readout output contribute.
      Default: the only head, or the head named ``'Default'`` of a model of
      several (as mace-torch's calculator: after a replay fine-tuning the
      fine-tuned head; :func:`chemtrain.models.mace.default_head`).
    - ``box`` and ``perturbation`` (jax-md's strain of every edge vector):
      ``perturbation`` is honoured in both cases, so the stress is the
      derivative with respect to it. Other keyword arguments are ignored.

    ``energy_fn`` returns the total potential energy, a scalar in kJ/mol (eV
    times :data:`ENERGY_TO_KJ_PER_MOL`), so its negative gradient gives forces
    in kJ/mol/nm. Edges longer than ``r_max``, padded edges and edges to masked
    atoms contribute nothing, and masked atoms have no energy. The energy is NaN
    if a real atom's element is unknown to the model, or a traced ``head``
    index is out of range, so a trainer stops rather than learn from it.
    ``energy_fn`` raises ``ValueError`` if ``species`` is None, if ``neighbor``
    is a jax-md OrderedSparse list (it holds one direction per pair), if a
    jax-md list comes without ``displacement_fn``, or if ``head`` is not an
    integer scalar, an unknown name or (when not traced) an index out of range.

    Args:
      cfg: the model configuration (Angstrom, eV).
      displacement_fn: jax-md displacement function for neighbor lists (nm);
        None for precomputed graphs only.
      method: cuequivariance-jax execution method (see
        :func:`chemtrain.models.mace.node_energies`); default: the CUDA kernel
        on a GPU when available, plain JAX elsewhere.

    Returns:
      An :class:`~chemtrain.models.EnergyTemplate` with ``check_vma`` set to
      :data:`CHECK_VMA`, ``cutoff`` ``cfg.r_max / 10`` nm, ``periodic``
      inferred from ``displacement_fn``, and a ``validate_dataset`` that raises
      ``ValueError`` for a dataset without ``'species'``,
      :class:`UnknownElementError` for elements the model does not know (see
      :func:`check_species`), ``ValueError`` for a ``'head'`` column that is not
      integer indices of the model's heads (see :func:`check_heads`), and
      :class:`~chemtrain.neighbors.SmallCellError` for periodic cells
      narrower than ``2 r_max`` unless the data carry precomputed graphs (a
      jax-md neighbor list counts one periodic image per pair, mace-torch all
      of them).
    """

    def template(params):
        def energy_fn(positions, neighbor, species=None, mask=None, head=None, **kwargs):
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
            head, bad_head = _head_index(cfg, head)
            e = node_energies(params, cfg, vec * LENGTH_TO_ANGSTROM, senders=senders,
                              receivers=receivers, edge_mask=real,
                              element=jnp.maximum(element, 0), node_mask=node_mask, method=method,
                              head=head)
            energy = jnp.sum(e) * ENERGY_TO_KJ_PER_MOL
            unknown = jnp.any(node_mask & (element < 0)) | bad_head
            return jnp.where(unknown, jnp.nan, energy)
        return energy_fn

    def validate(data):
        check_species(cfg, data.get("species"), data.get("mask"))
        check_heads(cfg, data.get("head"))
        check_cells(cfg, data)

    return EnergyTemplate(template, check_vma=CHECK_VMA, validate_dataset=validate,
                          cutoff=cfg.r_max / LENGTH_TO_ANGSTROM, periodic=periodic(displacement_fn),
                          batched=batched_template(cfg, displacement_fn, method))


def batched_template(cfg: MaceConfig, displacement_fn: Callable | None = None,
                     method: str | None = None) -> Callable:
    """``params -> energies(positions, neighbor, species=..., mask=..., head=...,
    box=..., perturbation=...)``: the energies of a batch of structures,
    evaluated as one graph with no edges between the structures (as
    mace-torch batches), not as a ``jax.vmap`` of the single-structure
    energy function.

    Every argument carries a leading structure axis B: positions (B, N, 3) in
    nm, ``neighbor`` a :class:`~chemtrain.neighbors.Graph` of (B, E) arrays
    or a jax-md neighbor list with a leading axis B (one list per structure,
    e.g. ``jax.vmap(nbrs.update)(positions)``; needs ``displacement_fn``),
    species and mask (B, N), head (B,), box and perturbation (B, ...) in any
    form :func:`~chemtrain.neighbors.edge_vectors` takes per structure. The
    result is (B,) energies in kJ/mol, each equal to what the
    single-structure energy function of :func:`energy_fn_template` gives for
    that structure (NaN for a structure with an unknown element or a head out
    of range). Trainers use it through :attr:`EnergyTemplate.batched
    <chemtrain.models.EnergyTemplate.batched>`: a vmap over structures runs
    the radial MLP's second backward pass about 2.5 times slower on CPU
    (``benchmarks/profile_main_job.py --mlp``).
    """

    def template(params):
        def energies(positions, neighbor, species=None, mask=None, head=None, box=None,
                     perturbation=None, **kwargs):
            from jax_md import partition
            if species is None:
                raise ValueError("The MACE energy function needs species= (atomic numbers per atom).")
            if getattr(neighbor, "format", None) is partition.NeighborListFormat.OrderedSparse:
                raise ValueError("MACE needs both directions of each pair: use a jax-md "
                                 "neighbor list in Sparse or Dense format, not OrderedSparse.")
            b, n = positions.shape[:2]
            element = species_to_elements(cfg, species)
            node_mask = jnp.ones((b, n), bool) if mask is None else jnp.asarray(mask).astype(bool)
            s, r, vec, real = disjoint_edges(displacement_fn, positions, neighbor, node_mask,
                                             box, perturbation)
            if head is None and cfg.num_heads > 1:   # as mace-torch's calculator: 'Default'
                head = jnp.full((b,), default_head(cfg), jnp.int32)
            if head is None:
                hd, bad_head = None, jnp.zeros((b,), bool)
            else:
                h = jnp.asarray(head)
                if h.shape != (b,) or not jnp.issubdtype(h.dtype, jnp.integer):
                    raise ValueError(f"head must hold one integer head index per structure, shape "
                                     f"({b},), got {h.dtype} of shape {h.shape}.")
                hd = jnp.repeat(h, n)
                bad_head = (h < 0) | (h >= cfg.num_heads)
            e = node_energies(params, cfg, vec * LENGTH_TO_ANGSTROM, senders=s, receivers=r,
                              edge_mask=real,
                              element=jnp.maximum(element, 0).reshape(-1),
                              node_mask=node_mask.reshape(-1), method=method, head=hd,
                              vmap_safe=False)
            energy = jnp.sum(e.reshape(b, n), axis=1) * ENERGY_TO_KJ_PER_MOL
            unknown = jnp.any(node_mask & (element < 0), axis=1) | bad_head
            return jnp.where(unknown, jnp.nan, energy)
        return energies
    return template
