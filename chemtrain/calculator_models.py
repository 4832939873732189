"""The two kinds of models behind :class:`chemtrain.calculator.ChemtrainCalculator`:
how each packs and pads the host-built edges, and how it computes the energy,
the forces and the virial.

- :class:`MaceModel`: chemtrain MACE on edges with explicit periodic shifts
  (Angstrom, eV), one compiled function per configuration and method;
  :class:`NequipModel` the same for NequIP.
- :class:`TemplateModel`: a chemtrain energy template (nm, kJ/mol) on a
  jax-md-style neighbor list built on the host (minimum image in periodic
  cells), with the check that the template is periodic in the cell it gets.

Also the unit factors between ASE's units and chemtrain's that both use, the
checks of an ASE ``Atoms`` and its stress, and the loading of a committee's
member files.
"""
from __future__ import annotations

import numpy as np
from ase.calculators.calculator import PropertyNotImplementedError
from ase.stress import full_3x3_to_voigt_6_stress

from chemtrain import units
from chemtrain.neighbors import Graph, check_minimum_image, edge_vectors, fixed_neighbor_list

EV = units.EV_TO_KJ_PER_MOL            # kJ/mol per eV
NM = units.ANGSTROM_TO_NM              # nm per Angstrom


def _deformation(strain):
    """jax-md's ``perturbation`` for a strain: ``I`` plus its symmetric part
    (the derivative of the energy with respect to ``strain`` is the virial)."""
    import jax.numpy as jnp
    return jnp.eye(3, dtype=strain.dtype) + 0.5 * (strain + strain.T)


class MaceModel:
    """Chemtrain MACE on edges with explicit periodic shifts (Angstrom, eV).
    With ``members``, parameters are a committee's, stacked on axis 0, and
    :meth:`evaluate` gives one value per member."""

    def __init__(self, cfg, method=None, members: bool = False, head=None):
        self.cfg = cfg
        self.cutoff = float(cfg.r_max)
        from chemtrain.models.mace.heads import default_head
        # the head mace-torch's MACECalculator evaluates (a model of several:
        # 'Default', the fine-tuned one); None keeps a one-head model's function
        head = None if head is None and cfg.num_heads == 1 else default_head(cfg, head)
        self.head = cfg.heads[0 if head is None else head]
        self._fn, self._traces = mace_function(cfg, method, members, head)
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
        return np.asarray(E, np.float64), -np.asarray(gR, np.float64), np.asarray(gS, np.float64)


class NequipModel(MaceModel):
    """Chemtrain NequIP on the same edges as :class:`MaceModel` (every
    periodic image; Angstrom, eV)."""

    def __init__(self, cfg, members: bool = False):
        self.cfg = cfg
        self.cutoff = float(cfg.cutoff)
        self.head = None
        self._fn, self._traces = nequip_function(cfg, members)
        self._table = cfg.element_table()

    def check(self, atoms) -> None:
        from chemtrain.models.nequip.energy import check_species
        check_species(self.cfg, np.asarray(atoms.numbers))


def mace_function(cfg, method, members: bool = False, head: int | None = None):
    """The compiled ``(params, R, cell, strain, senders, receivers, shifts,
    element) -> (energy, (dE/dR, dE/dstrain))`` of a MACE model (Angstrom,
    eV) and its head ``head`` (index; None: head 0), mapped over a
    committee's stacked parameters with ``members``; shared by every
    calculator of the same configuration, method and head. Also returns a
    one-element list counting its traces."""
    def node_fn(params, vec, s, r, real, element, node_mask):
        import jax.numpy as jnp
        from chemtrain.models.mace.model import node_energies
        return node_energies(params, cfg, vec, senders=s, receivers=r, edge_mask=real,
                             element=element, node_mask=node_mask, method=method,
                             head=None if head is None else jnp.asarray(head, jnp.int32))
    return graph_function(("mace", cfg, method, members, head), node_fn, members)


def nequip_function(cfg, members: bool = False):
    """As :func:`mace_function`, for a NequIP model."""
    def node_fn(params, vec, s, r, real, element, node_mask):
        from chemtrain.models.nequip.model import node_energies
        return node_energies(params, cfg, vec, s, r, real, element, node_mask)
    return graph_function(("nequip", cfg, members), node_fn, members)


def graph_function(key, node_fn, members: bool):
    """The compiled energy and gradients of ``node_fn`` (atomic energies of
    edge vectors in Angstrom) on a graph of every periodic image, cached
    under ``key``; with its trace counter."""
    if key not in _MACE_FUNCTIONS:
        import jax
        import jax.numpy as jnp
        traces = [0]

        def energy(params, R, cell, strain, send, recv, shifts, element):
            traces[0] += 1
            # vectors from sender to receiver, every image (box: columns are
            # the cell vectors), strained as jax-md strains displacements
            s, r, vec, real = edge_vectors(None, R, Graph(send, recv, shifts), box=cell.T,
                                           perturbation=_deformation(strain))
            return jnp.sum(node_fn(params, vec, s, r, real, element, jnp.ones(R.shape[0], bool)))
        fn = jax.value_and_grad(energy, argnums=(1, 3))
        if members:
            fn = jax.vmap(fn, in_axes=(0, *[None] * 7))
        _MACE_FUNCTIONS[key] = (jax.jit(fn), traces)
    return _MACE_FUNCTIONS[key]


_MACE_FUNCTIONS = {}


def list_cutoff(template, cutoff) -> float:
    """The calculator's neighbor-list cutoff in nm: ``cutoff`` (nm), or the
    template's range (:attr:`chemtrain.models.EnergyTemplate.cutoff`) when
    None. A cutoff below the template's range is refused: the pairs in
    between would be left out without a word."""
    from chemtrain.models.template import as_template, check_range
    reach = as_template(template).cutoff
    if cutoff is None:
        if reach is None:
            raise ValueError("cutoff=None takes the template's range, but this template does "
                             "not state one: give the cutoff in nm, or wrap the template in "
                             "chemtrain.models.EnergyTemplate(fn, cutoff=...).")
        return float(reach)
    cutoff = float(cutoff)
    if not cutoff > 0 or not np.isfinite(cutoff):
        raise ValueError(f"cutoff must be a positive distance in nm, got {cutoff!r}.")
    if reach is not None:
        check_range(template, cutoff, "The calculator", f"Give cutoff= at least {reach:g} nm "
                    f"(or None: the model's range).")
    return cutoff


class TemplateModel:
    """A chemtrain energy template (nm, kJ/mol) on a jax-md-style neighbor
    list built on the host (minimum image in periodic cells). With
    ``members``, parameters are a committee's, stacked on axis 0, and
    :meth:`evaluate` gives one value per member."""

    def __init__(self, template, cutoff, neighbor_format, species_kwarg, members: bool = False):
        import jax
        self.template = template
        self.cutoff = list_cutoff(template, cutoff) / NM    # Angstrom
        self.format = neighbor_format
        self.species_kwarg = species_kwarg
        self._traces = [0]
        self._checked_periodic = False
        one = jax.value_and_grad(self._energy, argnums=(1, 3))

        def fn(params, R, cell, strain, idx, species, periodic):
            if not members:
                return one(params, R, cell, strain, idx, species, periodic)
            return jax.vmap(lambda p: one(p, R, cell, strain, idx, species, periodic))(params)
        self._fn = jax.jit(fn, static_argnames=("periodic",))

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
            self._check_lattice_invariance(params, atoms, args, np.asarray(E), dtype)
        virial = np.asarray(gS, np.float64)
        if periodic and not np.any(virial):
            # exactly zero: the template does not pass perturbation= on
            virial = None
        return np.asarray(E, np.float64), -np.asarray(gR, np.float64), virial

    def _check_lattice_invariance(self, params, atoms, args, energy, dtype):
        """Moving atoms by lattice vectors must not change the energy; it
        does when the template ignores the ``box`` it is given."""
        import jax.numpy as jnp
        k = np.random.default_rng(0).integers(-1, 2, (len(atoms), 3))
        moved = atoms.positions + k @ atoms.cell.array
        E2, _ = self._fn(params, jnp.asarray(moved, dtype), *args, periodic=True)
        E2, energy = np.ravel(np.asarray(E2, np.float64)), np.ravel(energy)
        rtol = 1e-6 if dtype == "float64" else 1e-3
        worst = int(np.argmax(np.abs(E2 - energy)))
        if abs(E2[worst] - energy[worst]) > rtol * max(abs(energy[worst]), 1e-3 * len(atoms)):
            raise ValueError(
                f"The energy template is not periodic in the cell it is given: moving atoms by "
                f"lattice vectors changed the energy from {energy[worst]:.8g} to "
                f"{E2[worst]:.8g} eV. "
                f"Build the template with space.periodic_general(box, "
                f"fractional_coordinates=False) so that it uses the box= passed per call.")
        self._checked_periodic = True


def _single(model, params, name: str, config_class, load):
    """(cfg, params) of one model file, or of ``(cfg, params)``."""
    if isinstance(model, config_class):
        if params is None:
            raise ValueError(f"{name}(cfg, params): a {config_class.__name__} needs its params.")
        return model, params
    if params is not None:
        raise ValueError(f"{name}(path): params come from the file; pass either a path or "
                         f"(cfg, params).")
    return load(str(model))


def _members(models, params, name: str, config_class, load):
    """(cfg, list of members' params) of committee files, or of ``(cfg,
    params)``; files of different architectures are refused by name."""
    if isinstance(models, config_class):
        if params is None:
            raise ValueError(f"{name}(cfg, params): a {config_class.__name__} needs the "
                             f"members' params.")
        return models, params
    if params is not None:
        raise ValueError(f"{name}(paths): params come from the files; pass either paths or "
                         f"(cfg, params).")
    loaded = [load(str(path)) for path in models]
    if not loaded:
        raise ValueError(f"{name}: no model files given.")
    cfg = loaded[0][0]
    for path, (c, _) in zip(models, loaded):
        if c != cfg:
            diff = [f for f in cfg.__dataclass_fields__ if getattr(c, f) != getattr(cfg, f)]
            raise ValueError(f"{str(path)!r} is a model of another architecture than "
                             f"{str(models[0])!r} (they differ in {diff}): a committee's "
                             f"members share one architecture.")
    return cfg, [p for _, p in loaded]


def check_atoms(atoms, want_stress: bool) -> None:
    """Refuse structures a calculator cannot evaluate: stress without a fully
    periodic cell (``PropertyNotImplementedError``), a periodic cell without
    volume, non-finite positions or cell (``ValueError``)."""
    pbc = np.asarray(atoms.pbc, bool)
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


def stress_of(atoms, virial, want_stress: bool):
    """The Voigt stress (eV/Angstrom^3) of a fully periodic cell from the
    virial (eV, stacked members give stacked stresses), None where there is
    none; ``PropertyNotImplementedError`` where one was asked for but the
    template ignores ``perturbation=``."""
    if np.all(atoms.pbc) and virial is not None:
        return full_3x3_to_voigt_6_stress(np.asarray(virial) / atoms.get_volume())
    if want_stress:
        raise PropertyNotImplementedError(
            "stress: the energy's derivative with respect to perturbation= is exactly zero, "
            "so the energy template ignores that keyword (or nothing in the cell interacts) "
            "and the stress is unknown. Pass energy_fn's keyword arguments on to the jax-md "
            "displacement function (displacement(Ra, Rb, **kwargs)), as "
            "chemtrain.models.pair does.")
    return None
