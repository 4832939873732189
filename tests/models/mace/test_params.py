"""``init_params`` draws what mace-torch draws: the parameters of a freshly
built random ``ScaleShiftMACE`` (mace-torch's own code, e3nn layers),
converted with ``load_mace_torch``, have the same spread leaf by leaf, and a
random model's forces are of the same size as mace-torch's."""
from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_md import partition, space

import mace_ref
from chemtrain.models import mace as cm
from chemtrain.models.mace import model as M
from chemtrain.models.mace import params as mace_params
from chemtrain.models.mace import torch_io

from paths import BENCHMARKS

CONFIGS = {
    # MACE-MP's architecture as examples/mace_jax/finetune_md22.py builds it
    # (mace_mp_config: scalar hidden features, two residual blocks, non-linear
    # last readout) at 8 channels, L_max 1, correlation 2
    "mp": dict(hidden="8x0e", max_ell=1, num_interactions=2, correlation=2,
               first=M.RESIDUAL, pair=False, transform="None"),
    # L_max 2, correlation 3, vector hidden features, plain first block
    "l2": dict(hidden="16x0e+16x1o", max_ell=2, num_interactions=2, correlation=3,
               first=M.PLAIN, pair=False, transform="None"),
}
# the smallest leaves (the first readout, (channels, 1)) hold 8 and 16
# numbers: pool several models per side, so that every leaf's std rests on
# at least 48 torch numbers (sampling error of the ratio about 10 %)
TORCH_SEEDS = {"mp": 6, "l2": 3}
JAX_SEEDS = 24
FACTOR = 1.5


@pytest.fixture(scope="module")
def torch_models(tmp_path_factory):
    """(name, seed) -> (saved model path, config, converted params, model)."""
    d = tmp_path_factory.mktemp("mace_init")
    cache = {}

    def get(name, seed):
        if (name, seed) not in cache:
            # symmetric_scale=1: mace-torch's own initialisation, untouched
            m = mace_ref.build_torch_model(name, seed=seed, symmetric_scale=1.0,
                                           config=CONFIGS[name])
            path = mace_ref.save_torch_model(m, str(d / f"{name}_{seed}.model"))
            cfg, params = cm.load_mace_torch(path, trusted=True)
            cache[name, seed] = path, cfg, params, m
        return cache[name, seed]
    return get


def _leaves(tree):
    return [(jax.tree_util.keystr(k), np.asarray(v, np.float64))
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _pooled_std(trees):
    """Per leaf: the std of all its numbers in all ``trees`` together."""
    per_tree = [_leaves(t) for t in trees]
    return {name: float(np.std(np.concatenate([lv[i][1].ravel() for lv in per_tree])))
            for i, (name, _) in enumerate(per_tree[0])}


def _jax_trees(cfg, n):
    return [cm.init_params(cfg, jax.random.PRNGKey(s), jnp.float64) for s in range(n)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_leaf_spread_matches_mace_torch(torch_models, name):
    """Every leaf's std within a factor 1.5 of the converted mace-torch
    model's; each symmetric-contraction path's too (the leaf mixes paths of
    very different scales). No leaf is skipped: none is constant (no zero-size
    or deterministic leaf in these configurations)."""
    runs = [torch_models(name, s) for s in range(TORCH_SEEDS[name])]
    cfg = runs[0][1]
    torch_trees = [r[2] for r in runs]
    jax_trees = _jax_trees(cfg, JAX_SEEDS)
    std_t, std_j = _pooled_std(torch_trees), _pooled_std(jax_trees)
    assert std_t.keys() == std_j.keys()
    off = {}
    for leaf in std_t:
        assert std_t[leaf] > 0 and std_j[leaf] > 0, leaf
        ratio = std_j[leaf] / std_t[leaf]
        if not 1 / FACTOR < ratio < FACTOR:
            off[leaf] = (round(std_j[leaf], 4), round(std_t[leaf], 4), round(ratio, 3))
    assert not off, f"leaf: (init std, mace-torch std, ratio): {off}"

    for t, layer in enumerate(cfg.layers):
        n_cue = M.symmetric_descriptor(
            "+".join(f"1x{ir}" for _, ir in M.irreps(layer.target_irreps)),
            "+".join(f"1x{ir}" for _, ir in M.irreps(layer.hidden_irreps)),
            layer.correlation).inputs[0].size

        def per_path(trees):      # (elements, paths * channels), path-major
            w = np.stack([np.asarray(p["products"][t]["symmetric"]) for p in trees])
            return w.reshape(*w.shape[:2], n_cue, -1).std(axis=(0, 1, 3))
        ratio = per_path(jax_trees) / per_path(torch_trees)
        assert np.all((1 / FACTOR < ratio) & (ratio < FACTOR)), (t, np.round(ratio, 3))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_symmetric_covariance_is_mace_torch(torch_models, name):
    """The covariance of the symmetric-contraction weights across
    cuequivariance's paths, exactly: mace-torch draws its weights per output
    irrep and degree as randn / K (K: basis size, the last axis of its
    ``U_matrix``); the converter maps them linearly (P) onto the paths."""
    _, cfg, _, m = torch_models(name, 0)
    for t, layer in enumerate(cfg.layers):
        A_c, A_m, blocks, _ = torch_io.contraction_bases(m.products[t].symmetric_contractions, layer)
        P, *_ = np.linalg.lstsq(A_c, A_m, rcond=None)
        K = np.concatenate([[U.shape[-1]] * U.shape[-1] for *_, U in blocks])
        cov_torch = (P / K ** 2) @ P.T
        L = mace_params.symmetric_init_map(layer.target_irreps, layer.hidden_irreps, layer.correlation)
        np.testing.assert_allclose(L @ L.T, cov_torch, atol=1e-10 * np.abs(cov_torch).max())


def _nanotube():
    spec = importlib.util.spec_from_file_location("mace_vs_torch", os.path.join(BENCHMARKS, "mace_vs_torch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.nanotube()


def test_random_forces_as_large_as_mace_torch(torch_models):
    """RMS force of random models on the 370-atom nanotube (C, H), mace-torch's
    evaluated by mace-torch's ASE calculator: the same order (geometric means
    over seeds within a factor 3). One model's RMS force varies a lot from
    seed to seed (0.015-0.37 eV/A here, log-std about 0.7), hence 8 torch
    and 32 JAX seeds: the log of the ratio then has a sampling std of about
    0.28, against log 3 = 1.1."""
    atoms = _nanotube()
    pos, Z = atoms.positions, atoms.numbers
    runs = [torch_models("mp", s) for s in range(8)]
    cfg = runs[0][1]
    rms_t = [np.sqrt(np.mean(mace_ref.torch_energy_forces(r[0], pos, Z)[1] ** 2)) for r in runs]

    disp, _ = space.free()
    R = jnp.asarray(pos * 0.1)
    nbrs = partition.neighbor_list(disp, 100.0, cfg.r_max * 0.1, format=partition.Sparse,
                                   disable_cell_list=True).allocate(R)
    template = cm.energy_fn_template(cfg, disp)
    grad = jax.jit(jax.grad(lambda p, r: template(p)(r, nbrs, species=jnp.asarray(Z)), argnums=1))
    rms_j = [np.sqrt(np.mean((np.asarray(grad(p, R)) / cm.ENERGY_TO_KJ_PER_MOL / 10.0) ** 2))
             for p in _jax_trees(cfg, 32)]
    geo = lambda x: float(np.exp(np.mean(np.log(x))))
    ratio = geo(rms_j) / geo(rms_t)
    print(f"RMS force (eV/A), geometric mean (mean) over seeds: init_params {geo(rms_j):.4f} "
          f"({np.mean(rms_j):.4f}), mace-torch {geo(rms_t):.4f} ({np.mean(rms_t):.4f}), ratio {ratio:.3f}")
    assert 1 / 3 < ratio < 3, (rms_j, rms_t)
