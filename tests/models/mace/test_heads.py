"""Multi-head MACE (mace-torch's layout) against mace-torch: a random
multi-head ``ScaleShiftMACE`` read by load_mace_torch, our multi-head models
exported and evaluated by mace-torch's MACECalculator(head=...), add_head and
select_head (the latter also against mace-torch's own remove_pt_head), the
configuration's JSON and the error paths.

Every structure has N_ATOMS atoms and one graph capacity, and the head is a
traced argument, so each configuration compiles once. Float64 (conftest.py).
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mace_ref
from chemtrain.models import mace as cm
from chemtrain.neighbors import precompute_graphs
from chemtrain.neighbors.edges import Graph

N_ATOMS = 8
TINY = dict(hidden="8x0e+8x1o", max_ell=1, num_interactions=2, correlation=2,
            first="RealAgnosticResidualInteractionBlock", pair=True, transform="None")
HEADS = ("pt_head", "water")
E0S = np.array([[-13.6, -1030.0, -1485.0, -2040.0], [-10.0, -900.0, -1400.0, -2100.0]]) / 100
SCALES, SHIFTS = [1.3, 0.7], [-0.05, 0.2]
TOL = 1e-5


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A random 2-head mace-torch model (linear and nonlinear readouts, ZBL),
    its file and its conversion."""
    d = tmp_path_factory.mktemp("mace_heads")
    model = mace_ref.build_torch_model("tiny", config=TINY, heads=list(HEADS), atomic_energies=E0S,
                                       scale=SCALES, shift=SHIFTS, mlp_irreps="4x0e",
                                       radial_mlp=(8,))
    path = mace_ref.save_torch_model(model, str(d / "two_heads.model"))
    cfg, params = cm.load_mace_torch(path, trusted=True)
    return dict(model=model, path=path, cfg=cfg, params=params, dir=d)


@pytest.fixture(scope="module")
def structures():
    rng = np.random.default_rng(0)
    mols = [mace_ref.random_molecule(rng, N_ATOMS) for _ in range(3)]
    R = np.stack([p for p, _ in mols])
    Z = np.stack([z for _, z in mols]).astype(np.int32)
    graphs = precompute_graphs(R * 0.1, cutoff=0.4, capacity=N_ATOMS * (N_ATOMS - 1))
    return dict(R=R, Z=Z, **graphs)


_COMPILED = {}


def ours(cfg, params, s, heads):
    """Energies (eV) and forces (eV/Angstrom) of every structure for each head
    index in ``heads``: the energy function vmapped over (structure, head)
    pairs, as a trainer passes a dataset's 'head' column."""
    if cfg not in _COMPILED:
        template = cm.energy_fn_template(cfg)

        def one(p, r, z, snd, rcv, sh, h):
            return jax.value_and_grad(
                lambda r: template(p)(r, Graph(snd, rcv, sh), species=z, head=h))(r)
        _COMPILED[cfg] = jax.jit(jax.vmap(one, (None, 0, 0, 0, 0, 0, 0)))
    n = len(s["R"])
    i = np.repeat(np.arange(n), len(heads))
    h = np.tile(np.asarray(heads, np.int32), n)
    E, G = _COMPILED[cfg](jax.tree.map(jnp.asarray, params), jnp.asarray(s["R"][i] * 0.1),
                          jnp.asarray(s["Z"][i]), *(jnp.asarray(s[k][i]) for k in
                                                     ("senders", "receivers", "shifts")),
                          jnp.asarray(h))
    E = np.asarray(E).reshape(n, len(heads)) / cm.ENERGY_TO_KJ_PER_MOL
    F = -np.asarray(G).reshape(n, len(heads), N_ATOMS, 3) / cm.ENERGY_TO_KJ_PER_MOL / 10.0
    return E, F


_CALCS = {}


def reference(path, head, s):
    """Energies and forces from mace-torch's MACECalculator with ``head=``."""
    import ase
    from mace.calculators import MACECalculator
    if (path, head) not in _CALCS:
        _CALCS[path, head] = MACECalculator(model_paths=path, device="cpu", default_dtype="float64",
                                            head=head)
    out = []
    for R, Z in zip(s["R"], s["Z"]):
        atoms = ase.Atoms(numbers=Z, positions=R)
        atoms.calc = _CALCS[path, head]
        out.append((atoms.get_potential_energy(), atoms.get_forces()))
    return np.array([e for e, _ in out]), np.stack([f for _, f in out])


def e0_sum(e0_row, s, cfg):
    table = dict(zip(cfg.atomic_numbers, e0_row))
    return np.array([sum(table[int(z)] for z in Z) for Z in s["Z"]])


def assert_head_matches(E, F, E_ref, F_ref, e0):
    """Interaction energies (E0s subtracted, so the comparison is not
    swamped by them) and forces to TOL, relative."""
    inter, inter_ref = E - e0, E_ref - e0
    assert np.max(np.abs(inter - inter_ref)) <= TOL * np.max(np.abs(inter_ref))
    assert np.max(np.abs(F - F_ref)) <= TOL * np.max(np.abs(F_ref))


def assert_tree_close(a, b, rtol=1e-12):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                                   atol=rtol * max(np.max(np.abs(np.asarray(y))), 1e-300))


# ------------------------------------------------------------------ mace-torch -> chemtrain

def test_loaded_multihead_model_matches_mace_torch(ref, structures):
    cfg, params = ref["cfg"], ref["params"]
    assert cfg.heads == HEADS and cfg.num_heads == 2
    np.testing.assert_allclose(cfg.atomic_energies_per_head(), E0S, rtol=1e-15)
    assert cfg.scale == tuple(SCALES) and cfg.shift == tuple(SHIFTS)
    assert cfg.mlp_irreps == "4x0e"   # per head, as mace-torch's MLP_irreps
    assert [jax.tree.map(np.shape, r) for r in params["readouts"]] == [
        {"linear": [(8, 2)]}, {"linear_1": [(8, 8)], "linear_2": [(8, 2)]}]
    E, F = ours(cfg, params, structures, [0, 1])
    for h, name in enumerate(HEADS):
        E_t, F_t = reference(ref["path"], name, structures)
        assert_head_matches(E[:, h], F[:, h], E_t, F_t, e0_sum(E0S[h], structures, cfg))
    # the heads differ (E0s, scale, shift and readout), so each was really picked
    assert np.max(np.abs(F[:, 0] - F[:, 1])) > 0.1 * np.max(np.abs(F[:, 0]))


def test_head_out_of_range_in_traced_code_is_nan(ref, structures):
    E, _ = ours(ref["cfg"], ref["params"], structures, [1, 2])
    assert np.all(np.isfinite(E[:, 0])) and np.all(np.isnan(E[:, 1]))


def test_batch_of_mixed_heads_as_one_graph_matches_mace_torch(ref, structures):
    """The force-matching predictor evaluates a batch on graphs as one
    disjoint graph (the template's ``batched``), each structure with its own
    head; a head out of range makes only its structure's energy NaN."""
    from chemtrain.learn import force_matching as fm
    cfg, params = ref["cfg"], ref["params"]
    template = cm.energy_fn_template(cfg)
    assert template.batched is not None
    predict = jax.jit(fm.make_predictor(template, None))
    heads = np.array([1, 0, 1], np.int32)
    kw = {"species": jnp.asarray(structures["Z"]), "head": jnp.asarray(heads),
          **{k: jnp.asarray(structures[k]) for k in ("senders", "receivers", "shifts")}}
    R = jnp.asarray(structures["R"] * 0.1)
    pred, err = predict(jax.tree.map(jnp.asarray, params), R, kw)
    assert not np.asarray(err).any()
    E = np.asarray(pred["U"]) / cm.ENERGY_TO_KJ_PER_MOL
    F = np.asarray(pred["F"]) / cm.ENERGY_TO_KJ_PER_MOL / 10.0
    refs = [reference(ref["path"], name, structures) for name in HEADS]
    for k, h in enumerate(heads):
        one = {key: v[k:k + 1] for key, v in structures.items()}
        assert_head_matches(E[k:k + 1], F[k:k + 1], refs[h][0][k:k + 1], refs[h][1][k:k + 1],
                            e0_sum(E0S[h], one, cfg))
    kw["head"] = jnp.asarray([0, 2, 1], jnp.int32)
    pred, _ = predict(jax.tree.map(jnp.asarray, params), R, kw)
    assert np.isnan(pred["U"][1]) and np.all(np.isfinite(np.asarray(pred["U"])[[0, 2]]))


# ------------------------------------------------------------------ chemtrain -> mace-torch

def test_exported_multihead_model_matches(ref, structures, tmp_path):
    import torch
    cfg = ref["cfg"]
    params = cm.init_params(cfg, jax.random.PRNGKey(1), jnp.float64)
    path = cm.export_mace_torch(cfg, params, str(tmp_path / "ours.model"))
    model = torch.load(path, weights_only=False)
    assert list(model.heads) == list(HEADS)
    cfg2, params2 = cm.load_mace_torch(path, trusted=True)
    assert cfg2 == cfg
    assert_tree_close(params2, jax.tree.map(np.asarray, params))
    E, F = ours(cfg, params, structures, [0, 1])
    for h, name in enumerate(HEADS):
        E_t, F_t = reference(path, name, structures)
        assert_head_matches(E[:, h], F[:, h], E_t, F_t, e0_sum(E0S[h], structures, cfg))


def test_add_head_copies_a_head(ref, structures, tmp_path):
    cfg, params = ref["cfg"], ref["params"]
    cfg3, params3 = cm.add_head(cfg, params, "new", copy_from="water")
    assert cfg3.heads == HEADS + ("new",)
    np.testing.assert_array_equal(cfg3.atomic_energies_per_head()[2], cfg.atomic_energies_per_head()[1])
    assert cfg3.scale[2] == SCALES[1] and cfg3.shift[2] == SHIFTS[1]
    E, F = ours(cfg3, params3, structures, [0, 1, 2])
    refs = [reference(ref["path"], name, structures) for name in HEADS]
    for h, (E_t, F_t) in zip((0, 1, 2), refs + [refs[1]]):   # the new head is "water"'s copy
        assert_head_matches(E[:, h], F[:, h], E_t, F_t,
                            e0_sum(cfg3.atomic_energies_per_head()[h], structures, cfg))
    # mace-torch evaluates the three heads of the exported model the same way
    path = cm.export_mace_torch(cfg3, params3, str(tmp_path / "three.model"))
    E_t, F_t = reference(path, "new", structures)
    assert_head_matches(E[:, 2], F[:, 2], E_t, F_t, e0_sum(E0S[1], structures, cfg))
    # E0s of the new head: the given elements change, the others are the copied head's
    cfg_e, params_e = cm.add_head(cfg, params, "new", copy_from=1, e0s={1: -1.0, 8: -5.0})
    np.testing.assert_array_equal(cfg_e.atomic_energies_per_head()[2], [-1.0, E0S[1, 1], E0S[1, 2], -5.0])
    assert_tree_close(params_e, params3, rtol=0)
    # keeping the added head gives back the head it copied (up to round-off)
    _, back = cm.select_head(cfg3, params3, "new")
    assert_tree_close(back, cm.select_head(cfg, params, "water")[1])


def test_select_head_matches_mace_torch(ref, structures):
    from mace.tools.scripts_utils import remove_pt_head
    from chemtrain.models.mace import torch_io
    cfg, params = ref["cfg"], ref["params"]
    cfg1, params1 = cm.select_head(cfg, params, "water")
    assert cfg1.heads == ("water",) and cfg1.scale == SCALES[1] and cfg1.shift == SHIFTS[1]
    assert cfg1.atomic_energies == tuple(E0S[1])
    # mace-torch's own head selection gives the same single-head model
    single = remove_pt_head(ref["model"], "water")
    cfg_t = torch_io.config_from_torch(single)
    assert cfg_t == cfg1
    assert_tree_close(params1, torch_io.params_from_torch(single, cfg_t))
    # and its energies are those of mace-torch's head
    E, F = ours(cfg1, params1, structures, [0])
    E_t, F_t = reference(ref["path"], "water", structures)
    assert_head_matches(E[:, 0], F[:, 0], E_t, F_t, e0_sum(E0S[1], structures, cfg))
    same = cm.select_head(cfg1, params1, "water")
    assert same[0] is cfg1 and same[1] is params1


# ------------------------------------------------------------------ configuration, files

def test_single_head_layout_and_json_unchanged(ref, tmp_path):
    cfg, params = cm.select_head(ref["cfg"], ref["params"], "pt_head")
    cfg = dataclasses.replace(cfg, heads=("Default",))
    text = cfg.to_json()
    assert "heads" not in json.loads(text)   # as chemtrain wrote it before heads
    assert cm.config_from_json(text) == cfg and cm.MaceConfig.from_json(text) == cfg
    assert [jax.tree.map(np.shape, r) for r in params["readouts"]] == [
        {"linear": [(8, 1)]}, {"linear_1": [(8, 4)], "linear_2": [(4, 1)]}]
    renamed = dataclasses.replace(cfg, heads=("pt_head",))
    assert cm.config_from_json(renamed.to_json()) == renamed
    # a multi-head model saves and loads
    cm.save(str(tmp_path / "two.npz"), ref["cfg"], ref["params"])
    cfg2, params2 = cm.load(str(tmp_path / "two.npz"))
    assert cfg2 == ref["cfg"] and json.loads(cfg2.to_json())["heads"] == list(HEADS)
    assert cm.MaceConfig.from_json(ref["cfg"].to_json()) == ref["cfg"]
    assert_tree_close(params2, ref["params"], rtol=0)


@pytest.mark.parametrize("change,match", [
    (dict(heads=[]), r"'heads' must be a list of at least 1 entries, got 0"),
    (dict(heads=["a", "a"]), r"'heads' must be distinct names, got \['a', 'a'\]"),
    (dict(heads=["a", 3]), r"'heads' must be a non-empty string \(a head name\), got 3 \(entry 1\)"),
    (dict(heads="water"), r"'heads' must be a list, got str"),
    (dict(heads=["a", "b", "c"]), r"'atomic_energies' of a model of 3 heads \['a', 'b', 'c'\] must be 3 lists"),
    (dict(scale=1.0), r"'scale' of a model of 2 heads \['pt_head', 'water'\] must be a list of 2 numbers"),
    (dict(heads=["one"]), r"'atomic_energies' of a model of one head \['one'\] must be a list of one E0"),
    (dict(atomic_energies=[[1.0, 2.0, 3.0, 4.0], [1.0]]), r"must be 2 lists \(one per head\) of one E0 per element"),
])
def test_bad_heads_in_json_are_named(ref, change, match):
    d = json.loads(ref["cfg"].to_json())
    d.update(change)
    with pytest.raises(ValueError, match=match):
        cm.config_from_json(json.dumps(d))


def test_head_errors_name_the_heads(ref, structures):
    cfg, params = ref["cfg"], ref["params"]
    heads = r"\['pt_head', 'water'\]"
    with pytest.raises(ValueError, match=rf"already has a head 'water'; its heads are {heads}"):
        cm.add_head(cfg, params, "water")
    with pytest.raises(ValueError, match=rf"no head 'dft'; its heads are {heads}"):
        cm.select_head(cfg, params, "dft")
    with pytest.raises(ValueError, match=rf"Head index 2 is out of range: .* 2 head\(s\) {heads}"):
        cm.add_head(cfg, params, "new", copy_from=2)
    with pytest.raises(ValueError, match=r"e0s holds 26, not an atomic number of the model"):
        cm.add_head(cfg, params, "new", e0s={26: -3.0})
    with pytest.raises(ValueError, match="params that belong to cfg"):
        cm.select_head(cfg, cm.select_head(cfg, params, "water")[1], "water")
    with pytest.raises(ValueError, match=rf"scale of shape \(\) does not fit 2 head\(s\) {heads}"):
        dataclasses.replace(cfg, scale=1.0).scale_shift_per_head()
    template = cm.energy_fn_template(cfg)
    with pytest.raises(ValueError, match=rf"'head' holds indices \[2\] out of range: .* {heads}"):
        template.validate_dataset({"species": structures["Z"], "head": np.array([0, 2, 1])})
    with pytest.raises(ValueError, match=rf"'head' must be integer head indices, got dtype float64.*{heads}"):
        template.validate_dataset({"species": structures["Z"], "head": np.array([0.0, 1.0, 1.0])})
    template.validate_dataset({"species": structures["Z"], "head": np.array([0, 1, 1])})
    energy_fn = template(params)
    g = Graph(*(jnp.asarray(structures[k][0]) for k in ("senders", "receivers", "shifts")))
    R, Z = jnp.asarray(structures["R"][0] * 0.1), jnp.asarray(structures["Z"][0])
    for head, match in [(2, rf"Head index 2 is out of range.*{heads}"), (-1, "out of range"),
                        ("dft", rf"no head 'dft'; its heads are {heads}"),
                        (1.0, r"head must be an integer scalar"),
                        (np.array([0, 1]), r"head must be an integer scalar")]:
        with pytest.raises(ValueError, match=match):
            energy_fn(R, g, species=Z, head=head)


def test_without_a_head_the_default_head_is_evaluated(ref, structures):
    """The energy template of a model of several heads, called without
    ``head=`` (MD, DiffTRe, a dataset without a 'head' column), evaluates
    'Default' as mace-torch's calculator does (head 0, the foundation's
    pt_head, before), and refuses a model none of whose heads is 'Default'."""
    cfg, params = ref["cfg"], ref["params"]
    g = Graph(*(jnp.asarray(structures[k][0]) for k in ("senders", "receivers", "shifts")))
    R, Z = jnp.asarray(structures["R"][0] * 0.1), jnp.asarray(structures["Z"][0])
    with pytest.raises(ValueError, match=r"none is named 'Default'"):
        cm.energy_fn_template(cfg)(params)(R, g, species=Z)
    with pytest.raises(ValueError, match=r"none is named 'Default'.*Give the dataset a 'head'"):
        cm.energy_fn_template(cfg).validate_dataset({"species": structures["Z"]})
    tuned = dataclasses.replace(cfg, heads=("pt_head", "Default"))
    template = cm.energy_fn_template(tuned)
    template.validate_dataset({"species": structures["Z"]})
    energy_fn = template(params)
    default = float(energy_fn(R, g, species=Z))
    assert default == float(energy_fn(R, g, species=Z, head=1))
    assert default != float(energy_fn(R, g, species=Z, head=0))
    graphs = Graph(*(jnp.asarray(structures[k]) for k in ("senders", "receivers", "shifts")))
    batched = template.batched(params)(jnp.asarray(structures["R"] * 0.1), graphs,
                                       species=jnp.asarray(structures["Z"]))
    ones = template.batched(params)(jnp.asarray(structures["R"] * 0.1), graphs,
                                    species=jnp.asarray(structures["Z"]),
                                    head=jnp.ones(len(structures["R"]), jnp.int32))
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(ones))
    np.testing.assert_allclose(float(batched[0]), default, rtol=1e-10)
