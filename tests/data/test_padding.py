"""Padded systems of different size behave exactly like the unpadded ones."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax_md import partition, space

from chemtrain.data import pad_systems
from chemtrain.learn import force_matching as fm
from chemtrain.models import lennard_jones_template
from chemtrain.trainers import ForceMatching, RunOptions

R_CUT = 0.6
SIZES = [5, 8, 11, 6, 9, 7, 10]
GAMMAS = {"U": 0.1, "F": 1.0}


def cluster(n, rng):
    grid = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), -1).reshape(-1, 3)
    pick = rng.choice(len(grid), n, replace=False)
    return grid[pick] * 0.3 + rng.normal(0, 0.02, (n, 3))


@functools.lru_cache(maxsize=None)
def _systems():
    """Clusters labelled with LJ(sigma=0.21, eps=1.1); the model uses 0.2, 1.0."""
    rng = np.random.default_rng(3)
    disp, _ = space.free()
    truth = lennard_jones_template(disp, R_CUT)({"sigma": 0.21, "epsilon": 1.1})
    out = []
    for n in SIZES:
        R = cluster(n, rng)
        nbrs = neighbor_fn(partition.NeighborListFormat.Dense).allocate(R)
        U, dU = jax.jit(jax.value_and_grad(lambda r: truth(r, neighbor=nbrs.update(r))))(jnp.asarray(R))
        out.append({"R": R, "U": np.asarray(U), "F": -np.asarray(dU)})
    return out


def systems():
    return [dict(s) for s in _systems()]


def neighbor_fn(fmt):
    disp, _ = space.free()
    return partition.neighbor_list(disp, 10.0, R_CUT, dr_threshold=0.0, format=fmt,
                                   disable_cell_list=True)


PARAMS = {"sigma": jnp.asarray(0.2), "epsilon": jnp.asarray(1.0)}


def template():
    return lennard_jones_template(space.free()[0], R_CUT)


def unpadded_reference(systems, fmt):
    """Predictions and per-structure losses of each system on its own."""
    ref = []
    for s in systems:
        nbrs = neighbor_fn(fmt).allocate(s["R"])
        predict = jax.jit(fm.make_predictor(template(), nbrs))
        pred, err = predict(PARAMS, jnp.asarray(s["R"])[None], {})
        assert not bool(err[0])
        batch = {k: np.asarray(v)[None] for k, v in s.items()}
        errors = fm.per_sample_errors(pred, batch, GAMMAS)
        loss = sum(GAMMAS[t] * float(errors[t][0]) for t in GAMMAS)
        ref.append({"U": float(pred["U"][0]), "F": np.asarray(pred["F"][0]), "loss": loss})
    return ref


@pytest.mark.parametrize("fmt", [partition.NeighborListFormat.Dense,
                                 partition.NeighborListFormat.Sparse])
def test_padded_predictions_equal_unpadded(fmt):
    sys_ = systems()
    ref = unpadded_reference(sys_, fmt)
    # pad to more atoms than the largest system; padded atoms sit together at
    # the origin, inside the cutoff of real atoms and of each other
    padded = pad_systems(sys_, n_atoms=14)
    assert padded["R"].shape == (7, 14, 3) and padded["mask"].sum() == sum(SIZES)
    nbrs = neighbor_fn(fmt).allocate(padded["R"][2], extra_capacity=4)
    predict = jax.jit(fm.make_predictor(template(), nbrs))
    inputs = {"mask": jnp.asarray(padded["mask"])}
    pred, err = predict(PARAMS, jnp.asarray(padded["R"]), inputs)
    assert not np.any(np.asarray(err))
    batch = dict(padded)
    errors = fm.per_sample_errors(pred, batch, GAMMAS)
    for i, (n, r) in enumerate(zip(SIZES, ref)):
        np.testing.assert_allclose(float(pred["U"][i]), r["U"], rtol=1e-12)
        np.testing.assert_allclose(np.asarray(pred["F"][i, :n]), r["F"], rtol=1e-10, atol=1e-10)
        loss = sum(GAMMAS[t] * float(errors[t][i]) for t in GAMMAS)
        np.testing.assert_allclose(loss, r["loss"], rtol=1e-10)
    # without masking the same padded input gives other energies: the test can fail
    pred_nomask, _ = predict(PARAMS, jnp.asarray(padded["R"]), {})
    assert not np.allclose(np.asarray(pred_nomask["U"]), np.asarray(pred["U"]))


@pytest.mark.parametrize("n_dev", [1, 4])
def test_evaluation_metrics_exact_with_partial_last_batch(tmp_path, n_dev):
    sys_ = systems()
    fmt = partition.NeighborListFormat.Sparse
    ref = unpadded_reference(sys_, fmt)
    padded = pad_systems(sys_, n_atoms=12)
    nbrs = neighbor_fn(fmt).allocate(padded["R"][2], extra_capacity=4)
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",)) if n_dev > 1 else None
    tr = ForceMatching(PARAMS, optax.sgd(0.0), template(), nbrs, batch=4,
                       parallelism="jax" if mesh else "single", mesh=mesh, gammas=GAMMAS,
                       checkpoint_path=str(tmp_path), options=RunOptions(progress=False))
    tr.set_dataset(padded, "testing")  # 7 structures, batch 4: the last batch is padded
    m = tr.evaluate("testing")
    dU = np.array([r["U"] - s["U"] for r, s in zip(ref, sys_)])
    dF = np.concatenate([(r["F"] - s["F"]).ravel() for r, s in zip(ref, sys_)])
    assert m["n_structures"] == 7
    np.testing.assert_allclose(m["U"]["MAE"], np.mean(np.abs(dU)), rtol=1e-10)
    np.testing.assert_allclose(m["U"]["RMSE"], np.sqrt(np.mean(dU ** 2)), rtol=1e-10)
    np.testing.assert_allclose(m["F"]["MAE"], np.mean(np.abs(dF)), rtol=1e-10)
    np.testing.assert_allclose(m["F"]["RMSE"], np.sqrt(np.mean(dF ** 2)), rtol=1e-10)
    np.testing.assert_allclose(m["loss"], np.mean([r["loss"] for r in ref]), rtol=1e-10)
    pred = tr.predict(padded)
    assert pred["U"].shape == (7,)
    np.testing.assert_allclose(pred["U"], [r["U"] for r in ref], rtol=1e-12)


def test_pad_systems_rejects_too_small_n_atoms():
    with pytest.raises(ValueError, match="smaller than the largest system"):
        pad_systems(systems(), n_atoms=5)


def test_finetune_sets_share_shapes_and_keep_their_graphs():
    """chemtrain-finetune pads its validation and test sets to one shape
    (atoms, edges, shift type) so that one compiled model evaluates both;
    every structure keeps its real atoms and edges, padding is masked and
    its edges point at the new sentinel."""
    from chemtrain.finetune.data import share_shapes
    from chemtrain.neighbors import add_graphs
    rng = np.random.default_rng(0)

    def a_set(n, atoms, box):
        R = rng.uniform(0, 0.8, (n, atoms, 3))
        d = {"R": R, "F": rng.normal(size=(n, atoms, 3)), "species": np.ones((n, atoms), int),
             "mask": np.ones((n, atoms), bool), "box": np.broadcast_to(box, (n, 3, 3)).copy()}
        return add_graphs(d, 0.3)
    small, large = a_set(3, 5, np.eye(3) * 0.8), a_set(2, 9, np.zeros((3, 3)))
    before = {k: dict(v) for k, v in (("small", small), ("large", large))}
    share_shapes([small, large, None])
    for k in ("R", "F", "species", "mask", "senders", "receivers", "shifts"):
        assert small[k].shape[1:] == large[k].shape[1:] and small[k].dtype == large[k].dtype, k
    assert small["R"].shape[1] == 9 and not small["mask"][:, 5:].any()
    for name, d in (("small", small), ("large", large)):
        old = before[name]
        atoms, edges = old["R"].shape[1], old["senders"].shape[1]
        real = old["senders"] < atoms
        for k in ("senders", "receivers"):
            np.testing.assert_array_equal(d[k][:, :edges][real], old[k][real])
            assert (d[k][:, :edges][~real] == 9).all() and (d[k][:, edges:] == 9).all()
        np.testing.assert_array_equal(d["shifts"][:, :edges], old["shifts"])
        np.testing.assert_array_equal(d["R"][:, :atoms], old["R"])
