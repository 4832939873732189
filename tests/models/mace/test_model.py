"""MACE in JAX against mace-torch (real models built and saved by
mace-torch, evaluated with its ASE calculator), padding, saving, fine-tuning
and the error paths."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_md import partition, space

import mace_ref
from chemtrain.models import mace as cm

from paths import ROOT, SUPPORT

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def torch_models(tmp_path_factory):
    """name -> path of a saved random mace-torch model, per dtype."""
    d = tmp_path_factory.mktemp("mace_models")
    cache = {}

    def get(name, dtype="float64"):
        if (name, dtype) not in cache:
            m = mace_ref.build_torch_model(name, dtype)
            cache[name, dtype] = mace_ref.save_torch_model(m, str(d / f"{name}_{dtype}.model"))
        return cache[name, dtype]
    return get


def structure(kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "molecule":
        pos, Z = mace_ref.random_molecule(rng)
        return pos, Z, None
    return mace_ref.random_cell(rng)


def jax_setup(cfg, pos, cell, dtype=jnp.float64, extra_capacity=0):
    """(displacement, neighbor list) in nm for a structure given in Angstrom."""
    R = jnp.asarray(pos * 0.1, jnp.float64)
    if cell is not None:
        box = jnp.asarray(cell.T * 0.1, dtype)
        disp, _ = space.periodic_general(box, fractional_coordinates=False)
        nf = partition.neighbor_list(space.periodic_general(box.astype(jnp.float64), fractional_coordinates=False)[0],
                                     box.astype(jnp.float64), cfg.r_max * 0.1,
                                     format=partition.Sparse, fractional_coordinates=False)
    else:
        disp, _ = space.free()
        nf = partition.neighbor_list(disp, 100.0, cfg.r_max * 0.1, format=partition.Sparse,
                                     disable_cell_list=True)
    return disp, nf.allocate(R, extra_capacity=extra_capacity)


def jax_energy_forces(cfg, params, pos, Z, cell, dtype=jnp.float64, **kw):
    """Energy (eV) and forces (eV/Angstrom) from the chemtrain energy function."""
    disp, nbrs = jax_setup(cfg, pos, cell, dtype)
    p = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    efn = cm.energy_fn_template(cfg, disp)(p)
    R = jnp.asarray(pos * 0.1, dtype)
    E, G = jax.jit(jax.value_and_grad(lambda r: efn(r, nbrs, species=jnp.asarray(Z), **kw)))(R)
    assert E.dtype == dtype
    return float(E) / cm.ENERGY_TO_KJ_PER_MOL, -np.asarray(G, np.float64) / cm.ENERGY_TO_KJ_PER_MOL / 10.0


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", sorted(mace_ref.CONFIGS))
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-6), ("float32", 1e-4)])
def test_matches_mace_torch(torch_models, name, dtype, tol):
    path = torch_models(name, dtype)
    cfg, params = cm.load_mace_torch(path, trusted=True)
    assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype(dtype)}
    e0 = dict(zip(cfg.atomic_numbers, cfg.atomic_energies))
    for kind, seed in (("molecule", 1), ("cell", 2)):
        pos, Z, cell = structure(kind, seed)
        E_t, F_t = mace_ref.torch_energy_forces(path, pos, Z, cell, dtype)
        E, F = jax_energy_forces(cfg, params, pos, Z, cell, getattr(jnp, dtype))
        inter_t = E_t - sum(e0[z] for z in Z)
        inter = E - sum(e0[z] for z in Z)
        assert abs(inter_t) > 1e-2 and np.max(np.abs(F_t)) > 1e-2  # the model does something
        assert abs(E - E_t) / abs(E_t) < tol, (kind, E, E_t)
        assert abs(inter - inter_t) / abs(inter_t) < tol, (kind, inter, inter_t)
        assert rel(F, F_t) < tol, (kind, rel(F, F_t))


def test_architecture_read_from_file(torch_models):
    cfg, _ = cm.load_mace_torch(torch_models("b3"), trusted=True)
    assert cfg.pair_repulsion and cfg.distance_transform == "Agnesi"
    assert [l.interaction for l in cfg.layers] == [
        "RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock"]
    cfg, _ = cm.load_mace_torch(torch_models("medium"), trusted=True)
    assert [l.correlation for l in cfg.layers] == [3, 3]
    assert cfg.layers[0].hidden_irreps == "8x0e+8x1o" and cfg.layers[1].hidden_irreps == "8x0e"


def test_file_from_older_mace_torch(torch_models, tmp_path):
    """Models pickled by older mace-torch releases lack attributes added
    since (edge_irreps, heads, apply_cutoff, ...); they convert the same."""
    import torch
    m = torch.load(torch_models("medium"), weights_only=False)
    for inter in m.interactions:
        del inter.edge_irreps
    for attr in ("heads", "use_agnostic_product", "use_so3", "use_last_readout_only"):
        delattr(m, attr)
    del m.radial_embedding.apply_cutoff
    path = str(tmp_path / "old.model")
    torch.save(m, path)
    cfg_old, params_old = cm.load_mace_torch(path, trusted=True)
    cfg, params = cm.load_mace_torch(torch_models("medium"), trusted=True)
    assert cfg_old == cfg
    for a, b in zip(jax.tree.leaves(params_old), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["molecule", "cell"])
def test_padding_changes_nothing(torch_models, kind):
    cfg, params = cm.load_mace_torch(torch_models("b3"), trusted=True)
    pos, Z, cell = structure(kind, 3)
    n, n_pad = len(Z), 5
    disp, nbrs = jax_setup(cfg, pos, cell)
    efn = cm.energy_fn_template(cfg, disp)(jax.tree.map(jnp.asarray, params))
    R = jnp.asarray(pos * 0.1)
    E, G = jax.jit(jax.value_and_grad(lambda r: efn(r, nbrs, species=jnp.asarray(Z))))(R)

    # padded atoms sit on real atoms' positions (worst case) with any species
    R_pad = jnp.concatenate([R, R[:n_pad]])
    Z_pad = np.concatenate([Z, np.full(n_pad, 8)])
    mask = np.arange(n + n_pad) < n
    _, nbrs_pad = jax_setup(cfg, np.asarray(R_pad) * 10, cell, extra_capacity=64)
    from chemtrain.learn.force_matching import mask_neighbors
    nbrs_pad = mask_neighbors(nbrs_pad, jnp.asarray(mask))
    assert nbrs_pad.idx.shape[1] > nbrs.idx.shape[1] + 64
    E2, G2 = jax.jit(jax.value_and_grad(lambda r: efn(r, nbrs_pad, species=jnp.asarray(Z_pad),
                                                      mask=jnp.asarray(mask))))(R_pad)
    assert abs(float(E2) - float(E)) <= 1e-9 * abs(float(E))
    np.testing.assert_allclose(np.asarray(G2[:n]), np.asarray(G), rtol=0, atol=1e-9 * np.abs(G).max())
    np.testing.assert_array_equal(np.asarray(G2[n:]), 0.0)
    # and the padding is not ignored by accident: unmasked it changes the energy
    E3 = jax.jit(lambda r: efn(r, nbrs_pad, species=jnp.asarray(Z_pad)))(R_pad)
    assert abs(float(E3) - float(E)) > 1e-3


def test_save_load_needs_no_torch(torch_models, tmp_path):
    cfg, params = cm.load_mace_torch(torch_models("medium"), trusted=True)
    out = str(tmp_path / "medium.npz")
    cm.save(out, cfg, params)
    pos, Z, cell = structure("cell", 4)
    E, F = jax_energy_forces(cfg, params, pos, Z, cell)
    np.savez(tmp_path / "s.npz", pos=pos, Z=Z, cell=cell)
    code = f"""
import sys
class NoTorch:  # make 'import torch' and 'import mace' fail, as on a machine without them
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'mace'):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoTorch())
sys.path[:0] = [{HERE!r}, {SUPPORT!r}]
import jax; jax.config.update('jax_enable_x64', True)
import numpy as np
from chemtrain.models import mace as cm
from test_model import jax_energy_forces
cfg, params = cm.load({out!r})
s = np.load({str(tmp_path / 's.npz')!r})
E, F = jax_energy_forces(cfg, params, s['pos'], s['Z'], s['cell'])
np.save({str(tmp_path / 'F.npy')!r}, F); print(repr(E))
assert 'torch' not in sys.modules
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert float(res.stdout.strip().splitlines()[-1]) == E
    np.testing.assert_array_equal(np.load(tmp_path / "F.npy"), F)


@pytest.mark.parametrize("shared_species", [False, True])
def test_parameter_gradient_of_a_batch_is_the_sum(torch_models, shared_species):
    """The trainers vmap the energy over structures; the gradient with respect
    to the parameters must be the sum of the single-structure gradients
    (cuequivariance-jax 0.13 gets this wrong for indexed inputs that are not
    batched: per-element weights, and the first layer's node features when
    the structures share their species, as DiffTRe's snapshots do)."""
    cfg, params = cm.load_mace_torch(torch_models("medium"), trusted=True)
    data, nbrs, template = finetune_data(cfg, n=3, seed=2)
    p = jax.tree.map(jnp.asarray, params)
    R, Z = jnp.asarray(data["R"]), jnp.asarray(data["species"])
    if shared_species:
        Z = jnp.broadcast_to(Z[0], Z.shape)

    def energy(p, r, z):
        return template(p)(r, nbrs.update(r), species=z)
    z_axis = None if shared_species else 0
    Zv = Z[0] if shared_species else Z
    batched = jax.jit(jax.grad(lambda p: jnp.sum(jax.vmap(energy, (None, 0, z_axis))(p, R, Zv))))(p)
    one = jax.jit(jax.grad(energy))
    summed = jax.tree.map(lambda *g: sum(g), *[one(p, R[k], Z[k]) for k in range(3)])
    for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(summed)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * float(jnp.max(jnp.abs(b))))


def test_predictor_on_neighbor_lists_evaluates_the_batch_as_one_graph(torch_models):
    """Force matching with a jax-md list: the batch goes through the
    template's batched energies (each structure's list updated, one disjoint
    graph) and gives the energies and forces of the vmapped single-structure
    energy function, with a padded atom masked in one structure."""
    import dataclasses
    from chemtrain.learn import force_matching as fm
    cfg, params = cm.load_mace_torch(torch_models("medium"), trusted=True)
    data, nbrs, template = finetune_data(cfg, n=3, seed=4)
    mask = np.ones(data["species"].shape, bool)
    mask[1, -1] = False
    kw = {"species": jnp.asarray(data["species"]), "mask": jnp.asarray(mask)}
    p, R = jax.tree.map(jnp.asarray, params), jnp.asarray(data["R"])
    assert template.batched is not None
    out = {}
    for name, t in (("batched", template), ("vmapped", dataclasses.replace(template, batched=None))):
        pred, err = jax.jit(fm.make_predictor(t, nbrs))(p, R, kw)
        assert not np.asarray(err).any()
        out[name] = pred
    F = np.asarray(out["vmapped"]["F"])
    assert np.abs(F[1, -1]).max() == 0 and np.abs(F).max() > 1.0
    np.testing.assert_allclose(out["batched"]["U"], out["vmapped"]["U"], rtol=1e-12)
    np.testing.assert_allclose(out["batched"]["F"], F, rtol=0, atol=1e-10 * np.abs(F).max())


def test_committee_gradient_of_the_batched_loss_is_each_members(torch_models):
    """A committee vmaps the force-matching loss over its members; the
    batched energies pass element and sender indices to cuequivariance-jax
    (vmap_safe=False), so under that vmap each member's gradient must still
    be its own loss gradient."""
    from chemtrain.learn import force_matching as fm
    cfg, params = cm.load_mace_torch(torch_models("medium"), trusted=True)
    data, nbrs, template = finetune_data(cfg, n=2, seed=5, teacher=(cfg, params))
    members = [cm.init_params(cfg, jax.random.PRNGKey(k), jnp.float64) for k in range(2)]
    batch = {k: jnp.asarray(v) for k, v in data.items()}
    batch["_valid"] = jnp.ones(2, bool)
    loss = fm.make_shard_loss(fm.make_predictor(template, nbrs), {"U": 1e-3, "F": 1.0}, {},
                              {"R", "U", "F", "_valid"})
    grad = jax.grad(lambda p: loss(p, batch)[0])
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *members)
    together = jax.jit(jax.vmap(grad))(stacked)
    for k, p in enumerate(members):
        one = jax.jit(grad)(p)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(together)):
            np.testing.assert_allclose(b[k], a, rtol=0, atol=1e-10 * float(jnp.max(jnp.abs(a))))


def test_random_init_is_rotation_invariant(torch_models):
    """A model built in JAX alone (init_params): energy invariant and forces
    equivariant under a rotation, and translation changes nothing."""
    cfg, _ = cm.load_mace_torch(torch_models("medium"), trusted=True)
    params = cm.init_params(cfg, jax.random.PRNGKey(0), jnp.float64)
    shapes = cm.param_shapes(cfg)
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(
        tuple, shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
    pos, Z, _ = structure("molecule", 6)
    Q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))
    if np.linalg.det(Q) < 0:
        Q = -Q
    E, F = jax_energy_forces(cfg, params, pos, Z, None)
    E2, F2 = jax_energy_forces(cfg, params, pos @ Q.T + np.array([0.3, -0.2, 0.1]), Z, None)
    assert np.isfinite(E) and np.max(np.abs(F)) > 1e-3
    assert abs(E2 - E) <= 1e-10 * abs(E)
    np.testing.assert_allclose(F2, F @ Q.T, atol=1e-10 * np.max(np.abs(F)))


# ---------------------------------------------------------------- errors

def test_not_a_model_file(tmp_path):
    bad = tmp_path / "notes.model"
    bad.write_text("this is not a model\n")
    with pytest.raises(ValueError, match="not a mace-torch model file"):
        cm.load_mace_torch(str(bad), trusted=True)
    import torch
    sd = tmp_path / "state.pt"
    torch.save({"w": torch.zeros(3)}, str(sd))
    with pytest.raises(ValueError, match="state dict"):
        cm.load_mace_torch(str(sd), trusted=True)
    other = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(2, 2), str(other))
    with pytest.raises(ValueError, match="Linear, not a mace-torch MACE model"):
        cm.load_mace_torch(str(other), trusted=True)
    with pytest.raises(FileNotFoundError):
        cm.load_mace_torch(str(tmp_path / "missing.model"), trusted=True)


def test_unsupported_variant_named(tmp_path):
    import torch
    from e3nn import o3
    from mace import modules
    torch.set_default_dtype(torch.float64)
    m = modules.ScaleShiftMACE(
        r_max=4.0, num_bessel=4, num_polynomial_cutoff=5, max_ell=1,
        interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        num_interactions=1, num_elements=2, hidden_irreps=o3.Irreps("4x0e"),
        MLP_irreps=o3.Irreps("4x0e"), atomic_energies=np.zeros(2), avg_num_neighbors=3.0,
        atomic_numbers=[1, 6], correlation=2, gate=torch.nn.functional.silu,
        radial_type="gaussian", atomic_inter_scale=1.0, atomic_inter_shift=0.0)
    path = str(tmp_path / "gauss.model")
    torch.save(m, path)
    with pytest.raises(cm.UnsupportedModelError, match="radial basis GaussianBasis"):
        cm.load_mace_torch(path, trusted=True)


def test_unknown_element_in_dataset(torch_models, tmp_path):
    import optax
    from chemtrain.trainers import ForceMatching, RunOptions
    cfg, params = cm.load_mace_torch(torch_models("small"), trusted=True)
    data, nbrs, template = finetune_data(cfg, n=8, seed=5)
    data["U"], data["F"] = np.zeros(8), np.zeros_like(data["R"])
    data["species"][3, 2] = 9  # fluorine: not one of H, C, N, O
    tr = ForceMatching(params, optax.adam(1e-3), template, nbrs, batch=2, parallelism="single",
                       checkpoint_path=str(tmp_path), options=RunOptions(progress=False))
    with pytest.raises(cm.UnknownElementError, match=r"atomic numbers 9 \(F\) .*\[1, 6, 7, 8\]"):
        tr.set_datasets(data, train_ratio=0.5)
    no_species = {k: v for k, v in data.items() if k != "species"}
    with pytest.raises(ValueError, match="needs per-atom atomic numbers"):
        tr.set_datasets(no_species, train_ratio=0.5)
    # a padded atom may carry any species
    data["mask"] = np.ones(data["species"].shape, bool)
    data["mask"][3, 2] = False
    cm.check_species(cfg, data["species"], data["mask"])
    # and at run time an unknown element gives NaN, which the trainer refuses
    efn = template(jax.tree.map(jnp.asarray, params))
    energy = jax.jit(lambda r, z: efn(r, nbrs, species=z))
    assert np.isnan(float(energy(jnp.asarray(data["R"][3]), jnp.asarray(data["species"][3]))))


def test_mace_torch_missing_is_explained(tmp_path):
    code = """
import sys
class NoMace:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'mace':
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoMace())
from chemtrain.models import mace as cm
try:
    cm.load_mace_torch('whatever.model', trusted=True)
except ImportError as e:
    print('ERR', e)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ERR" in res.stdout and "pip install 'chemtrain[mace-torch]'" in res.stdout


# ------------------------------------------------------------- fine-tuning

def finetune_data(cfg, n, seed, n_atoms=8, teacher=None):
    """Small molecules (H, C, O) labelled by a teacher MACE (another random
    mace-torch model, converted); returns (dataset in nm/kJ/mol, nbrs, template)."""
    rng = np.random.default_rng(seed)
    R, Zs = [], []
    for _ in range(n):
        pos, Z = mace_ref.random_molecule(rng, n_atoms, elements=[1, 6, 8], spacing=1.5,
                                          jitter=0.15)
        R.append(pos * 0.1)
        Zs.append(Z)
    R, Zs = np.stack(R), np.stack(Zs).astype(np.int32)
    disp, _ = space.free()
    nf = partition.neighbor_list(disp, 100.0, cfg.r_max * 0.1, format=partition.Sparse,
                                 disable_cell_list=True, capacity_multiplier=1.0)
    nbrs = nf.allocate(jnp.asarray(R[0]), extra_capacity=n_atoms * (n_atoms - 1))
    template = cm.energy_fn_template(cfg, disp)
    data = {"R": R, "species": Zs}
    if teacher is not None:
        t_cfg, t_params = teacher
        efn = cm.energy_fn_template(t_cfg, disp)(jax.tree.map(jnp.asarray, t_params))
        one = jax.jit(jax.value_and_grad(lambda r, z: efn(r, nbrs.update(r), species=z)))
        U, F = zip(*[one(jnp.asarray(r), jnp.asarray(z)) for r, z in zip(R, Zs)])
        data["U"] = np.asarray(U)
        data["F"] = -np.asarray(F)
    return data, nbrs, template


@pytest.fixture(scope="module")
def finetune_problem(tmp_path_factory):
    """A converted mace-torch model (default initialisation) and data from a
    'reference method' that differs from it: the same architecture with every
    weight changed by 5 % (random), standing in for a foundation model and the
    level of theory it is fine-tuned to. Loss weights make each target's
    initial training error 1."""
    model = mace_ref.build_torch_model("b3", symmetric_scale=1.0)
    path = mace_ref.save_torch_model(model, str(tmp_path_factory.mktemp("ft") / "student.model"))
    cfg, params = cm.load_mace_torch(path, trusted=True)
    rng = np.random.default_rng(3)
    teacher = jax.tree.map(lambda x: x * (1 + 0.05 * rng.normal(size=x.shape)), params)
    data, nbrs, template = finetune_data(cfg, n=24, seed=11, teacher=(cfg, teacher))
    start = finetune_data(cfg, n=24, seed=11, teacher=(cfg, params))[0]
    gammas = {k: float(1.0 / np.mean((data[k][:20] - start[k][:20]) ** 2)) for k in ("U", "F")}
    return cfg, params, data, nbrs, template, gammas


def finetune_trainer(problem, optimizer, parallelism, path, mesh=None):
    from chemtrain.trainers import ForceMatching, RunOptions
    cfg, params, data, nbrs, template, gammas = problem
    tr = ForceMatching(params, optimizer, template, nbrs, batch=4, parallelism=parallelism,
                       mesh=mesh, gammas=gammas, checkpoint_path=str(path),
                       options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=20 / 24, val_ratio=0.0)  # 5 steps per epoch, 4 unseen
    return tr


def test_finetune_lowers_unseen_loss(finetune_problem, tmp_path):
    import optax
    tr = finetune_trainer(finetune_problem, optax.adam(1e-3), "single", tmp_path)
    assert finetune_problem[4].check_vma is False
    before = tr.evaluate("testing")
    tr.train(6)
    after = tr.evaluate("testing")
    assert after["loss"] < 0.5 * before["loss"], (before, after)
    assert after["F"]["RMSE"] < before["F"]["RMSE"]


def test_finetune_single_equals_jax_on_two_devices(finetune_problem, tmp_path):
    import optax
    from jax.sharding import Mesh
    params = finetune_problem[1]
    # plain SGD: Adam divides by the gradient's running size, which turns
    # round-off in near-zero gradient entries into full-size steps
    single = finetune_trainer(finetune_problem, optax.sgd(1e-4), "single", tmp_path / "s")
    single.train(1)
    assert single.step == 5
    two = finetune_trainer(finetune_problem, optax.sgd(1e-4), "jax", tmp_path / "j",
                           mesh=Mesh(np.array(jax.devices()[:2]), ("data",)))
    assert two.strategy.n_shards == 2 and two.strategy.check_vma is False
    two.train(1)
    flat_s = jax.tree.leaves(jax.tree.map(np.asarray, single.params))
    flat_j = jax.tree.leaves(jax.tree.map(np.asarray, two.params))
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(flat_s, jax.tree.leaves(params))]
    assert max(moved) > 1e-5
    for a, b, p0 in zip(flat_s, flat_j, jax.tree.leaves(params)):
        # 1e-5 relative, of the parameter and of how far it moved
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-12)
        np.testing.assert_allclose(b - p0, a - p0, rtol=1e-5, atol=1e-12 + 1e-5 * np.max(np.abs(a - p0)))
