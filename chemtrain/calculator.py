"""ASE calculators for chemtrain models: energy, forces and stress in ASE's
units (eV, Angstrom, eV/Angstrom^3).

:class:`ChemtrainCalculator` owns the neighbor list. It is built on the host
for every structure it evaluates (matscipy when installed, else ASE), so it
is never stale and never silently wrong: edges are padded to a capacity that
grows by ``growth`` (x1.5) whenever a structure needs more, so the energy
function compiles once per atom count and capacity.

Two kinds of models:

- MACE (:meth:`ChemtrainCalculator.from_mace`, from a file written by
  :func:`chemtrain.models.mace.save` or from ``(cfg, params)``) and NequIP
  (:meth:`ChemtrainCalculator.from_nequip`, likewise): every periodic image
  within the cutoff is an edge, as in mace-torch and sevenn, so cells of
  any size and partly periodic cells work. Stress for cells periodic in all
  three directions.
- Any chemtrain energy template (``params -> energy_fn(positions, neighbor,
  **kwargs)`` in nm and kJ/mol, e.g. :mod:`chemtrain.models.pair`): the
  energy function gets a jax-md ``Sparse`` (default), ``Dense`` or
  ``OrderedSparse`` neighbor list and ``species=`` (atomic numbers). Free
  space (``pbc`` all False) with any template; cells periodic in all three
  directions only if the template's displacement takes the cell per call as
  ``box=`` (``space.periodic_general(box, fractional_coordinates=False)``, as
  chemtrain's pair templates forward it) and the cell is at least twice the
  cutoff wide (jax-md's minimum image; narrower cells are refused).
"""
from __future__ import annotations

import logging
import math

import numpy as np
from ase.calculators.calculator import Calculator, all_changes

from chemtrain.calculator_models import (MaceModel, NequipModel, TemplateModel, _members,
                                         _single, check_atoms, stress_of)
from chemtrain.neighbors import host_edges

log = logging.getLogger(__name__)

__all__ = ["ChemtrainCalculator", "CommitteeCalculator", "host_neighbors"]

FORMATS = ("sparse", "dense", "ordered_sparse")


def host_neighbors(atoms, cutoff: float):
    """All directed edges of ASE ``atoms`` within ``cutoff``, every periodic image included.

    The edges are the ``(i, j, S)`` with ``|R[j] - R[i] + S @ cell| <
    cutoff``, without self edges of zero shift, found on the host by
    :func:`chemtrain.neighbors.host_edges` (matscipy when installed, else
    ASE). ``S`` is zero along non-periodic directions.

    Args:
      atoms: an ``ase.Atoms``; its positions and cell are in Angstrom (cell
        vectors as rows, ASE's layout).
      cutoff: the cutoff distance in Angstrom.

    Returns:
      A tuple ``(i, j, S)`` of senders (E,), receivers (E,) and cell shifts
      (E, 3) in units of the cell vectors, all int32, for E edges.

    Raises:
      ValueError: from :func:`chemtrain.neighbors.host_edges`, if the cell's
        periodic vectors are zero or linearly dependent.
    """
    i, j, S = host_edges(atoms.positions, atoms.cell.array, atoms.pbc, float(cutoff))
    return i.astype(np.int32), j.astype(np.int32), S.astype(np.int32)


class ChemtrainCalculator(Calculator):
    """ASE calculator for a chemtrain energy template or MACE model (see the module docs).

    It gives ``energy`` and ``free_energy`` (the same value) in eV,
    ``forces`` (atoms, 3) in eV/Angstrom and, for cells periodic in all
    three directions, ``stress`` (Voigt order, 6 values) in eV/Angstrom^3,
    converting to and from the template's nm and kJ/mol. The constructor
    wraps an energy template; :meth:`from_mace` builds one for a chemtrain
    MACE model. The neighbor list is built on the host for every structure
    and padded to a capacity that grows to ``growth`` times the need whenever
    a structure needs more, so the energy function compiles once per atom
    count and capacity. Setting ``calc.params`` to new parameters of the
    same shapes reuses the compiled function. A calculation raises ASE's
    ``PropertyNotImplementedError`` for a stress the cell or template cannot
    give, and ``ValueError`` (or a subclass) for structures it refuses
    (non-finite positions or cell, a periodic cell without volume, partly
    periodic or too narrow cells for a template, elements a MACE model does
    not know).

    Args:
      energy_fn_template: ``params -> energy_fn(positions, neighbor,
        **kwargs)``, with positions in nm and the energy in kJ/mol.
      params: the template's parameters (pytree).
      cutoff: the neighbor list's cutoff in nm (not Angstrom), at least the
        template's range where it states one
        (:attr:`chemtrain.models.EnergyTemplate.cutoff`); None: that range.
      neighbor_format: the jax-md neighbor-list format the energy function
        gets: ``'sparse'``, ``'dense'`` or ``'ordered_sparse'``.
      species_kwarg: the keyword of ``energy_fn`` that receives the atomic
        numbers (atoms,); None: none is passed.
      capacity: the initial number of edge slots (``'dense'``: neighbors per
        atom); default: ``growth`` times the first structure's need.
      growth: factor by which the capacity grows, > 1.
      dtype: ``'float32'`` or ``'float64'``; default: float64 if any
        parameter is float64, else float32.
      **kwargs: passed on to ``ase.calculators.calculator.Calculator``.

    Raises:
      ValueError: if ``cutoff`` is below the template's range (or None for
        a template that states none), ``neighbor_format`` is not one of the
        three formats, ``growth`` <= 1, ``capacity`` < 1, ``dtype`` is
        neither float32 nor float64, or ``dtype`` is float64 while JAX runs
        without ``jax_enable_x64``.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, energy_fn_template, params, cutoff: float | None, *,
                 neighbor_format: str = "sparse", species_kwarg: str | None = "species",
                 capacity: int | None = None, growth: float = 1.5, dtype=None, **kwargs):
        super().__init__(**kwargs)
        if neighbor_format not in FORMATS:
            raise ValueError(f"neighbor_format must be one of {FORMATS}, got {neighbor_format!r}.")
        self._setup(TemplateModel(energy_fn_template, cutoff, neighbor_format,
                                  species_kwarg), params, capacity, growth, dtype)

    @classmethod
    def from_mace(cls, model, params=None, *, method: str | None = None, capacity: int | None = None,
                  growth: float = 1.5, dtype=None, head=None, **kwargs):
        """A calculator for a chemtrain MACE model: ``model`` is the path of
        a file written by :func:`chemtrain.models.mace.save`, or a
        :class:`~chemtrain.models.mace.MaceConfig` given with ``params``.
        ``method`` is cuequivariance-jax's execution method (default: the
        best for the backend). ``head`` picks a head of a multi-head model
        by name or index, as mace-torch's ``MACECalculator(..., head=...)``;
        by default, as there, the head named ``'Default'`` (after a replay
        fine-tuning: the fine-tuned head, not the foundation's ``pt_head``),
        and a model of several heads none of which is ``'Default'`` must be
        given one. ``calc.model.head`` names the head evaluated. An unknown
        head raises ``ValueError`` naming the model's heads."""
        from chemtrain.models import mace
        cfg, params = _single(model, params, "from_mace", mace.MaceConfig, mace.load)
        self = cls.__new__(cls)
        Calculator.__init__(self, **kwargs)
        self._setup(MaceModel(cfg, method, head=head), params, capacity, growth, dtype)
        return self

    @classmethod
    def from_nequip(cls, model, params=None, *, capacity: int | None = None,
                    growth: float = 1.5, dtype=None, **kwargs):
        """A calculator for a chemtrain NequIP model: ``model`` is the path
        of a file written by :func:`chemtrain.models.nequip.save`, or a
        :class:`~chemtrain.models.nequip.NequipConfig` given with ``params``
        (e.g. :func:`~chemtrain.models.nequip.load_sevennet`'s). Every
        periodic image within the cutoff is an edge, as in sevenn, so cells
        of any size and partly periodic cells work."""
        from chemtrain.models import nequip
        cfg, params = _single(model, params, "from_nequip", nequip.NequipConfig, nequip.load)
        self = cls.__new__(cls)
        Calculator.__init__(self, **kwargs)
        self._setup(NequipModel(cfg), params, capacity, growth, dtype)
        return self

    def _setup(self, model, params, capacity, growth, dtype):
        import jax
        if growth <= 1.0:
            raise ValueError(f"growth must be > 1 (the capacity multiplier), got {growth}.")
        if capacity is not None and int(capacity) < 1:
            raise ValueError(f"capacity must be a positive number of edges, got {capacity}.")
        self.model = model
        self.growth = float(growth)
        self.capacity = None if capacity is None else int(capacity)
        leaves = jax.tree_util.tree_leaves(params)
        if dtype is None:
            dtype = "float64" if any(np.asarray(x).dtype == np.float64 for x in leaves) else "float32"
        dtype = np.dtype(dtype).name
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}.")
        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError("dtype='float64' needs 64-bit JAX: call "
                             "jax.config.update('jax_enable_x64', True) first (or use float32).")
        self.dtype = dtype
        self.params = params

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params):
        """New parameters (same shapes): the compiled function is reused."""
        import jax
        import jax.numpy as jnp
        self._params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, self.dtype), params)
        self.reset()

    @property
    def n_traces(self) -> int:
        """How often this calculator's energy function was traced (compiled)."""
        return self.model.n_traces

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        energy, forces, virial = self.evaluate(self.atoms, "stress" in properties)
        self.results = {"energy": float(energy), "free_energy": float(energy), "forces": forces}
        stress = stress_of(self.atoms, virial, "stress" in properties)
        if stress is not None:
            self.results["stress"] = stress

    def evaluate(self, atoms, want_stress: bool = False):
        """The model's raw outputs for ``atoms``: ``(energy, forces, virial)``
        in eV, eV/Angstrom and eV (a committee's: one per member, stacked on
        axis 0); ``virial`` None where the template gives none. The checks
        of the class docstring come first."""
        check_atoms(atoms, want_stress)
        self.model.check(atoms)
        i, j, S = host_neighbors(atoms, self.model.cutoff)
        edges = self._padded(self.model.pack(i, j, S, len(atoms)))
        return self.model.evaluate(self._params, atoms, edges, self.dtype)

    def _padded(self, packed):
        need = packed["need"]
        if self.capacity is None or need > self.capacity:
            new = max(1, math.ceil(need * self.growth))
            if self.capacity is not None:
                log.info("neighbor list capacity %d exceeded (%d needed): grown to %d",
                         self.capacity, need, new)
            self.capacity = new
        return self.model.pad(packed, self.capacity)



class CommitteeCalculator(ChemtrainCalculator):
    """ASE calculator of a committee: K models of one architecture evaluated
    as one vectorised call.

    ``energy``, ``forces`` and ``stress`` are the members' mean (units as in
    :class:`ChemtrainCalculator`); ``results`` also holds their spread over
    members (population standard deviation, ``ddof=0``): ``energy_std`` (eV),
    ``forces_std`` (atoms,), each atom's ``sqrt(sum_xyz var)`` in
    eV/Angstrom, and ``stress_std`` (6,), with every member's values in
    ``member_energies`` (K,), ``member_forces`` (K, atoms, 3) and, where
    there is a stress, ``member_stresses`` (K, 6). Build it from a template
    and the members' parameters, or with :meth:`from_mace` from MACE files.

    Args:
      energy_fn_template: as in :class:`ChemtrainCalculator` (one member's).
      members: K >= 2 parameter pytrees of one structure (e.g.
        ``[trainer.member(k) for k in range(K)]`` of an
        :class:`~chemtrain.trainers.EnsembleOfModels`), or one pytree whose
        leaves stack the members on axis 0 (``trainer.params``).
      cutoff: as in :class:`ChemtrainCalculator` (nm; None: the template's range).
      **kwargs: the other keywords of :class:`ChemtrainCalculator`.

    Raises:
      ValueError: fewer than two members, members of different shapes, and
        everything :class:`ChemtrainCalculator` raises.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, energy_fn_template, members, cutoff: float | None, *,
                 neighbor_format: str = "sparse", species_kwarg: str | None = "species",
                 capacity: int | None = None, growth: float = 1.5, dtype=None, **kwargs):
        from chemtrain.learn.ensemble import as_stacked
        Calculator.__init__(self, **kwargs)
        if neighbor_format not in FORMATS:
            raise ValueError(f"neighbor_format must be one of {FORMATS}, got {neighbor_format!r}.")
        self._setup(TemplateModel(energy_fn_template, cutoff, neighbor_format,
                                  species_kwarg, members=True), as_stacked(members), capacity,
                    growth, dtype)

    @classmethod
    def from_mace(cls, models, params=None, *, method: str | None = None,
                  capacity: int | None = None, growth: float = 1.5, dtype=None, head=None,
                  **kwargs):
        """A committee of chemtrain MACE models: ``models`` is a list of paths
        of files written by :func:`chemtrain.models.mace.save` (all of one
        architecture), or one :class:`~chemtrain.models.mace.MaceConfig`
        given with ``params`` (the members' parameters, as for the
        constructor). ``method`` and ``head`` (every member's; default as
        there: ``'Default'`` of a model of several heads) as in
        :meth:`ChemtrainCalculator.from_mace`.

        Raises:
          ValueError: a file of another architecture than the first (named),
            fewer than two members.
        """
        from chemtrain.learn.ensemble import as_stacked
        from chemtrain.models import mace
        cfg, members = _members(models, params, "from_mace", mace.MaceConfig, mace.load)
        self = cls.__new__(cls)
        Calculator.__init__(self, **kwargs)
        self._setup(MaceModel(cfg, method, members=True, head=head), as_stacked(members),
                    capacity, growth, dtype)
        return self

    @classmethod
    def from_nequip(cls, models, params=None, *, capacity: int | None = None,
                    growth: float = 1.5, dtype=None, **kwargs):
        """A committee of chemtrain NequIP models: paths of files written by
        :func:`chemtrain.models.nequip.save` (one architecture), or one
        :class:`~chemtrain.models.nequip.NequipConfig` with the members'
        ``params``; every periodic image is an edge, as in
        :meth:`ChemtrainCalculator.from_nequip`.

        Raises:
          ValueError: a file of another architecture than the first (named),
            fewer than two members.
        """
        from chemtrain.learn.ensemble import as_stacked
        from chemtrain.models import nequip
        cfg, members = _members(models, params, "from_nequip", nequip.NequipConfig, nequip.load)
        self = cls.__new__(cls)
        Calculator.__init__(self, **kwargs)
        self._setup(NequipModel(cfg, members=True), as_stacked(members), capacity, growth, dtype)
        return self

    @property
    def n_members(self) -> int:
        """The number of members K."""
        from chemtrain.learn.ensemble import n_members
        return n_members(self.params)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        Calculator.calculate(self, atoms, properties, system_changes)
        from chemtrain.learn.ensemble import committee_spread
        energies, forces, virials = self.evaluate(self.atoms, "stress" in properties)
        mean = float(np.mean(energies))
        self.results = {"energy": mean, "free_energy": mean, "forces": forces.mean(0),
                        "energy_std": float(committee_spread(energies)),
                        # per atom: the norm of its components' spreads
                        "forces_std": np.linalg.norm(committee_spread(forces), axis=-1),
                        "member_energies": energies, "member_forces": forces}
        stresses = stress_of(self.atoms, virials, "stress" in properties)
        if stresses is not None:
            self.results.update(stress=stresses.mean(0), stress_std=committee_spread(stresses),
                                member_stresses=stresses)
