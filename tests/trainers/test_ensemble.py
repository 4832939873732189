"""EnsembleOfModels: a committee trained in one vectorised step equals its
members trained one by one with ForceMatching (their own initial parameters
and data orders, bootstrap samples included), in one process, over two CPU
devices and over mpirun -np 2 ranks; resume is bitwise; metrics and
predictions of the committee are the mean over members; bad input is named."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ensemble_problem as ep
import mp
from chemtrain.models import init_pair_mlp
from chemtrain.trainers import EnsembleOfModels, ForceMatching, RunOptions
from ensemble_problem import BATCH, EPOCHS, GAMMAS, K, members

SCRIPT = os.path.join(mp.HERE, "mp_ensemble.py")


@pytest.fixture(scope="module")
def setup():
    return ep.setup()


def _committee(problem, tmp_path, bootstrap=False, **kw):
    return ep.committee(problem, str(tmp_path / "ens"), bootstrap, **kw)


def _single(setup, tmp_path, k, data):
    _, test, template, nbrs = setup
    tr = ForceMatching(members()[k], optax.adam(1e-3), template, nbrs, batch=BATCH,
                       gammas=GAMMAS, seed=ep.SEED + k, parallelism="single",
                       checkpoint_path=str(tmp_path / f"one{k}"),
                       options=RunOptions(progress=False))
    tr.set_dataset(data, "training")
    tr.train(EPOCHS)
    return tr


def _close(a, b, tol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol * 1e-3)


@pytest.mark.parametrize("bootstrap", [False, True])
def test_each_member_equals_its_single_run(setup, tmp_path, bootstrap):
    tr = _committee(setup, tmp_path, bootstrap, parallelism="single")
    tr.train(EPOCHS)
    train = setup[0]
    for k in range(K):
        rows = tr.bootstrap_sample(k)
        if bootstrap:
            assert len(rows) == len(train["R"]) and len(np.unique(rows)) < len(rows)
        data = train if rows is None else {key: v[rows] for key, v in train.items()}
        one = _single(setup, tmp_path, k, data)
        _close(tr.member(k), one.params)
        np.testing.assert_allclose(tr.history[-1]["members"][k]["train_loss"],
                                   one.history[-1]["train_loss"], rtol=1e-6)
    # the members differ: different starts and orders
    assert not np.allclose(tr.member(0)["layers"][0]["w"], tr.member(1)["layers"][0]["w"])


def test_committee_metrics_and_predictions_are_the_members_mean(setup, tmp_path):
    tr = _committee(setup, tmp_path, parallelism="single")
    tr.train(1)
    test = setup[1]
    pred = tr.predict(test)
    assert pred["U_members"].shape == (len(test["R"]), K)
    np.testing.assert_allclose(pred["U"], pred["U_members"].mean(1), rtol=1e-12)
    np.testing.assert_allclose(pred["F_std"], pred["F_members"].std(1), rtol=1e-10, atol=1e-12)
    metrics = tr.evaluate("validation")
    record = tr.history[-1]
    assert len(record["members"]) == len(record["val_members"]) == K
    assert record["val"]["F"] == metrics["F"]
    assert record["val_members"][1]["F"] == metrics["members"][1]["F"]
    err = pred["F"] - test["F"]
    np.testing.assert_allclose(metrics["F"]["RMSE"], np.sqrt(np.mean(err ** 2)), rtol=1e-9)
    for k in range(K):
        e = pred["F_members"][:, k] - test["F"]
        np.testing.assert_allclose(metrics["members"][k]["F"]["MAE"], np.mean(np.abs(e)),
                                   rtol=1e-9)


def test_resume_is_bitwise(setup, tmp_path):
    a = _committee(setup, tmp_path / "a", parallelism="single")
    a.train(2)
    b = _committee(setup, tmp_path / "b", parallelism="single")
    b.train(1)
    b.save_checkpoint(str(tmp_path / "ck.npz"))
    c = _committee(setup, tmp_path / "c", parallelism="single")
    c.restore(str(tmp_path / "ck.npz"))
    c.train(1)
    for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((c.params,
                                                                              c.opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_two_devices_and_two_ranks_equal_one_process(setup, tmp_path):
    one = _committee(setup, tmp_path / "one", parallelism="single")
    one.train(EPOCHS)
    from jax.sharding import Mesh
    two = _committee(setup, tmp_path / "two", parallelism="jax",
                     mesh=Mesh(np.array(jax.devices()[:2]), ("data",)))
    assert two.strategy.n_shards == 2
    two.train(EPOCHS)
    _close(two.params, one.params, 1e-9)
    out = tmp_path / "mpi"
    out.mkdir()
    rc, log, _ = mp.mpirun(2, [SCRIPT, "--out", str(out), "--epochs", str(EPOCHS)], timeout=600)
    assert rc == 0, log[-4000:]
    for rank in range(2):
        got = json.loads((out / f"result_{rank}.json").read_text())
        assert got["n_shards"] == 2
        for k in range(K):
            for path, leaf in jax.tree_util.tree_flatten_with_path(one.member(k))[0]:
                np.testing.assert_allclose(got["members"][k][jax.tree_util.keystr(path)], leaf,
                                           rtol=1e-9, atol=1e-12)


def test_bad_input_is_named(setup, tmp_path):
    _, _, template, nbrs = setup
    with pytest.raises(ValueError, match="at least 2 members, got 1"):
        EnsembleOfModels(members(1), optax.adam(1e-3), template, nbrs, batch=BATCH)
    other = members(2)
    other[1] = init_pair_mlp(jax.random.PRNGKey(3), hidden=(8, 4), n_basis=8, dtype=jnp.float64)
    with pytest.raises(ValueError, match=r"Member 1's parameter \['layers'\]\[1\]\['b'\] "
                                         r"has shape \(4,\)"):
        EnsembleOfModels(other, optax.adam(1e-3), template, nbrs, batch=BATCH)
    tr = _committee(setup, tmp_path, parallelism="single")
    with pytest.raises(IndexError, match="members 0 to 2"):
        tr.member(3)


def test_resume_compares_bootstrap(setup, tmp_path):
    """A checkpoint records bootstrap: a resume that switched it would train
    the members on other data mid-run (it was accepted before)."""
    from chemtrain.checkpoint import CheckpointError
    b = _committee(setup, tmp_path / "b", parallelism="single")
    b.save_checkpoint(str(tmp_path / "ck.npz"))
    c = _committee(setup, tmp_path / "c", bootstrap=True, parallelism="single")
    with pytest.raises(CheckpointError, match=r"bootstrap=False; this run has .*bootstrap=True"):
        c.restore(str(tmp_path / "ck.npz"))
    _committee(setup, tmp_path / "d", parallelism="single").restore(str(tmp_path / "ck.npz"))
