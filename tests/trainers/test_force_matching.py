"""ForceMatching: equivalence of parallel modes, sharding, resume, recovery."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from chemtrain.trainers import ForceMatching, RunOptions
from problems import FIXED, adam, lj_problem, mlp_problem, rel_err, tree_rel_err


def make_trainer(tmp_path, parallelism="single", mesh=None, batch=8, **kw):
    data, params, template, nbrs = mlp_problem()
    tr = ForceMatching(params, kw.pop("optimizer", adam()), template, nbrs, batch=batch,
                       parallelism=parallelism, mesh=mesh, checkpoint_path=str(tmp_path / "ckpt"),
                       **kw, options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=FIXED["train_ratio"], val_ratio=FIXED["val_ratio"])
    return tr


def mesh_of(n):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def test_single_and_jax_agree_after_10_steps(tmp_path):
    assert jax.device_count() >= 4
    results = {}
    for name, par, mesh in [("single", "single", None), ("jax2", "jax", mesh_of(2)),
                            ("jax4", "jax", mesh_of(4))]:
        tr = make_trainer(tmp_path / name, par, mesh, batch=FIXED["batch"], gammas=FIXED["gammas"])
        assert tr.strategy.n_shards == (1 if par == "single" else mesh.size)
        tr.train(FIXED["epochs"])
        assert tr.step == 10
        results[name] = (jax.tree.map(np.asarray, tr.params), tr.train_losses, tr.val_losses)
    ref = results["single"]
    for name in ("jax2", "jax4"):
        assert tree_rel_err(results[name][0], ref[0]) < 1e-6, name
        assert rel_err(results[name][1], ref[1]) < 1e-6
        assert rel_err(results[name][2], ref[2]) < 1e-6
    # the parameters did move: the comparison is not trivially true
    _, init, _, _ = mlp_problem()
    assert tree_rel_err(ref[0], init) > 1e-3


def test_jax_state_replicated_and_predictions_sharded(tmp_path):
    tr = make_trainer(tmp_path, "jax", mesh_of(4), batch=8)
    tr.train(1)
    for leaf in jax.tree.leaves(tr.params) + jax.tree.leaves(tr.opt_state):
        assert leaf.sharding.is_fully_replicated
    data, *_ = mlp_problem()
    out = tr.predict_batch({k: v[:8] for k, v in data.items()})
    for leaf in (out["U"], out["F"]):
        assert not leaf.sharding.is_fully_replicated
        assert leaf.sharding.spec[0] == "data"
        assert len(leaf.addressable_shards) == 4
        assert leaf.addressable_shards[0].data.shape[0] == 2
    host = tr.predict({k: v[:8] for k, v in data.items()})
    np.testing.assert_allclose(host["U"], np.asarray(out["U"]), rtol=1e-12)


def test_auto_uses_all_local_devices(tmp_path):
    tr = make_trainer(tmp_path, "auto", batch=8)
    assert tr.strategy.name == "jax" and tr.strategy.n_shards == jax.device_count()


def test_resume_is_bitwise_identical(tmp_path):
    straight = make_trainer(tmp_path / "a", "single")
    straight.train(4)
    first = make_trainer(tmp_path / "b", "single")
    first.train(2, checkpoint_freq=2)
    path = tmp_path / "b" / "ckpt" / "epoch_00002.npz"
    assert path.exists()
    resumed = make_trainer(tmp_path / "c", "single")
    resumed.restore(str(path))
    assert resumed.epoch == 2
    resumed.train(2)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(straight.opt_state), jax.tree.leaves(resumed.opt_state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert straight.train_losses == resumed.train_losses
    assert straight.val_losses == resumed.val_losses
    # and stopping does matter: two epochs alone are different
    assert tree_rel_err(first.params, straight.params) > 0


def test_metrics_file_and_evaluate(tmp_path):
    log = tmp_path / "metrics.jsonl"
    tr = make_trainer(tmp_path, "single", log_file=str(log))
    tr.train(2)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1]
    assert set(lines[0]["train_parts"]) == {"U", "F"}
    assert lines[1]["val_loss"] == pytest.approx(tr.val_losses[1])
    m = tr.evaluate("testing")
    assert set(m) >= {"U", "F", "loss"} and m["F"]["RMSE"] >= m["F"]["MAE"] > 0


def test_recovers_lennard_jones_parameters(tmp_path):
    data, true, template, nbrs = lj_problem()
    init = {"sigma": jnp.asarray(0.31), "epsilon": jnp.asarray(1.3)}
    # full-batch L-BFGS (fixed step): noise-free data has its exact minimum at `true`
    opt = optax.lbfgs(learning_rate=0.5, linesearch=None)
    tr = ForceMatching(init, opt, template, nbrs, batch=48, parallelism="single",
                       gammas={"U": 1e-2, "F": 1.0}, checkpoint_path=str(tmp_path),
                       options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0)
    tr.train(100)
    assert tr.train_losses[-1] < 1e-6 * tr.train_losses[0]
    fit = {k: float(v) for k, v in tr.params.items()}
    for k in ("sigma", "epsilon"):
        assert abs(fit[k] - true[k]) / true[k] < 1e-3, (k, fit[k], true[k])


_TRACED = []   # the functions JAX traces (a new program; a cache hit is traced too)
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _TRACED.append(name) if name.endswith("trace_duration") else None)


@pytest.mark.parametrize("parallelism", ["single", "jax"])
def test_metrics_and_predictions_share_one_compiled_model(tmp_path, parallelism):
    """Validation and test metrics and predictions run one compiled model
    program: after evaluating a stage, predicting the same shapes traces
    nothing new (and its energies are the ones the metrics were made of)."""
    tr = make_trainer(tmp_path, parallelism, mesh_of(4) if parallelism == "jax" else None)
    m = tr.evaluate("validation")
    data, *_ = mlp_problem()
    rows = {k: v[:8] for k, v in data.items()}
    _TRACED.clear()
    pred = tr.predict(rows)
    assert _TRACED == []
    mae = np.mean(np.abs(pred["U"] - rows["U"]))
    tr.set_dataset(rows, "testing")
    assert tr.evaluate("testing")["U"]["MAE"] == pytest.approx(mae, rel=1e-10)
