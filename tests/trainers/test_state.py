"""Trainer state as one frozen pytree (chemtrain.trainers.state): what a
checkpoint holds, parameters handed from one trainer to another, and
checkpoints written before the state was one structure (``tests/_support/files/``,
written by 7ca1dec) restoring and continuing exactly."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import problems
from difftre_systems import bonded_pair
from legacy import FM_SETUP, difftre_setup
from chemtrain import checkpoint as ckpt
from chemtrain.trainers import ForceMatching, RunOptions
from chemtrain.trainers.state import ReweightingState, FMState

from paths import FILES as DATA  # noqa: E402


def _equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


def _same_run(a, b):
    """Equal arrays (bitwise) and equal plain fields but for timings (time_s,
    comm_s, wait_s)."""
    untimed = lambda s: {k: ([{kk: vv for kk, vv in r.items() if not kk.endswith("_s")}  # noqa: E731
                              for r in v]
                             if k == "history" else v) for k, v in s.split()[1].items()}
    leaves = lambda s: jax.tree.leaves(s.split()[0])  # noqa: E731
    return (untimed(a) == untimed(b) and len(leaves(a)) == len(leaves(b))
            and all(np.array_equal(np.asarray(x), np.asarray(y))
                    for x, y in zip(leaves(a), leaves(b))))


def test_state_is_a_frozen_pytree_of_its_arrays():
    """Only the array fields are leaves; the plain fields survive a tree
    map; a changed counter changes the tree structure; no field can be
    assigned; a field that is not plain data is refused when split."""
    s = FMState({"w": np.ones(2)}, {"m": np.zeros(2)}, {"w": np.ones(2)}, epoch=3,
                history=[{"loss": 1.5}])
    assert len(jax.tree.leaves(s)) == 3
    t = jax.tree.map(lambda x: x + 1, s)
    assert isinstance(t, FMState) and t.epoch == 3 and t.history == [{"loss": 1.5}]
    np.testing.assert_array_equal(t.params["w"], 2.0)
    assert jax.tree.structure(s) != jax.tree.structure(s.replace(epoch=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.epoch = 5
    trees, plain = s.split()
    assert set(trees) == {"params", "opt_state", "best_params"}
    assert plain == {"epoch": 3, "step": 0, "seed": 0, "best_loss": float("inf"),
                     "train_losses": [], "val_losses": [], "history": [{"loss": 1.5}],
                     "best_epoch": -1}
    assert _equal(FMState.join(trees, plain), s)
    with pytest.raises(TypeError, match="history must be plain data"):
        s.replace(history=[object()]).split()
    assert ReweightingState.plain_fields() == ("epoch", "update_count", "init_runs", "reuses",
                                           "objective_state", "stopped", "history",
                                           "epoch_losses", "update_losses")
    # a relative-entropy state of the last release kept s_rel in a field of its own
    old = ReweightingState.join({"params": {}, "opt_state": {}},
                            {"epoch": 2, "update_count": 4, "init_runs": 1, "s_rel": [-0.5, 0.25],
                             "history": [], "epoch_losses": [], "update_losses": []})
    assert old.objective_state == [{"s_rel": -0.5}, {"s_rel": 0.25}] and old.reuses == []


def test_growing_logs_leave_the_tree_structure_alone():
    """Histories and per-epoch losses grow every epoch; a state's tree
    structure must not (issue 32), while a tree map still carries them and a
    changed counter still changes the structure."""
    s = ReweightingState({"w": np.ones(2)}, {"m": np.zeros(2)}, epoch=1, epoch_losses=[0.5],
                     update_losses=[0.5, 0.4], history=[{"loss": 0.5}])
    grown = s.replace(epoch_losses=[0.5, 0.3], update_losses=[0.5, 0.4, 0.3, 0.2],
                      history=[{"loss": 0.5}, {"loss": 0.3}])
    assert jax.tree.structure(s) == jax.tree.structure(grown)
    assert jax.tree.structure(s) != jax.tree.structure(s.replace(update_count=2))
    t = jax.tree.map(lambda x: x * 2, grown)
    assert t.history == grown.history and t.update_losses == grown.update_losses
    np.testing.assert_array_equal(t.params["w"], 2.0)
    fm = FMState({"w": np.ones(1)}, {}, {"w": np.ones(1)}, train_losses=[1.0])
    assert jax.tree.structure(fm) == jax.tree.structure(fm.replace(
        train_losses=[1.0, 0.5], val_losses=[0.7], history=[{}]))


def _fm(tmp_path, name):
    data, params, template, nbrs = problems.mlp_problem(n_frames=FM_SETUP["n_frames"])
    tr = ForceMatching(params, problems.adam(), template, nbrs, batch=FM_SETUP["batch"],
                       parallelism="single", checkpoint_path=str(tmp_path / name),
                       seed=FM_SETUP["seed"], options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=FM_SETUP["train_ratio"], val_ratio=FM_SETUP["val_ratio"])
    return tr


def test_force_matching_checkpoint_of_7ca1dec_restores_and_continues(tmp_path):
    """The old file's arrays and counters come back as they were written;
    training on from it equals training on from the same state saved by
    this version (bitwise), and the new file holds the same parts."""
    path = os.path.join(DATA, "force_matching_v1.npz")
    meta, leaves = ckpt.load(path)
    assert "state_version" not in meta  # written before the version existed

    old = _fm(tmp_path, "a")
    old.restore(path)
    assert old.epoch == meta["epoch"] == 1 and old.step == meta["step"] > 0
    assert old.history == meta["history"] and old.seed == FM_SETUP["seed"]
    flat = [np.asarray(x) for x in jax.tree.leaves(old.strategy.to_host(old.params))]
    assert all(np.array_equal(a, b) for a, b in zip(flat, leaves["params"]))

    resaved = str(tmp_path / "v2.npz")
    old.save_checkpoint(resaved)
    meta2, leaves2 = ckpt.load(resaved)
    assert meta2["state_version"] == 2
    assert {k: v for k, v in meta2.items() if k not in ("state_version", "run_id",
                                                         "best_epoch")} == \
        {k: v for k, v in meta.items() if k != "run_id"}
    assert meta2["best_epoch"] == -1   # not in the old file: unknown (derived from the losses)
    assert leaves2.keys() == leaves.keys()

    new = _fm(tmp_path, "b")
    new.restore(resaved)
    old.train(1)
    new.train(1)
    assert old.step == new.step and old.history[-1]["train_loss"] == new.history[-1]["train_loss"]
    assert _same_run(old.strategy.to_host(old.state), new.strategy.to_host(new.state))


def test_difftre_checkpoint_of_7ca1dec_restores_and_continues(tmp_path):
    """The same for DifftreParallel, trajectory states included."""
    path = os.path.join(DATA, "difftre_v1.npz")
    meta, leaves = ckpt.load(path)
    old = bonded_pair(**difftre_setup(), checkpoint_path=str(tmp_path / "a"))
    old.restore(path)
    assert old.epoch == 1 and old.update_count == meta["update_count"] == 1
    assert old.update_losses == meta["update_losses"] and old.init_runs == 1
    assert all(np.array_equal(np.asarray(a), b)
               for a, b in zip(jax.tree.leaves(old.params), leaves["params"]))
    resaved = str(tmp_path / "v2.npz")
    old.save_checkpoint(resaved)
    new = bonded_pair(**difftre_setup(), checkpoint_path=str(tmp_path / "b"))
    new.restore(resaved)
    old.train(1)
    new.train(1)
    assert old.update_losses == new.update_losses
    assert _same_run(old.state, new.state)


def test_params_handed_over_between_trainers(tmp_path):
    """Assigning ``params`` gives a trainer another trainer's parameters
    (training goes on from them, optimizer state kept); parameters of
    another structure or shape are refused, naming the leaf."""
    a, b = _fm(tmp_path, "a"), _fm(tmp_path, "b")
    a.train(1)
    opt_before = b.strategy.to_host(b.opt_state)
    b.params = a.params
    assert _equal(b.strategy.to_host(b.params), a.strategy.to_host(a.params))
    assert _equal(b.strategy.to_host(b.opt_state), opt_before)
    b.train(1)
    assert b.epoch == 1 and np.isfinite(b.history[-1]["train_loss"])
    with pytest.raises(ValueError, match="another structure"):
        b.params = {"only": jnp.zeros(3)}
    leaf = jax.tree.leaves(a.params)[0]
    wrong = jax.tree.map(lambda x: jnp.zeros(x.shape + (1,), x.dtype) if x is leaf else x,
                         a.params)
    with pytest.raises(ValueError, match="expected shape"):
        b.params = wrong
    # non-finite values are refused, naming the leaf (issue 37: they were
    # blamed on jax-md padding at the next step), and the trainer keeps its own
    kept = b.strategy.to_host(b.params)
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x is leaf else x, a.params)
    with pytest.raises(ValueError, match=r"non-finite values .* in \["):
        b.params = nan
    assert _equal(b.strategy.to_host(b.params), kept)


def test_on_update_reports_every_applied_update(tmp_path):
    """DiffTRe's public callback: one record per update, in order, chained
    (each update starts from the previous one's parameters), ending at the
    trainer's parameters, with the per-state-point records of the history.
    Something not callable is refused."""
    records = []
    tr = bonded_pair(**dict(difftre_setup(), n_statepoints=2), on_update=records.append,
                     checkpoint_path=str(tmp_path))
    tr.initialize_trajstates()
    tr.train(2)
    assert [r["update"] for r in records] == list(range(tr.update_count)) == [0, 1, 2, 3]
    assert [r["batch"] for r in records] == [[0], [1], [0], [1]]
    assert [r["epoch"] for r in records] == [0, 0, 1, 1]
    for a, b in zip(records, records[1:]):
        assert _equal(a["params_after"], b["params_before"])
        assert not _equal(a["params_before"], a["params_after"])
    assert _equal(records[-1]["params_after"], tr.params)
    assert [r["loss"] for r in records] == tr.update_losses
    assert records[-1]["statepoints"][1] == tr.history[-1]["statepoints"][1]
    with pytest.raises(TypeError, match="on_update must be a function"):
        bonded_pair(**difftre_setup(), on_update="print")
