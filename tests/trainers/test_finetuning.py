"""ForceMatching's fine-tuning pieces: the best model and early stopping
(surviving a restore), evaluation with the moving average, a plateau
schedule fed by the validation loss, frozen blocks, per-target losses."""
import glob

import jax
import numpy as np
import optax
import pytest

from chemtrain.learn import optimizers
from chemtrain.learn.losses import huber
from chemtrain.models import freeze
from chemtrain.trainers import ForceMatching, RunOptions
from problems import FIXED, mlp_problem

GAMMAS = {"U": 1e-3, "F": 1.0}


def trainer(tmp_path, optimizer, name="run", **kw):
    data, params, template, nbrs = mlp_problem()
    tr = ForceMatching(params, optimizer, template, nbrs, batch=4, parallelism="single",
                       gammas=GAMMAS, checkpoint_path=str(tmp_path / name), **kw,
                       options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=FIXED["train_ratio"], val_ratio=FIXED["val_ratio"])
    return tr


def host(tree):
    return jax.tree.map(np.asarray, tree)


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_best_model_is_the_lowest_validation_loss_and_survives_restore(tmp_path):
    tr = trainer(tmp_path, optax.adam(0.05))
    seen = []
    for epoch in range(5):
        if epoch == 3:   # hand back the starting parameters: later epochs are worse
            tr.params = mlp_problem()[1]
        tr.train(1, checkpoint_freq=1)
        seen.append((tr.val_losses[-1], host(tr.params)))
    losses = [v for v, _ in seen]
    best = int(np.argmin(losses))
    assert best == 2, f"the test needs a best epoch before the last: {losses}"
    assert tr.best_loss == losses[best]
    assert same(tr.best_params, seen[best][1])
    # restored in a new trainer from the last checkpoint: same best model and loss
    again = trainer(tmp_path, optax.adam(0.05), name="other")
    again.restore(sorted(glob.glob(str(tmp_path / "run" / "epoch_*.npz")))[-1])
    assert again.best_loss == tr.best_loss and same(again.best_params, tr.best_params)
    assert again.epochs_since_best() == len(losses) - 1 - best


def test_early_stopping_counts_across_a_restore(tmp_path):
    # lr 0: the validation loss never improves after the first epoch
    tr = trainer(tmp_path, optax.sgd(0.0))
    tr.train(10, checkpoint_freq=1, patience=2)
    assert tr.stopped_early and tr.epoch == 3      # epoch 0 best, epochs 1 and 2 not better
    again = trainer(tmp_path, optax.sgd(0.0), name="other")
    again.restore(str(tmp_path / "run" / "epoch_00002.npz"))   # one epoch without improvement
    again.train(10, patience=2)
    assert again.stopped_early and again.epoch == 3
    again.train(10, patience=2)                     # already out of patience: no epoch
    assert again.stopped_early and again.epoch == 3
    with pytest.raises(ValueError, match="patience must be a whole number of epochs >= 1"):
        again.train(1, patience=0)
    # a best loss reset to inf (a new stage of training) counts afresh: it trains
    again.state = again.state.replace(best_loss=float("inf"))
    assert again.epochs_since_best() == 0
    again.train(1, patience=2)
    assert again.epoch == 4 and not again.stopped_early


def test_ema_is_what_is_evaluated_and_kept_as_best(tmp_path):
    tr = trainer(tmp_path, optimizers.ema(optax.adam(3e-3), decay=0.9))
    tr.train(2)
    avg = host(optimizers.averaged(tr.opt_state))
    assert not same(avg, host(tr.params))
    assert same(host(tr.eval_params), avg)
    assert tr.evaluate("validation")["loss"] == pytest.approx(tr.val_losses[-1], rel=1e-12)
    assert tr.evaluate("validation", params=tr.params)["loss"] != tr.val_losses[-1]
    if tr.best_loss == tr.val_losses[-1]:
        assert same(tr.best_params, avg)


def test_plateau_schedule_is_fed_the_validation_loss_and_resumes(tmp_path):
    tr = trainer(tmp_path, optimizers.reduce_on_plateau(optax.sgd(0.0), factor=0.5, patience=0))
    tr.train(3, checkpoint_freq=1)
    # lr 0: no improvement after epoch 0, patience 0: the factor halves each later epoch
    assert [r["lr_scale"] for r in tr.history] == [1.0, 0.5, 0.25]
    again = trainer(tmp_path, optimizers.reduce_on_plateau(optax.sgd(0.0), factor=0.5,
                                                           patience=0), name="other")
    again.restore(str(tmp_path / "run" / "epoch_00003.npz"))
    assert optimizers.update_scale(again.opt_state) == 0.25


def test_frozen_blocks_are_bitwise_unchanged(tmp_path):
    _, params, _, _ = mlp_problem()
    opt = freeze(optax.adamw(1e-2, weight_decay=0.1), params, ["layers.0", "layers.2.b"])
    tr = trainer(tmp_path, opt)
    tr.train(2)
    after, before = host(tr.params), host(params)
    for k in ("w", "b"):
        assert np.array_equal(after["layers"][0][k], before["layers"][0][k])
    assert np.array_equal(after["layers"][2]["b"], before["layers"][2]["b"])
    assert not np.array_equal(after["layers"][1]["w"], before["layers"][1]["w"])
    assert not np.array_equal(after["layers"][2]["w"], before["layers"][2]["w"])
    with pytest.raises(ValueError, match=r"\['layers.7'\] are not entries of the parameters"):
        freeze(optax.sgd(0.1), params, ["layers.7"])


def test_huber_loss_is_the_trainers_loss(tmp_path):
    """The validation loss with a Huber force loss is the mean per-structure
    Huber loss of the predictions, computed here from predict()."""
    tr = trainer(tmp_path, optax.adam(1e-3), losses={"F": huber(20.0)})
    rows = {k: np.asarray(v) for k, v in tr.data["validation"].data.items()}
    pred = tr.predict(rows)
    r = pred["F"] - rows["F"]
    a = np.abs(r)
    h = np.where(a <= 20.0, 0.5 * r * r, 20.0 * (a - 10.0))
    want = np.mean(GAMMAS["U"] * (pred["U"] - rows["U"]) ** 2
                   + GAMMAS["F"] * h.reshape(len(r), -1).mean(axis=1))
    assert tr.evaluate("validation")["loss"] == pytest.approx(want, rel=1e-9)
    assert np.any(a > 20.0) and np.any(a <= 20.0)   # both branches are exercised
