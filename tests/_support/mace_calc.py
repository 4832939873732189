"""MACE models and structures shared by the export tests (models/mace/test_export.py)
and the ASE calculator tests (test_calculator.py): random mace-torch models
with their conversions and exports, molecules and cells, chemtrain's and
mace-torch's calculators.

MACE compiles slowly on CPU: every MACE structure here has N_ATOMS atoms and
the calculators start with CAPACITY edge slots, so each model compiles once
(the capacity test adds one compilation on purpose).
"""
from __future__ import annotations

import ase
import numpy as np

import mace_ref
from chemtrain.calculator import ChemtrainCalculator
from chemtrain.models import mace as cm

N_ATOMS = 12
CAPACITY = 200


def load(path):
    return cm.load_mace_torch(path, trusted=True)


def model_cache(d):
    """name -> random mace-torch model file in the folder ``d``, its
    conversion and the export of the conversion (built on first use)."""
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
