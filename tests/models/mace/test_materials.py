"""Materials data: periodic cells of any size (precomputed graphs) through
MACE and the trainer, stress targets, the trainer's graph-mode errors.
(Host edges, neighbor lists and the minimum-image error are tested in
neighbors/test_host.py, the converter in data/test_convert.py.)

References are independent of the code under test: mace-torch's
MACECalculator (energies, forces, stress) and ASE's Lennard-Jones
calculator.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_md import space

import mace_ref
from cells_ref import EPSILON, LJ_GRAPHS, RC, RO, SIGMA, lj_crystals, lj_data, lj_molecules
from chemtrain import neighbors as nb
from chemtrain import units
from chemtrain.learn import force_matching as fm
from chemtrain.models import lennard_jones_template
from chemtrain.trainers import ForceMatching, RunOptions

EV = units.EV_TO_KJ_PER_MOL
STRESS = EV / units.ANGSTROM_TO_NM ** 3          # eV/A^3 -> kJ/mol/nm^3


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


# ------------------------------------------------------------ MACE vs torch

def small_cells():
    """(positions A, Z, cell A, pbc): cells narrower than r_max = 4 A."""
    rng = np.random.default_rng(7)
    jit = lambda n: rng.uniform(-0.1, 0.1, (n, 3))  # noqa: E731
    out = []
    cell = np.eye(3) * 2.6                                     # 2 atoms, 2.6 A wide
    out.append((np.array([[0.0, 0, 0], [1.3, 1.3, 1.3]]) + jit(2), [6, 8], cell, [True] * 3))
    cell = np.eye(3) * 3.7                                     # 8 atoms, 3.7 A wide
    grid = np.stack(np.meshgrid(*[[0, 0.5]] * 3, indexing="ij"), -1).reshape(-1, 3)
    out.append((grid @ cell + jit(8), [6, 1, 8, 7, 6, 1, 1, 8], cell, [True] * 3))
    cell = np.array([[3.2, 0, 0], [1.1, 3.0, 0], [0.6, -0.7, 3.4]])   # triclinic, 3 atoms
    out.append((np.array([[0.1, 0.2, 0.1], [0.5, 0.4, 0.6], [0.8, 0.9, 0.3]]) @ cell,
                [7, 6, 1], cell, [True] * 3))
    cell = np.array([[3.0, 0, 0], [1.0, 3.1, 0], [0, 0, 12.0]])       # slab, vacuum along z
    frac = np.array([[0.1, 0.1, 0.1], [0.6, 0.5, 0.12], [0.3, 0.8, 0.2], [0.8, 0.2, 0.25]])
    out.append((frac @ cell, [6, 8, 1, 6], cell, [True, True, False]))
    for pos, _, cell, pbc in out:
        widths = nb.perpendicular_widths(cell.T)
        assert widths[np.asarray(pbc)].min() < 4.0
    return out


def torch_reference(path, pos, Z, cell, pbc):
    """mace-torch's MACECalculator: energy (eV), forces (eV/A), stress (eV/A^3)."""
    import ase
    from mace.calculators import MACECalculator
    key = (path, "stress")
    if key not in mace_ref._CALCULATORS:
        mace_ref._CALCULATORS[key] = MACECalculator(model_paths=path, device="cpu",
                                                    default_dtype="float64")
    atoms = ase.Atoms(numbers=Z, positions=pos, cell=cell, pbc=pbc)
    atoms.calc = mace_ref._CALCULATORS[key]
    return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress(voigt=False)


def padded_batch(structures, n_atoms, cutoff_nm):
    """The structures as one padded chemtrain batch (nm) with graphs."""
    from chemtrain.data import pad_systems
    systems = [{"R": pos * 0.1, "species": np.asarray(Z, np.int32), "box": cell.T * 0.1,
                "pbc": np.asarray(pbc)} for pos, Z, cell, pbc in structures]
    data = pad_systems(systems, n_atoms, per_atom=("R", "species"))
    data["species"][~data["mask"]] = 1
    return nb.add_graphs(data, cutoff_nm)


@pytest.mark.parametrize("name", sorted(mace_ref.CONFIGS))
def test_mace_matches_torch_on_small_cells(tmp_path, name):
    """2- and 8-atom cells narrower than r_max, a triclinic cell and a slab,
    one padded batch through the force-matching predictor (float64)."""
    from chemtrain.models import mace as cm
    path = mace_ref.save_torch_model(mace_ref.build_torch_model(name), str(tmp_path / "m.model"))
    cfg, params = cm.load_mace_torch(path, trusted=True)
    structures = small_cells()
    data = padded_batch(structures, 8, cfg.r_max / 10)
    predict = fm.make_predictor(cm.energy_fn_template(cfg), None)
    kwargs = {k: jnp.asarray(data[k]) for k in ("species", "mask", "box", *nb.GRAPH_KEYS)}
    pred, err = jax.jit(lambda p, R, kw: predict(p, R, kw, stress=True))(
        jax.tree.map(jnp.asarray, params), jnp.asarray(data["R"]), kwargs)
    assert not np.asarray(err).any() and np.asarray(pred["has_stress"]).all()
    for k, (pos, Z, cell, pbc) in enumerate(structures):
        E_t, F_t, S_t = torch_reference(path, pos, Z, cell, pbc)
        E = float(pred["U"][k]) / EV
        F = np.asarray(pred["F"][k, :len(Z)]) / EV / 10
        S = np.asarray(pred["stress"][k]) / STRESS
        e0 = sum(dict(zip(cfg.atomic_numbers, cfg.atomic_energies))[z] for z in Z)
        assert abs(E_t - e0) > 1e-2 and np.abs(F_t).max() > 1e-2 and np.abs(S_t).max() > 1e-4
        assert abs(E - E_t) / abs(E_t) < 1e-6, (k, E, E_t)
        assert abs((E - e0) - (E_t - e0)) / abs(E_t - e0) < 1e-6, (k, E, E_t)
        assert rel(F, F_t) < 1e-6, (k, rel(F, F_t))
        # the virial dE/d(strain) agrees everywhere; for the slab mace-torch divides it by the
        # volume of a cell it enlarges along the non-periodic axis (get_neighborhood)
        from mace.data.neighborhood import get_neighborhood
        V_t = abs(np.linalg.det(get_neighborhood(pos, cfg.r_max, tuple(pbc), cell.copy())[3]))
        assert rel(S * abs(np.linalg.det(cell)), S_t * V_t) < 1e-6, (k, S, S_t)
        if all(pbc):
            assert rel(S, S_t) < 1e-6, (k, rel(S, S_t))
        np.testing.assert_array_equal(np.asarray(pred["F"][k, len(Z):]), 0.0)
    # without graphs the model refuses these cells (a jax-md list counts one image per pair)
    jaxmd_data = {k: data[k][:3] for k in ("R", "species", "mask", "box")}
    with pytest.raises(nb.SmallCellError, match=r"MACE data's box.* widths \[0\.26 +0\.26 +0\.26 *\]"
                                                 r" nm.*twice the cutoff \(0\.4 nm"):
        cm.energy_fn_template(cfg, space.free()[0]).validate_dataset(jaxmd_data)


# ------------------------------------------------------ graph-mode errors

def test_graph_mode_errors(tmp_path):
    disp, _ = space.free()
    data = lj_data()
    tr = ForceMatching({"sigma": 0.3, "epsilon": 1.0}, optax.sgd(1e-3),
                       lennard_jones_template(disp, 0.4), None, batch=2, parallelism="single",
                       checkpoint_path=str(tmp_path), options=RunOptions(progress=False))
    with pytest.raises(ValueError, match=r"nbrs_init is None, so dataset must carry precomputed "
                                         r"graphs \('senders', 'receivers', 'shifts'\)"):
        tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0)
    graphs = nb.add_graphs(data, 0.4)
    with pytest.raises(ValueError, match=r"graph key\(s\) \['senders', 'receivers'\] but not "
                                         r"\['shifts'\]"):
        tr.set_datasets({k: v for k, v in graphs.items() if k != "shifts"}, train_ratio=1.0)
    bad = dict(graphs, senders=graphs["senders"] + 5)
    with pytest.raises(ValueError, match=r"atom indices from 5 to 9; they must lie in \[0, 4\]"):
        tr.set_datasets(bad, train_ratio=1.0)
    # a template that reads neighbor.idx (a jax-md list) gets a clear error, not a wrong energy
    def idx_template(params):
        return lambda R, neighbor, **kw: params["sigma"] * jnp.sum(neighbor.idx < R.shape[0])
    tr = ForceMatching({"sigma": 0.3}, optax.sgd(1e-3), idx_template, None, batch=2,
                       parallelism="single", checkpoint_path=str(tmp_path / "i"),
                       options=RunOptions(progress=False))
    tr.set_datasets(graphs, train_ratio=1.0, val_ratio=0.0)
    with pytest.raises(TypeError, match="reads neighbor.idx.*edge_vectors"):
        tr.train(1)


# --------------------------------------------------- Lennard-Jones with stress

def ase_lj_labels(structures):
    """U, F, stress (chemtrain units) from ASE's smooth Lennard-Jones."""
    import ase
    from ase.calculators.lj import LennardJones
    U, F, S = [], [], []
    for pos, cell, pbc in structures:
        atoms = ase.Atoms("Ar" * len(pos), positions=pos, cell=cell, pbc=pbc)
        atoms.calc = LennardJones(sigma=SIGMA, epsilon=EPSILON, rc=RC, ro=RO, smooth=True)
        U.append(atoms.get_potential_energy() * EV)
        F.append(atoms.get_forces() * EV * 10)
        S.append(atoms.get_stress(voigt=False) * STRESS if all(pbc) else np.zeros((3, 3)))
    return np.array(U), F, np.stack(S)


def lj_dataset(structures):
    from chemtrain.data import pad_systems
    U, F, S = ase_lj_labels(structures)
    systems = [{"R": pos * 0.1, "F": f[:len(pos)], "U": u, "stress": s, "box": cell.T * 0.1,
                "stress_weight": float(all(pbc))}
               for (pos, cell, pbc), u, f, s in zip(structures, U, F, S)]
    data = pad_systems(systems, per_atom=("R", "F"))
    return nb.add_graphs(data, RC * 0.1)


def test_lj_stress_of_a_large_cell_with_jax_md_list():
    """The jax-md path: the project's LJ template and the neighbor-list
    helper give ASE's stress for a cell wide enough for minimum image."""
    from ase.build import bulk
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat(3)
    rng = np.random.default_rng(3)
    strain = np.eye(3) + 0.02 * rng.normal(size=(3, 3))
    structure = (atoms.positions @ strain + 0.1 * rng.normal(size=atoms.positions.shape),
                 atoms.cell.array @ strain, [True] * 3)
    U, F, S = ase_lj_labels([structure])
    box = structure[1].T * 0.1
    R = jnp.asarray(structure[0] * 0.1)
    disp, _ = nb.make_space(box)
    nbrs = nb.neighbor_list(disp, box, RC * 0.1).allocate(R, box=jnp.asarray(box))
    template = lennard_jones_template(disp, RC * 0.1, RO * 0.1)
    predict = fm.make_predictor(template, nbrs)
    pred, err = jax.jit(lambda R, kw: predict({"sigma": SIGMA / 10, "epsilon": EPSILON * EV}, R,
                                              kw, stress=True))(R[None], {"box": jnp.asarray(box)[None]})
    assert not bool(err[0])
    assert rel(pred["U"], U) < 1e-6 and rel(pred["F"], F) < 1e-6
    assert rel(pred["stress"], S) < 1e-6 and np.abs(S).max() > 1.0


@pytest.mark.parametrize("gammas", [{"stress": 1e-5}, {"U": 1e-3, "F": 1e-3, "stress": 1e-5}],
                         ids=["stress", "U+F+stress"])
def test_lj_crystal_stress_training_recovers_parameters(tmp_path, gammas):
    """Small fcc cells (every image an edge) labelled by ASE with energies,
    forces and stresses: full-batch L-BFGS on the stress alone, and on all
    three, recovers sigma and epsilon."""
    data = lj_dataset(lj_crystals(12, seed=1))
    true = {"sigma": SIGMA / 10, "epsilon": EPSILON * EV}
    tr = ForceMatching({"sigma": jnp.asarray(0.33), "epsilon": jnp.asarray(1.1)},
                       optax.lbfgs(learning_rate=1.0, linesearch=None),
                       LJ_GRAPHS, None, batch=12,
                       parallelism="single", gammas=gammas,
                       weights_keys={"stress": "stress_weight"}, checkpoint_path=str(tmp_path),
                       options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0)
    before = tr.evaluate("training")
    tr.train(40)
    after = tr.evaluate("training")
    assert after["stress"]["RMSE"] < 1e-5 * before["stress"]["RMSE"], (before, after)
    for k in ("sigma", "epsilon"):
        assert abs(float(tr.params[k]) - true[k]) / true[k] < 1e-6, (k, tr.params[k], true[k])


def test_molecules_and_cells_train_without_nan(tmp_path):
    structures = lj_crystals(4, seed=2) + lj_molecules(4, seed=3)
    data = lj_dataset(structures)
    assert (data["stress_weight"] == [1] * 4 + [0] * 4).all() and (data["box"][4:] == 0).all()
    kw = dict(gammas={"U": 1.0, "F": 1e-2, "stress": 1e-4}, batch=4, parallelism="single",
              checkpoint_path=str(tmp_path), options=RunOptions(progress=False))
    template = LJ_GRAPHS
    init = {"sigma": jnp.asarray(0.32), "epsilon": jnp.asarray(1.2)}
    tr = ForceMatching(init, optax.adam(1e-2), template, None, **kw)
    with pytest.raises(ValueError, match=r"pass weights_keys=\{'stress': 'stress_weight'\}"):
        tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0)
    tr = ForceMatching(init, optax.adam(1e-2), template, None,
                       weights_keys={"stress": "stress_weight"}, **kw)
    tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0, shuffle=True)
    before = tr.evaluate("training")
    tr.train(3)
    after = tr.evaluate("training")
    assert all(np.isfinite(v) for v in tr.train_losses) and after["loss"] < before["loss"]
    assert np.isfinite([float(v) for v in tr.params.values()]).all()
    # stress metrics count the four cells only (the molecules would change the MAE)
    tr.set_dataset({k: v[:4] for k, v in data.items()}, "testing")
    cells = tr.evaluate("testing")["stress"]
    assert after["stress"]["MAE"] == pytest.approx(cells["MAE"], rel=1e-10)
    assert after["stress"]["RMSE"] == pytest.approx(cells["RMSE"], rel=1e-10)


def test_graphs_on_two_devices_equal_one(tmp_path):
    """Graph keys are per-structure data: split over devices like positions."""
    from jax.sharding import Mesh
    data = lj_dataset(lj_crystals(8, seed=6))
    params = {}
    for parallelism, mesh in (("single", None), ("jax", Mesh(np.array(jax.devices()[:2]), ("data",)))):
        tr = ForceMatching({"sigma": jnp.asarray(0.33), "epsilon": jnp.asarray(1.1)},
                           optax.sgd(1e-9), LJ_GRAPHS, None, batch=4,
                           parallelism=parallelism, mesh=mesh, gammas={"F": 1.0, "stress": 1e-4},
                           weights_keys={"stress": "stress_weight"},
                           checkpoint_path=str(tmp_path / parallelism),
                           options=RunOptions(progress=False))
        tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0)
        tr.train(1)
        params[parallelism] = {k: float(v) for k, v in tr.params.items()}
    init = {"sigma": 0.33, "epsilon": 1.1}
    for k in ("sigma", "epsilon"):
        moved = params["single"][k] - init[k]
        assert abs(moved) > 1e-6
        assert params["jax"][k] - init[k] == pytest.approx(moved, rel=1e-9)
