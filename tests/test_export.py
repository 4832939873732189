"""Models out of chemtrain: MACE exported back to mace-torch files (checked
with mace-torch's own MACECalculator) and the ASE calculator (checked
against mace-torch, ASE's Lennard-Jones, finite differences and NVE
dynamics), with the error paths.

MACE compiles slowly on CPU: every MACE structure here has N_ATOMS atoms and
the calculators start with CAPACITY edge slots, so each model compiles once
(the capacity test adds one compilation on purpose).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import ase
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mace_ref
from chemtrain.calculator import ChemtrainCalculator
from chemtrain.models import mace as cm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
N_ATOMS = 12
CAPACITY = 200


def load(path):
    return cm.load_mace_torch(path, trusted=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> random mace-torch model file, its conversion and the export
    of the conversion (built on first use)."""
    d = tmp_path_factory.mktemp("export")
    cache = {}

    def get(name):
        if name not in cache:
            torch_model = mace_ref.build_torch_model(name)
            orig = mace_ref.save_torch_model(torch_model, str(d / f"{name}.model"))
            cfg, params = load(orig)
            exported = cm.export_mace_torch(cfg, params, str(d / f"{name}_exported.model"))
            cache[name] = dict(orig=orig, cfg=cfg, params=params, exported=exported,
                               state=torch_model.state_dict())
        return cache[name]
    return get


def molecule(seed=1):
    pos, Z = mace_ref.random_molecule(np.random.default_rng(seed), N_ATOMS)
    return ase.Atoms(numbers=Z, positions=pos)


def cell(seed=2, length=6.5):
    """A triclinic cell narrower than twice r_max (4 Angstrom): atoms see
    several images of one another."""
    pos, Z, c = mace_ref.random_cell(np.random.default_rng(seed), N_ATOMS, length=length)
    return ase.Atoms(numbers=Z, positions=pos, cell=c, pbc=True)


def chemtrain_calc(model, params=None, capacity=CAPACITY):
    return ChemtrainCalculator.from_mace(model["cfg"], model["params"] if params is None else params,
                                         capacity=capacity)


_TORCH_CALCS = {}


def torch_calc(path):
    from mace.calculators import MACECalculator
    if path not in _TORCH_CALCS:
        _TORCH_CALCS[path] = MACECalculator(model_paths=path, device="cpu", default_dtype="float64")
    return _TORCH_CALCS[path]


def results(atoms, calc, stress=False):
    a = atoms.copy()
    a.calc = calc
    out = [a.get_potential_energy(), a.get_forces()]
    return out + [a.get_stress()] if stress else out


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


# ------------------------------------------------------------------ export

@pytest.mark.parametrize("name", sorted(mace_ref.CONFIGS))
def test_import_export_import_is_identical(models, name):
    import torch
    from chemtrain.models.mace import torch_io
    m = models(name)
    exported = torch_io.read_torch_model(m["exported"], trusted=True)
    cfg2 = torch_io.config_from_torch(exported)
    params2 = torch_io.params_from_torch(exported, cfg2)
    assert cfg2 == m["cfg"]
    for a, b in zip(jax.tree.leaves(m["params"]), jax.tree.leaves(params2), strict=True):
        assert a.dtype == b.dtype == np.float64
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-12 * np.max(np.abs(a)))
    # every tensor but the symmetric-contraction weights (whose mace-torch
    # basis is redundant, so only their action is unique) is copied exactly
    orig, new = m["state"], exported.state_dict()
    assert set(orig) == set(new)
    for k in orig:
        if "symmetric_contractions" not in k or "U_matrix" in k:
            assert torch.equal(orig[k], new[k]), k


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


def finetune_data(calc, n, seed):
    """Molecules labelled by ``calc`` (nm, kJ/mol)."""
    rng = np.random.default_rng(seed)
    R, Z, U, F = [], [], [], []
    for _ in range(n):
        atoms = molecule(int(rng.integers(1 << 30)))
        E, f = results(atoms, calc)
        R.append(atoms.positions * 0.1)
        Z.append(atoms.numbers)
        U.append(E * cm.ENERGY_TO_KJ_PER_MOL)
        F.append(f * cm.ENERGY_TO_KJ_PER_MOL * 10)
    return {"R": np.stack(R), "species": np.stack(Z).astype(np.int32), "U": np.array(U),
            "F": np.stack(F)}


def test_finetuned_model_exports_and_matches(models, tmp_path):
    import optax
    from jax_md import partition, space
    from chemtrain.trainers import ForceMatching
    m = models("small")
    cfg, params = m["cfg"], m["params"]
    rng = np.random.default_rng(0)
    teacher = jax.tree.map(lambda x: x * (1 + 0.1 * rng.normal(size=x.shape)), params)
    data = finetune_data(chemtrain_calc(m, teacher), n=6, seed=3)
    disp, _ = space.free()
    nbrs = partition.neighbor_list(disp, 100.0, cfg.r_max * 0.1, format=partition.Sparse,
                                   disable_cell_list=True, capacity_multiplier=1.0).allocate(
        jnp.asarray(data["R"][0]), extra_capacity=N_ATOMS * (N_ATOMS - 1))
    tr = ForceMatching(params, optax.adam(3e-3), cm.energy_fn_template(cfg, disp), nbrs, batch=2,
                       parallelism="single", progress=False, checkpoint_path=str(tmp_path))
    tr.set_datasets(data, train_ratio=4 / 6, val_ratio=0.0)
    tr.train(1)
    assert tr.step == 2
    tuned = jax.tree.map(np.asarray, tr.params)
    moved = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                for a, b in zip(jax.tree.leaves(tuned), jax.tree.leaves(params)))
    assert moved > 1e-3

    path = cm.export_mace_torch(cfg, tuned, str(tmp_path / "tuned.model"))
    cfg2, params2 = load(path)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(tuned), jax.tree.leaves(params2), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-12 * np.max(np.abs(a)))
    for atoms in (molecule(5), cell(6)):
        E, F = results(atoms, chemtrain_calc(m, tuned))
        E_t, F_t = results(atoms, torch_calc(path))
        E_before, _ = results(atoms, torch_calc(m["orig"]))
        assert abs(E - E_t) <= 1e-6 * abs(E_t) and rel(F, F_t) <= 1e-6
        assert abs(E_t - E_before) > 1e-4   # the file holds the new weights


# ---------------------------------------------------------- the calculator

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


@pytest.mark.parametrize("fmt", ["sparse", "dense", "ordered_sparse"])
def test_template_calculator_matches_ase_lennard_jones(fmt):
    """chemtrain's Lennard-Jones template in a periodic cell against ASE's
    own Lennard-Jones (same smooth cutoff), and in free space."""
    from jax_md import space
    from chemtrain.models.pair import lennard_jones_template
    atoms = argon()
    disp, _ = space.periodic_general(jnp.asarray(atoms.cell.array.T * 0.1), fractional_coordinates=False)
    calc = ChemtrainCalculator(lennard_jones_template(disp, 0.85, 0.765), LJ, 0.85,
                               neighbor_format=fmt, capacity=2 if fmt == "dense" else None,
                               dtype="float64")
    ours, theirs = results(atoms, calc, stress=True), results(atoms, ase_lj(), stress=True)
    assert abs(ours[0] - theirs[0]) <= 1e-8 * abs(theirs[0])
    assert rel(ours[1], theirs[1]) <= 1e-8 and rel(ours[2], theirs[2]) <= 1e-8
    if fmt == "dense":
        assert calc.capacity > 2   # grew to the largest neighbor count
    free = ase.Atoms("Ar20", positions=np.random.default_rng(1).uniform(0, 9, (20, 3)))
    calc = ChemtrainCalculator(lennard_jones_template(space.free()[0], 0.85, 0.765), LJ, 0.85,
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


# ------------------------------------------------------------- bad input

def test_unsupported_configuration_is_refused(models, tmp_path):
    m = models("small")
    cfg, params = m["cfg"], m["params"]
    with pytest.raises(cm.UnsupportedModelError, match=r"act_constant: 1\.0 \(mace-torch would build 1\.6"):
        cm.export_mace_torch(dataclasses.replace(cfg, act_constant=1.0), params, str(tmp_path / "a.model"))
    # mace-torch puts the non-linear readout on the last layer only
    layers = (dataclasses.replace(cfg.layers[0], readout="nonlinear"), cfg.layers[1])
    bad = dataclasses.replace(cfg, layers=layers)
    with pytest.raises(cm.UnsupportedModelError, match=r"layers\[0\]\.readout: 'nonlinear'"):
        cm.export_mace_torch(bad, cm.init_params(bad, jax.random.PRNGKey(0), jnp.float64),
                             str(tmp_path / "b.model"))
    with pytest.raises(ValueError, match="params that belong to cfg"):
        cm.export_mace_torch(cfg, {**params, "embedding": params["embedding"][:2]},
                             str(tmp_path / "c.model"))
    assert not any(tmp_path.iterdir())   # nothing written


def test_unknown_element_is_refused(models):
    atoms = molecule()
    atoms.numbers[[2, 5]] = [9, 17]
    with pytest.raises(cm.UnknownElementError, match=r"9 \(F\), 17 \(Cl\).*\[1, 6, 7, 8\]"):
        results(atoms, chemtrain_calc(models("small")))


def test_missing_mace_torch_is_explained(models, tmp_path):
    m = models("small")
    npz = str(tmp_path / "small.npz")
    cm.save(npz, m["cfg"], m["params"])
    code = f"""
import sys
class NoTorch:  # 'import torch' and 'import mace' fail, as on a machine without the extra
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'mace'):
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, NoTorch())
import jax; jax.config.update('jax_enable_x64', True)
from chemtrain.models import mace as cm
from chemtrain.calculator import ChemtrainCalculator
cfg, params = cm.load({npz!r})
calc = ChemtrainCalculator.from_mace({npz!r})   # needs no torch
try:
    cm.export_mace_torch(cfg, params, {str(tmp_path / 'x.model')!r})
except ImportError as e:
    print('ERR', e)
assert 'torch' not in sys.modules
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ERR" in res.stdout and "pip install 'chemtrain[mace-torch]'" in res.stdout, res.stdout
    assert not os.path.exists(tmp_path / "x.model")
