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

from chemtrain import units
from chemtrain.neighbors import (Graph, check_minimum_image, edge_vectors, fixed_neighbor_list,
                                 host_edges)

log = logging.getLogger(__name__)

__all__ = ["ChemtrainCalculator", "host_neighbors"]

EV = units.EV_TO_KJ_PER_MOL            # kJ/mol per eV
NM = units.ANGSTROM_TO_NM              # nm per Angstrom
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


# --------------------------------------------------------------------------
# the two kinds of models: how edges are packed and how energies are computed

def _deformation(strain):
    """jax-md's ``perturbation`` for a strain: ``I`` plus its symmetric part
    (the derivative of the energy with respect to ``strain`` is the virial)."""
    import jax.numpy as jnp
    return jnp.eye(3, dtype=strain.dtype) + 0.5 * (strain + strain.T)


class MaceModel:
    """Chemtrain MACE on edges with explicit periodic shifts (Angstrom, eV)."""

    def __init__(self, cfg, method=None):
        self.cfg = cfg
        self.cutoff = float(cfg.r_max)
        self._fn, self._traces = _mace_function(cfg, method)
        self._table = cfg.element_table()

    @property
    def n_traces(self) -> int:
        return self._traces[0]

    def check(self, atoms) -> None:
        from chemtrain.models.mace.energy import check_species
        check_species(self.cfg, np.asarray(atoms.numbers), what="These atoms hold",
                      fix="Use a model trained on these elements.")

    def pack(self, i, j, S, n):
        return {"need": len(i), "i": i, "j": j, "S": S, "n": n}

    def pad(self, p, capacity):
        """A :class:`~chemtrain.neighbors.Graph`'s arrays: padded edges point
        at the sentinel index (the atom count)."""
        extra = capacity - p["need"]
        send = np.concatenate([p["i"], np.full(extra, p["n"], np.int32)])
        recv = np.concatenate([p["j"], np.full(extra, p["n"], np.int32)])
        shifts = np.concatenate([p["S"], np.zeros((extra, 3), np.int32)])
        return send, recv, shifts

    def evaluate(self, params, atoms, edges, dtype):
        import jax.numpy as jnp
        R = jnp.asarray(atoms.positions, dtype)
        cell = jnp.asarray(atoms.cell.array, dtype)
        element = jnp.asarray(self._table[atoms.numbers])
        E, (gR, gS) = self._fn(params, R, cell, jnp.zeros((3, 3), dtype), *map(jnp.asarray, edges),
                               element)
        return float(E), -np.asarray(gR, np.float64), np.asarray(gS, np.float64)


def _mace_function(cfg, method):
    key = (cfg, method)
    if key not in _MACE_FUNCTIONS:
        import jax
        import jax.numpy as jnp
        from chemtrain.models.mace.model import node_energies
        traces = [0]

        def energy(params, R, cell, strain, send, recv, shifts, element):
            traces[0] += 1
            # vectors from sender to receiver, every image (box: columns are
            # the cell vectors), strained as jax-md strains displacements
            s, r, vec, real = edge_vectors(None, R, Graph(send, recv, shifts), box=cell.T,
                                           perturbation=_deformation(strain))
            e = node_energies(params, cfg, vec, senders=s, receivers=r, edge_mask=real,
                              element=element, node_mask=jnp.ones(R.shape[0], bool), method=method)
            return jnp.sum(e)
        _MACE_FUNCTIONS[key] = (jax.jit(jax.value_and_grad(energy, argnums=(1, 3))), traces)
    return _MACE_FUNCTIONS[key]


_MACE_FUNCTIONS = {}


class TemplateModel:
    """A chemtrain energy template (nm, kJ/mol) on a jax-md-style neighbor
    list built on the host (minimum image in periodic cells)."""

    def __init__(self, template, cutoff, neighbor_format, species_kwarg):
        import jax
        self.template = template
        self.cutoff = float(cutoff)
        self.format = neighbor_format
        self.species_kwarg = species_kwarg
        self._traces = [0]
        self._checked_periodic = False
        self._fn = jax.jit(jax.value_and_grad(self._energy, argnums=(1, 3)),
                           static_argnames=("periodic",))

    @property
    def n_traces(self) -> int:
        return self._traces[0]

    def check(self, atoms) -> None:
        pbc = np.asarray(atoms.pbc, bool)
        if pbc.any() and not pbc.all():
            raise ValueError(
                f"A chemtrain energy template runs in free space or in a cell periodic in all "
                f"three directions; these atoms have pbc {pbc.tolist()}. Use from_mace for MACE "
                f"models (any pbc), or set atoms.pbc to all True or all False.")
        if pbc.all():  # jax-md layout: the columns are the cell vectors
            check_minimum_image(atoms.cell.array.T, self.cutoff, name="These atoms' cell",
                                unit="Angstrom",
                                fix=f"Use a supercell (atoms.repeat(...)) at least "
                                    f"{2 * self.cutoff:.4g} Angstrom wide, or from_mace for "
                                    f"MACE models (every image).")

    def pack(self, i, j, S, n):
        if self.format == "ordered_sparse":
            keep = i < j
            i, j = i[keep], j[keep]
        if self.format == "dense":
            counts = np.bincount(i, minlength=n)
            return {"need": int(counts.max(initial=0)), "i": i, "j": j, "n": n}
        return {"need": len(i), "i": i, "j": j, "n": n}

    def pad(self, p, capacity):
        n, i, j = p["n"], p["i"], p["j"]
        if self.format == "dense":
            order = np.argsort(i, kind="stable")
            i, j = i[order], j[order]
            start = np.searchsorted(i, np.arange(n))
            idx = np.full((n, capacity), n, np.int32)
            idx[i, np.arange(len(i)) - start[i]] = j
            return (idx,)
        idx = np.full((2, capacity), n, np.int32)
        idx[0, :len(i)], idx[1, :len(j)] = i, j
        return (idx,)

    def _energy(self, params, R, cell, strain, idx, species, periodic):
        self._traces[0] += 1
        neighbor = fixed_neighbor_list(idx, R * NM, self.format, self.cutoff * NM)
        kwargs = {} if self.species_kwarg is None else {self.species_kwarg: species}
        if periodic:
            kwargs["box"] = cell.T * NM   # jax-md: lattice vectors are the columns
            # jax-md's displacement functions map each displacement d to
            # perturbation @ d: its derivative is the strain derivative. (The
            # derivative through box= is not: jax-md's custom JVP of
            # space.transform passes position tangents through unscaled.)
            kwargs["perturbation"] = _deformation(strain)
        return self.template(params)(R * NM, neighbor, **kwargs) / EV

    def evaluate(self, params, atoms, edges, dtype):
        import jax.numpy as jnp
        periodic = bool(np.all(atoms.pbc))
        args = (jnp.asarray(atoms.cell.array, dtype), jnp.zeros((3, 3), dtype), jnp.asarray(edges[0]),
                jnp.asarray(atoms.numbers))
        E, (gR, gS) = self._fn(params, jnp.asarray(atoms.positions, dtype), *args, periodic=periodic)
        if periodic and not self._checked_periodic:
            self._check_lattice_invariance(params, atoms, args, float(E), dtype)
        virial = np.asarray(gS, np.float64)
        if periodic and not np.any(virial):
            # exactly zero: the template does not pass perturbation= on
            virial = None
        return float(E), -np.asarray(gR, np.float64), virial

    def _check_lattice_invariance(self, params, atoms, args, energy, dtype):
        """Moving atoms by lattice vectors must not change the energy; it
        does when the template ignores the ``box`` it is given."""
        import jax.numpy as jnp
        k = np.random.default_rng(0).integers(-1, 2, (len(atoms), 3))
        moved = atoms.positions + k @ atoms.cell.array
        E2, _ = self._fn(params, jnp.asarray(moved, dtype), *args, periodic=True)
        rtol = 1e-6 if dtype == "float64" else 1e-3
        if abs(float(E2) - energy) > rtol * max(abs(energy), 1e-3 * len(atoms)):
            raise ValueError(
                f"The energy template is not periodic in the cell it is given: moving atoms by "
                f"lattice vectors changed the energy from {energy:.8g} to {float(E2):.8g} eV. "
                f"Build the template with space.periodic_general(box, "
                f"fractional_coordinates=False) so that it uses the box= passed per call.")
        self._checked_periodic = True
