"""The ASE calculator (chemtrain.calculator.ChemtrainCalculator): MACE
checked against mace-torch's MACECalculator on the exported model, finite
differences and NVE dynamics; chemtrain's Lennard-Jones template against
ASE's Lennard-Jones; the error paths.

MACE compiles slowly on CPU: every MACE structure here has N_ATOMS atoms and
the calculators start with CAPACITY edge slots (mace_calc), so each model
compiles once (the capacity test adds one compilation on purpose). The
``models`` fixture (conftest.py) is shared with models/mace/test_export.py.
"""
from __future__ import annotations

import ase
import jax.numpy as jnp
import numpy as np
import pytest

import mace_ref
from chemtrain.calculator import ChemtrainCalculator
from chemtrain.models import mace as cm
from mace_calc import CAPACITY, cell, chemtrain_calc, molecule, rel, results, torch_calc


# ------------------------------------------------------------- MACE

@pytest.mark.parametrize("name", sorted(mace_ref.CONFIGS))
def test_mace_torch_calculator_matches_chemtrain(models, name):
    m = models(name)
    calc = chemtrain_calc(m)
    e0 = dict(zip(m["cfg"].atomic_numbers, m["cfg"].atomic_energies))
    for atoms in (molecule(), cell()):
        periodic = atoms.pbc.all()
        ours = results(atoms, calc, stress=periodic)
        theirs = results(atoms, torch_calc(m["exported"]), stress=periodic)
        inter = theirs[0] - sum(e0[z] for z in atoms.numbers)
        assert abs(inter) > 1e-2 and np.max(np.abs(theirs[1])) > 1e-2   # the model does something
        assert abs(ours[0] - theirs[0]) <= 1e-6 * abs(theirs[0])
        assert abs((ours[0] - theirs[0]) / inter) <= 1e-6
        assert rel(ours[1], theirs[1]) <= 1e-6
        if periodic:
            assert rel(ours[2], theirs[2]) <= 1e-6
    assert calc.capacity == CAPACITY   # nothing grew: one compiled function served both


def energy_at(calc, atoms, positions=None, cell_=None):
    a = atoms.copy()
    if cell_ is not None:
        a.set_cell(cell_, scale_atoms=True)
    if positions is not None:
        a.positions = positions
    a.calc = calc
    return a.get_potential_energy()


@pytest.mark.parametrize("kind", ["molecule", "cell"])
def test_forces_are_minus_the_energy_gradient(models, kind):
    atoms = molecule(7) if kind == "molecule" else cell(8)
    calc = chemtrain_calc(models("medium"))
    _, F = results(atoms, calc)
    h = 1e-4
    fd = np.zeros_like(F)
    for i in range(len(atoms)):
        for k in range(3):
            plus, minus = atoms.positions.copy(), atoms.positions.copy()
            plus[i, k] += h
            minus[i, k] -= h
            fd[i, k] = -(energy_at(calc, atoms, plus) - energy_at(calc, atoms, minus)) / (2 * h)
    assert np.max(np.abs(F)) > 0.1
    assert rel(F, fd) <= 1e-5, rel(F, fd)


def test_stress_is_the_strain_derivative(models):
    from ase.stress import full_3x3_to_voigt_6_stress
    atoms = cell(9)
    calc = chemtrain_calc(models("medium"))
    _, _, stress = results(atoms, calc, stress=True)
    h = 1e-5
    fd = np.zeros((3, 3))
    for a in range(3):
        for b in range(3):
            e = []
            for sign in (1, -1):
                eps = np.zeros((3, 3))
                eps[a, b] += sign * h / 2
                eps[b, a] += sign * h / 2
                e.append(energy_at(calc, atoms, cell_=atoms.cell.array @ (np.eye(3) + eps)))
            fd[a, b] = (e[0] - e[1]) / (2 * h) / atoms.get_volume()
    fd = full_3x3_to_voigt_6_stress(fd)
    assert np.max(np.abs(fd)) > 1e-3
    assert rel(stress, fd) <= 1e-5, (stress, fd)
    from ase.calculators.calculator import PropertyNotImplementedError
    with pytest.raises(PropertyNotImplementedError, match="stress needs a cell periodic in all three"):
        results(molecule(), calc, stress=True)


def test_nve_conserves_energy(models):
    from ase import units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary, ZeroRotation
    from ase.md.verlet import VelocityVerlet
    from ase.optimize import FIRE
    atoms = molecule(1)
    atoms.calc = chemtrain_calc(models("small"))
    FIRE(atoms, logfile=None).run(fmax=0.2, steps=300)   # random weights: start near a minimum
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    Stationary(atoms)
    ZeroRotation(atoms)
    start, traces = atoms.positions.copy(), atoms.calc.n_traces
    energies = []
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.attach(lambda: energies.append(atoms.get_total_energy()), interval=1)
    dyn.run(200)
    drift = np.max(np.abs(np.array(energies) - energies[0])) / len(atoms)
    assert len(energies) == 201
    assert np.max(np.linalg.norm(atoms.positions - start, axis=1)) > 0.05   # it moved
    assert drift < 1e-3, drift
    assert atoms.calc.n_traces == traces   # no recompilation during the run


def test_capacity_grows_and_stays_correct(models):
    m = models("small")
    calc = chemtrain_calc(m)
    loose, dense = cell(10), cell(10)
    dense.set_cell(dense.cell.array * 0.75, scale_atoms=True)   # more than CAPACITY edges
    E, F = results(loose, calc)
    traces = calc.n_traces
    assert calc.capacity == CAPACITY
    for atoms in (dense, loose):
        E, F = results(atoms, calc)
        E_t, F_t = results(atoms, torch_calc(m["exported"]))
        assert abs(E - E_t) <= 1e-6 * abs(E_t) and rel(F, F_t) <= 1e-6
    assert calc.capacity > CAPACITY
    assert calc.n_traces == traces + 1   # one more compilation, for the grown list


# ----------------------------------------------- generic chemtrain templates

def argon(seed=0, length=18.0):
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(5)] * 3, indexing="ij"), -1).reshape(-1, 3) / 5
    c = np.diag([length, length * 1.02, length * 0.98]) + rng.uniform(-0.5, 0.5, (3, 3)) * (1 - np.eye(3))
    pos = (grid + rng.uniform(-0.02, 0.02, grid.shape)) @ c
    return ase.Atoms(f"Ar{len(pos)}", positions=pos, cell=c, pbc=True)


def ase_lj():
    from ase.calculators.lj import LennardJones
    return LennardJones(sigma=3.4, epsilon=1 / cm.ENERGY_TO_KJ_PER_MOL, rc=8.5, ro=7.65, smooth=True)


LJ = {"sigma": 0.34, "epsilon": 1.0}   # nm, kJ/mol


@pytest.mark.parametrize("fmt", ["sparse", "dense", "ordered_sparse", "all_pairs"])
def test_template_calculator_matches_ase_lennard_jones(fmt):
    """chemtrain's Lennard-Jones template in a periodic cell against ASE's
    own Lennard-Jones (same smooth cutoff), and in free space; ``all_pairs``:
    the template's sum over all pairs, which ignores the (dense) list."""
    from jax_md import space
    from chemtrain.models.pair import lennard_jones_template
    atoms = argon()
    disp, _ = space.periodic_general(jnp.asarray(atoms.cell.array.T * 0.1), fractional_coordinates=False)
    all_pairs = fmt == "all_pairs"
    fmt = "dense" if all_pairs else fmt
    calc = ChemtrainCalculator(lennard_jones_template(disp, 0.85, 0.765, all_pairs=all_pairs), LJ,
                               0.85, neighbor_format=fmt, capacity=2 if fmt == "dense" else None,
                               dtype="float64")
    ours, theirs = results(atoms, calc, stress=True), results(atoms, ase_lj(), stress=True)
    assert abs(ours[0] - theirs[0]) <= 1e-8 * abs(theirs[0])
    assert rel(ours[1], theirs[1]) <= 1e-8 and rel(ours[2], theirs[2]) <= 1e-8
    if fmt == "dense":
        assert calc.capacity > 2   # grew to the largest neighbor count
    free = ase.Atoms("Ar20", positions=np.random.default_rng(1).uniform(0, 9, (20, 3)))
    calc = ChemtrainCalculator(lennard_jones_template(space.free()[0], 0.85, 0.765,
                                                      all_pairs=all_pairs), LJ, 0.85,
                               neighbor_format=fmt, dtype="float64")
    ours, theirs = results(free, calc), results(free, ase_lj())
    assert abs(ours[0] - theirs[0]) <= 1e-8 * abs(theirs[0]) and rel(ours[1], theirs[1]) <= 1e-8


def test_template_calculator_refuses_what_it_cannot_do():
    from jax_md import space
    from chemtrain.models.pair import lennard_jones_template
    atoms = argon()
    free_template = lennard_jones_template(space.free()[0], 0.85, 0.765)
    calc = ChemtrainCalculator(free_template, LJ, 0.85, dtype="float64")
    with pytest.raises(ValueError, match="not periodic in the cell it is given.*periodic_general"):
        results(atoms, calc)
    small = argon(length=15.0)
    with pytest.raises(ValueError, match="narrower than twice the cutoff.*atoms.repeat"):
        results(small, calc)
    small.pbc = [True, True, False]
    with pytest.raises(ValueError, match=r"pbc \[True, True, False\]"):
        results(small, calc)
    with pytest.raises(ValueError, match="neighbor_format must be one of"):
        ChemtrainCalculator(free_template, LJ, 0.85, neighbor_format="csr")
    with pytest.raises(ValueError, match="growth must be > 1"):
        ChemtrainCalculator(free_template, LJ, 0.85, growth=1.0)
    # a NaN position gives no energy (it gave a finite energy and NaN forces)
    broken = argon()
    positions = broken.get_positions()
    positions[3, 1] = np.nan
    broken.set_positions(positions)
    disp, _ = space.periodic_general(jnp.asarray(broken.cell.array.T * 0.1),
                                     fractional_coordinates=False)
    periodic = ChemtrainCalculator(lennard_jones_template(disp, 0.85, 0.765), LJ, 0.85,
                                   dtype="float64")
    with pytest.raises(ValueError, match=r"Atom\(s\) \[3\] have non-finite positions"):
        results(broken, periodic)


# ------------------------------------------------------------- bad input

def test_unknown_element_is_refused(models):
    atoms = molecule()
    atoms.numbers[[2, 5]] = [9, 17]
    with pytest.raises(cm.UnknownElementError, match=r"9 \(F\), 17 \(Cl\).*\[1, 6, 7, 8\]"):
        results(atoms, chemtrain_calc(models("small")))


# ------------------------------------------------------------- committees

def _members_of(calc_for, params_list, atoms, stress=False):
    """Each member's energy, forces (and stress) from its own calculator."""
    out = [results(atoms, calc_for(p), stress=stress) for p in params_list]
    return [np.array([o[i] for o in out]) for i in range(len(out[0]))]


def test_committee_of_templates_equals_numpy_over_its_members():
    """A committee of three Lennard-Jones parameter sets in one vectorised
    call: mean and spread of energy, forces and stress equal numpy's over the
    three single calculators."""
    from jax_md import space
    from chemtrain.calculator import CommitteeCalculator
    from chemtrain.models.pair import lennard_jones_template
    atoms = argon()
    disp, _ = space.periodic_general(jnp.asarray(atoms.cell.array.T * 0.1),
                                     fractional_coordinates=False)
    template = lennard_jones_template(disp, 0.85, 0.765)
    members = [{"sigma": s, "epsilon": e} for s, e in ((0.34, 1.0), (0.33, 1.1), (0.35, 0.9))]
    E, F, S = _members_of(lambda p: ChemtrainCalculator(template, p, 0.85, dtype="float64"),
                          members, atoms, stress=True)
    committee = CommitteeCalculator(template, members, 0.85, dtype="float64")
    a = atoms.copy()
    a.calc = committee
    a.get_stress()
    r = committee.results
    np.testing.assert_allclose(r["energy"], E.mean(), rtol=1e-12)
    np.testing.assert_allclose(r["energy_std"], E.std(), rtol=1e-10)
    np.testing.assert_allclose(r["forces"], F.mean(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(r["forces_std"], np.sqrt(F.var(0).sum(-1)), rtol=1e-10,
                               atol=1e-14)
    np.testing.assert_allclose(r["stress"], S.mean(0), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(r["stress_std"], S.std(0), rtol=1e-9, atol=1e-14)
    assert committee.n_members == 3 and r["member_forces"].shape == (3, len(atoms), 3)
    with pytest.raises(ValueError, match="at least 2 members, got 1"):
        CommitteeCalculator(template, members[:1], 0.85, dtype="float64")


def test_committee_of_mace_files(models, tmp_path):
    """MACE members from files: one vectorised call equals each member's own
    calculator; a file of another architecture is refused by name."""
    from chemtrain.calculator import CommitteeCalculator
    m = models("small")
    members = [m["params"], *[jax_scaled(m["params"], f) for f in (0.9, 1.1)]]
    paths = []
    for k, p in enumerate(members):
        paths.append(str(tmp_path / f"m_member{k}.npz"))
        cm.save(paths[-1], m["cfg"], p)
    atoms = cell()
    E, F = _members_of(lambda p: chemtrain_calc(m, p), members, atoms)
    committee = CommitteeCalculator.from_mace(paths, capacity=CAPACITY)
    a = atoms.copy()
    a.calc = committee
    a.get_forces()
    r = committee.results
    np.testing.assert_allclose(r["energy_std"], E.std(), rtol=1e-6)
    np.testing.assert_allclose(r["forces_std"], np.sqrt(F.var(0).sum(-1)), rtol=1e-6,
                               atol=1e-9)
    other = str(tmp_path / "other.npz")
    cm.save(other, models("medium")["cfg"], models("medium")["params"])
    with pytest.raises(ValueError, match=r"other.npz' is a model of another architecture than "
                                         r".*m_member0.npz"):
        CommitteeCalculator.from_mace([paths[0], other])


def jax_scaled(params, factor):
    """Parameters with every leaf scaled (another member of the same shapes)."""
    import jax
    return jax.tree.map(lambda x: np.asarray(x) * factor, params)
