"""Models out of chemtrain: MACE exported back to mace-torch files (checked
with mace-torch's own MACECalculator), fine-tuned models exported, and the
error paths. (The ASE calculator is tested in test_calculator.py.)

MACE compiles slowly on CPU: every MACE structure here has N_ATOMS atoms
(mace_calc), so each model compiles once. The ``models`` fixture
(conftest.py) is shared with test_calculator.py.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mace_ref
from chemtrain.models import mace as cm
from mace_calc import N_ATOMS, cell, chemtrain_calc, load, molecule, rel, results, torch_calc

from paths import ROOT


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
    from chemtrain.trainers import ForceMatching, RunOptions
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
                       parallelism="single", checkpoint_path=str(tmp_path),
                       options=RunOptions(progress=False))
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
    # an existing file is not written over
    taken = tmp_path / "taken.model"
    taken.write_bytes(b"the user's file")
    with pytest.raises(FileExistsError, match="does not write over it.*overwrite=True"):
        cm.export_mace_torch(cfg, params, str(taken))
    assert taken.read_bytes() == b"the user's file"


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
