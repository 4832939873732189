"""NequIP with SevenNet's published weights (issue 49, part): chemtrain's
JAX model reads the checkpoints of the installed sevenn package and gives
the energies, forces and stresses that sevenn itself computes
(tests/_support/files/sevennet_reference.json, written by
tests/_support/files/make_sevennet_reference.py with sevenn 0.13.0, float64).

Ten structures: bulk cells (three far narrower than twice the cutoff, a
sheared supercell), a Cu slab, two molecules and the main job's 370-atom
nanotube. The three checkpoints cover what the loader converts: SevenNet-0
(11Jul2024: paths whose stored Clebsch-Gordan buffer has the opposite
sign), its 22May2024 version (sevenn's old module names; spherical
harmonics of the raw edge vector) and l3i5 (l up to 3, the polynomial
cutoff, six paths of the opposite sign)."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chemtrain import units
from chemtrain.models import nequip
from chemtrain.models.mace import UntrustedFileError, UnknownElementError
from chemtrain.neighbors import Graph, precompute_graphs
import paths

with open(os.path.join(paths.FILES, "sevennet_reference.json")) as f:
    REFERENCE = json.load(f)
EV = units.EV_TO_KJ_PER_MOL


@pytest.fixture(scope="module")
def models():
    return {name: nequip.load_sevennet(name, trusted=True) for name in REFERENCE["models"]}


SMALL = [name for name, s in REFERENCE["structures"].items() if len(s["numbers"]) <= 32]


@functools.lru_cache(maxsize=None)
def _compiled(cfg):
    template = nequip.energy_fn_template(cfg)

    def energy(params, R, strain, graph, species, mask, box):
        return template(params)(R, graph, species=species, mask=mask, box=box,
                                perturbation=strain)
    return jax.jit(jax.value_and_grad(energy, argnums=(1, 2)))


def chemtrain_results(cfg, params, names, atoms=None):
    """{structure: energy (eV), forces (eV/A), ASE stress (eV/A^3)} from the
    chemtrain energy template (nm, kJ/mol) on precomputed graphs. The
    structures are padded to one atom count and edge capacity (padded atoms
    and edges masked), so that one compiled function serves them all."""
    structures = [REFERENCE["structures"][name] for name in names]
    n = atoms or max(len(s["numbers"]) for s in structures)
    R = np.zeros((len(names), n, 3))
    box = np.zeros((len(names), 3, 3))
    mask = np.zeros((len(names), n), bool)
    species = np.ones((len(names), n), int)
    for k, s in enumerate(structures):
        m = len(s["numbers"])
        R[k, :m] = np.array(s["positions"]) / 10.0
        R[k, m:] = 10.0 * (1 + np.arange(n - m))[:, None]   # far apart and far away
        mask[k, :m], species[k, :m] = True, s["numbers"]
        if any(s["pbc"]):
            box[k] = np.array(s["cell"]).T / 10.0
    pbc = np.array([s["pbc"] for s in structures])
    g = precompute_graphs(R, box, cutoff=cfg.cutoff / 10.0, pbc=pbc, mask=mask)
    # three padded edges at least (zero vectors, masked): their gradient must not be NaN
    g = precompute_graphs(R, box, cutoff=cfg.cutoff / 10.0, pbc=pbc, mask=mask,
                          capacity=g["senders"].shape[1] + 3)
    fn, out = _compiled(cfg), {}
    for k, (name, s) in enumerate(zip(names, structures)):
        graph = Graph(*(jnp.asarray(g[key][k]) for key in ("senders", "receivers", "shifts")))
        e, (dR, dstrain) = fn(params, jnp.asarray(R[k]), jnp.eye(3), graph,
                              jnp.asarray(species[k]), jnp.asarray(mask[k]), jnp.asarray(box[k]))
        m = len(s["numbers"])
        out[name] = {"energy": float(e) / EV, "forces": -np.asarray(dR)[:m] / EV / 10.0}
        if any(s["pbc"]):
            volume = abs(np.linalg.det(box[k])) * 1000.0   # A^3
            sigma = np.asarray(dstrain + dstrain.T) / 2 / EV / volume
            out[name]["stress"] = sigma[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
    return out


def check(got, want):
    n = len(want["forces"])
    # the bounds: 1e-6 eV/atom, 1e-5 eV/A, 1e-6 eV/A^3; measured far below
    assert abs(got["energy"] - want["energy"]) <= 1e-9 * abs(want["energy"]) + 1e-9 * n
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-7)
    if want["stress"] is not None:
        np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["7net-0", "7net-0_22may2024"])
def test_both_sevennet_0_dates_give_sevenns_results_on_ten_structures(models, name):
    """Bulk cells (NaCl, Si, GaAs narrower than twice the cutoff), a sheared
    Al supercell, a Cu slab, molecules and the 370-atom nanotube."""
    assert len(REFERENCE["structures"]) >= 10
    cfg, params = models[name]
    got = chemtrain_results(cfg, params, SMALL)
    got.update(chemtrain_results(cfg, params, ["nanotube"]))
    for structure, want in REFERENCE["models"][name].items():
        check(got[structure], want)
        if len(want["forces"]) > 1:   # the forces are not trivially zero
            assert np.max(np.abs(want["forces"])) > 0.01, structure


def test_l3i5_gives_sevenns_results(models):
    """l up to 3, the polynomial cutoff, six paths of the opposite sign."""
    cfg, params = models["7net-l3i5"]
    got = chemtrain_results(cfg, params, SMALL)
    for structure in SMALL:
        check(got[structure], REFERENCE["models"]["7net-l3i5"][structure])


def test_sevennet_0_is_the_published_model(models):
    """The name resolves to the sevenn package's file; the architecture is
    the published one (89 elements, 5 layers, cutoff 5 A)."""
    path = nequip.resolve("sevennet-0")
    assert path.endswith(os.path.join("SevenNet_0__11Jul2024", "checkpoint_sevennet_0.pth"))
    cfg, _ = models["7net-0"]
    assert (cfg.num_elements, cfg.num_layers, cfg.cutoff) == (89, 5, 5.0)
    assert cfg.irreps[1] == ((128, 0), (64, 1), (32, 2))


def test_a_jax_md_list_gives_the_graphs_energy_and_forces(models):
    from jax_md import space
    from chemtrain.neighbors import neighbor_list
    cfg, params = models["7net-0"]
    s = REFERENCE["structures"]["ethanol"]
    R = jnp.asarray(np.array(s["positions"]) / 10.0)
    displacement, _ = space.free()
    nbrs = neighbor_list(displacement, 2.0, cfg.cutoff / 10.0, format="sparse").allocate(R)
    template = nequip.energy_fn_template(cfg, displacement)
    energy, grad = jax.jit(jax.value_and_grad(lambda p, R, nbrs, z: template(p)(
        R, nbrs, species=z), argnums=1))(params, R, nbrs, jnp.asarray(s["numbers"]))
    want = REFERENCE["models"]["7net-0"]["ethanol"]
    assert abs(float(energy) / EV - want["energy"]) <= 1e-9 * abs(want["energy"])
    np.testing.assert_allclose(-np.asarray(grad) / EV / 10.0, want["forces"], rtol=0, atol=1e-7)


def test_a_batch_is_one_graph_with_each_structures_energy_forces_and_stress():
    """``template.batched`` (one disjoint graph, what force matching uses)
    against the single-structure energy function of each structure: a
    periodic cell rattled twice, a padded atom and a masked real atom, the
    strain derivative (stress) included. A small random NequIP with l <= 2
    features (the layout does not depend on the model's size)."""
    from ase.build import bulk
    from chemtrain.neighbors import Graph, precompute_graphs
    cfg = nequip.NequipConfig(atomic_numbers=(11, 17), cutoff=5.0, cutoff_function="poly",
                              cutoff_on=0.0, poly_p=6, n_basis=6,
                              irreps=(((4, 0),), ((4, 0), (4, 1), (4, 2)), ((4, 0),)),
                              filter_lmax=2, radial_hidden=(8,), denominators=(3.0, 3.0))
    params = nequip.init_params(jax.random.PRNGKey(1), cfg, jnp.float64)
    template = nequip.energy_fn_template(cfg)
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    rng = np.random.default_rng(3)
    R = np.stack([atoms.positions + 0.1 * rng.normal(size=atoms.positions.shape)
                  for _ in range(2)]) / 10.0
    R = np.concatenate([R, np.zeros((2, 1, 3))], axis=1)   # one padded atom each
    mask = np.ones(R.shape[:2], bool)
    mask[:, -1] = False
    mask[1, 0] = False   # and a real atom masked in the second
    box = np.array(atoms.cell).T / 10.0
    # edges of every atom, masked ones too: the energy functions must drop them
    graphs = precompute_graphs(R, box=box, cutoff=cfg.cutoff / 10.0)
    g = Graph(*(jnp.asarray(graphs[k]) for k in ("senders", "receivers", "shifts")))
    z = jnp.asarray(np.stack([np.append(atoms.numbers, 0)] * 2))
    boxes, strain = jnp.asarray(np.stack([box] * 2)), jnp.stack([jnp.eye(3)] * 2)
    args = (jnp.asarray(R), g, z, jnp.asarray(mask), boxes, strain)

    def one(p, R, g, z, m, bx, pt):
        return template(p)(R, g, species=z, mask=m, box=bx, perturbation=pt)

    def batch(p, R, g, z, m, bx, pt):
        U = template.batched(p)(R, g, species=z, mask=m, box=bx, perturbation=pt)
        return jnp.sum(U), U
    want = jax.jit(jax.vmap(jax.value_and_grad(one, argnums=(1, 6)), (None, 0, 0, 0, 0, 0, 0)))(
        params, *args)
    (_, U), grads = jax.jit(jax.value_and_grad(batch, argnums=(1, 6), has_aux=True))(
        params, *args)
    np.testing.assert_allclose(U, want[0], rtol=1e-12)
    assert abs(float(U[0] - U[1])) > 1e-3 * abs(float(U[0]))   # the two structures differ
    for a, b in zip(grads, want[1]):
        assert np.abs(b).max() > 1e-6
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10 * np.abs(b).max())
    assert np.all(np.asarray(grads[0])[1, 0] == 0) and np.all(np.asarray(grads[0])[:, -1] == 0)


def test_refusals(models, tmp_path):
    with pytest.raises(UntrustedFileError, match="pickle"):
        nequip.load_sevennet("sevennet-0")
    with pytest.raises(FileNotFoundError, match="names: "):
        nequip.load_sevennet("sevennet-7", trusted=True)
    # the multi-fidelity model of the package: an option this model lacks, by name
    mf = os.path.join(os.path.dirname(os.path.dirname(nequip.resolve("sevennet-0"))),
                      "SevenNet_MF_0", "checkpoint_sevennet_mf_0.pth")
    with pytest.raises(nequip.UnsupportedSevenNetError, match="use_modality=True"):
        nequip.load_sevennet(mf, trusted=True)
    cfg, params = models["7net-0"]
    template = nequip.energy_fn_template(cfg)
    with pytest.raises(UnknownElementError, match=r"118 \(Og\)"):
        template.validate_dataset({"species": np.array([[1, 118]])})
    energy = jax.jit(lambda p, R, g, z: template(p)(R, g, species=z))(
        params, jnp.array([[0.0, 0, 0], [0.1, 0, 0]]),
        Graph(jnp.array([0, 1]), jnp.array([1, 0]), jnp.zeros((2, 3))), jnp.array([1, 118]))
    assert np.isnan(float(energy))


def test_checkpoints_need_torch_only(models, monkeypatch):
    """The sevennet extra installs torch and sevenn, not mace-torch: reading a
    checkpoint must not import mace (it did, through MACE's torch import,
    until 2026-12-07), and without torch the error names the extra."""
    import sys
    monkeypatch.setitem(sys.modules, "mace", None)   # import mace raises ImportError
    cfg, params = nequip.load_sevennet("7net-0", trusted=True)
    assert jax.tree.all(jax.tree.map(np.array_equal, params, models["7net-0"][1]))
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"chemtrain\[sevennet\]"):
        nequip.load_sevennet("7net-0", trusted=True)


def perturbed(params, seed=0):
    """Every weight moved by about 5 % (float32 values, as a file holds)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: np.asarray(np.asarray(a) * (
        1 + 0.05 * rng.standard_normal(np.shape(a))), np.float32).astype(np.float64), params)


@pytest.mark.parametrize("name", ["7net-0_22may2024", "7net-l3i5"])
def test_a_written_checkpoint_reads_back_exactly(models, name, tmp_path):
    """save_sevennet inverts the loader's conversions (old names; column
    order and signs of l3i5's paths) for every weight."""
    from chemtrain.models.nequip import save_sevennet
    cfg, params = models[name]
    moved = perturbed(params)
    path = save_sevennet(str(tmp_path / "tuned.pth"), moved, name, trusted=True)
    cfg_back, back = nequip.load_sevennet(path, trusted=True)
    assert cfg_back == cfg
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(moved)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_sevennet(path, moved, name, trusted=True)


def test_sevenns_own_calculator_loads_a_written_checkpoint(models, tmp_path):
    """SevenNet-0 with every weight moved, written by chemtrain: sevenn's
    ASE calculator (its own loader, float32) gives chemtrain's energies,
    forces and stress of the moved weights, not the published model's."""
    import subprocess
    import sys
    from chemtrain.models.nequip import save_sevennet
    side = os.path.join(sys.prefix, "sevenn-side")
    assert os.path.isdir(os.path.join(side, "e3nn")), (
        f"{side} is missing: scripts/setup.sh unpacks sevenn's imports there")
    cfg, params = models["7net-0"]
    moved = perturbed(params)
    path = save_sevennet(str(tmp_path / "tuned.pth"), moved, "7net-0", trusted=True)
    with open(tmp_path / "in.json", "w") as f:   # a cell, a slab and a molecule
        json.dump({k: REFERENCE["structures"][k] for k in ("NaCl", "Cu_slab", "ethanol")}, f)
    subprocess.run([sys.executable, os.path.join(paths.SUPPORT, "sevenn_calculator.py"), path,
                    str(tmp_path / "in.json"), str(tmp_path / "out.json")], check=True,
                   env={**os.environ, "PYTHONPATH": side}, timeout=300)
    with open(tmp_path / "out.json") as f:
        theirs = json.load(f)
    ours = chemtrain_results(cfg, moved, list(theirs))
    for structure, want in theirs.items():
        got = ours[structure]
        published = REFERENCE["models"]["7net-0"][structure]["energy"]
        assert abs(got["energy"] - published) > 0.01   # the weights did move the energy
        # sevenn computes in float32: measured 3e-6 eV, 1.5e-6 eV/A, 1.4e-7 eV/A^3
        assert abs(got["energy"] - want["energy"]) <= 2e-5
        np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=2e-5)
        if want["stress"] is not None:
            np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=2e-6)


def test_a_model_of_another_architecture_is_not_written(models, tmp_path):
    from chemtrain.models.nequip import save_sevennet
    _, params = models["7net-l3i5"]
    with pytest.raises(ValueError, match=r"params\['layers'\]\[0\].* has shape .* the template "
                                         r"needs"):
        save_sevennet(str(tmp_path / "x.pth"), params, "7net-0", trusted=True)
    assert not os.path.exists(tmp_path / "x.pth")


def test_the_calculator_gives_sevenns_results_in_cells_of_any_size(models):
    """ChemtrainCalculator.from_nequip on the 2-atom NaCl cell (far narrower
    than twice the cutoff: every periodic image is an edge) and the molecule."""
    from ase import Atoms
    from chemtrain.calculator import ChemtrainCalculator
    cfg, params = models["7net-0"]
    calc = ChemtrainCalculator.from_nequip(cfg, params)
    for structure in ("NaCl", "ethanol"):
        s, want = REFERENCE["structures"][structure], REFERENCE["models"]["7net-0"][structure]
        atoms = Atoms(numbers=s["numbers"], positions=s["positions"], cell=s["cell"], pbc=s["pbc"])
        atoms.calc = calc
        assert abs(atoms.get_potential_energy() - want["energy"]) <= 1e-9 * abs(want["energy"])
        np.testing.assert_allclose(atoms.get_forces(), want["forces"], rtol=0, atol=1e-7)
        if want["stress"] is not None:
            np.testing.assert_allclose(atoms.get_stress(), want["stress"], rtol=0, atol=1e-9)
