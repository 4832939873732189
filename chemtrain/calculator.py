"""ASE calculators for chemtrain models: energy, forces and stress in ASE's
units (eV, Angstrom, eV/Angstrom^3).

:class:`ChemtrainCalculator` owns the neighbor list. It is built on the host
for every structure it evaluates (matscipy when installed, else ASE), so it
is never stale and never silently wrong: edges are padded to a capacity that
grows by ``growth`` (x1.5) whenever a structure needs more, so the energy
function compiles once per atom count and capacity.

Two kinds of models:

- MACE (:meth:`ChemtrainCalculator.from_mace`, from a file written by
  :func:`chemtrain.models.mace.save` or from ``(cfg, params)``): every
  periodic image within the cutoff is an edge, as in mace-torch, so cells of
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
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from chemtrain.calculator_models import NM, MaceModel, TemplateModel
from chemtrain.neighbors import host_edges

log = logging.getLogger(__name__)

__all__ = ["ChemtrainCalculator", "host_neighbors"]

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
      cutoff: the template's cutoff in nm (not Angstrom).
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
      ValueError: if ``neighbor_format`` is not one of the three formats,
        ``growth`` <= 1, ``capacity`` < 1, ``dtype`` is neither float32 nor
        float64, or ``dtype`` is float64 while JAX runs without
        ``jax_enable_x64``.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, energy_fn_template, params, cutoff: float, *, neighbor_format: str = "sparse",
                 species_kwarg: str | None = "species", capacity: int | None = None,
                 growth: float = 1.5, dtype=None, **kwargs):
        super().__init__(**kwargs)
        if neighbor_format not in FORMATS:
            raise ValueError(f"neighbor_format must be one of {FORMATS}, got {neighbor_format!r}.")
        self._setup(TemplateModel(energy_fn_template, float(cutoff) / NM, neighbor_format,
                                  species_kwarg), params, capacity, growth, dtype)

    @classmethod
    def from_mace(cls, model, params=None, *, method: str | None = None, capacity: int | None = None,
                  growth: float = 1.5, dtype=None, **kwargs):
        """A calculator for a chemtrain MACE model: ``model`` is the path of
        a file written by :func:`chemtrain.models.mace.save`, or a
        :class:`~chemtrain.models.mace.MaceConfig` given with ``params``.
        ``method`` is cuequivariance-jax's execution method (default: the
        best for the backend)."""
        from chemtrain.models import mace
        if isinstance(model, mace.MaceConfig):
            if params is None:
                raise ValueError("from_mace(cfg, params): a MaceConfig needs its params.")
            cfg = model
        else:
            if params is not None:
                raise ValueError("from_mace(path): params come from the file; pass either a path "
                                 "or (cfg, params).")
            cfg, params = mace.load(str(model))
        self = cls.__new__(cls)
        Calculator.__init__(self, **kwargs)
        self._setup(MaceModel(cfg, method), params, capacity, growth, dtype)
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
        atoms = self.atoms
        pbc = np.asarray(atoms.pbc, bool)
        want_stress = "stress" in properties
        if want_stress and not pbc.all():
            raise PropertyNotImplementedError(
                f"stress needs a cell periodic in all three directions, these atoms have pbc "
                f"{pbc.tolist()}.")
        if pbc.all() and atoms.get_volume() < 1e-9:
            raise ValueError(f"These atoms are periodic (pbc {pbc.tolist()}) but their cell has no "
                             f"volume ({atoms.cell.array.tolist()}); set a cell with atoms.set_cell.")
        positions = atoms.get_positions()
        if not np.all(np.isfinite(positions)):
            bad = np.nonzero(~np.all(np.isfinite(positions), axis=1))[0]
            raise ValueError(f"Atom(s) {bad[:10].tolist()} have non-finite positions "
                             f"({positions[bad[0]].tolist()}); an energy of such a structure "
                             f"means nothing. Check the structure (or the dynamics that made it).")
        if pbc.any() and not np.all(np.isfinite(atoms.cell.array)):
            raise ValueError(f"The cell has non-finite entries ({atoms.cell.array.tolist()}).")
        self.model.check(atoms)
        i, j, S = host_neighbors(atoms, self.model.cutoff)
        edges = self._padded(self.model.pack(i, j, S, len(atoms)))
        energy, forces, virial = self.model.evaluate(self._params, atoms, edges, self.dtype)
        self.results = {"energy": energy, "free_energy": energy, "forces": forces}
        if pbc.all() and virial is not None:
            self.results["stress"] = full_3x3_to_voigt_6_stress(virial / atoms.get_volume())
        elif want_stress:
            raise PropertyNotImplementedError(
                "stress: the energy's derivative with respect to perturbation= is exactly zero, "
                "so the energy template ignores that keyword (or nothing in the cell interacts) "
                "and the stress is unknown. Pass energy_fn's keyword arguments on to the jax-md "
                "displacement function (displacement(Ra, Rb, **kwargs)), as "
                "chemtrain.models.pair does.")

    def _padded(self, packed):
        need = packed["need"]
        if self.capacity is None or need > self.capacity:
            new = max(1, math.ceil(need * self.growth))
            if self.capacity is not None:
                log.info("neighbor list capacity %d exceeded (%d needed): grown to %d",
                         self.capacity, need, new)
            self.capacity = new
        return self.model.pad(packed, self.capacity)
