"""The reweighting update's pure pieces (chemtrain.trainers.reweighting_update
and reweighting_files): the policies and arguments the loop accepts, the
reuse counts of older states, and when a checkpoint could not be resumed.
The update itself runs in every DiffTRe and relative-entropy test."""
import optax
import pytest

from chemtrain.learn import Objective, StepSizeSearch
from chemtrain.simulate import RestartPolicy
from chemtrain.trainers.reweighting_files import why_not_resumable
from chemtrain.trainers.reweighting_update import (check_arguments, policies, reuses_of)
from chemtrain.trainers.state import ReweightingState


def _objective():
    return Objective("toy", result=lambda *a: None)


def test_policies_take_values_true_or_none():
    assert policies(None, None) == (None, RestartPolicy())
    assert policies(True, None)[0] == StepSizeSearch()
    assert policies(False, RestartPolicy(2.0, 5)) == (None, RestartPolicy(2.0, 5))
    with pytest.raises(TypeError, match="StepSizeSearch.*got int"):
        policies(3, None)
    with pytest.raises(TypeError, match="RestartPolicy.*got tuple"):
        policies(None, (1.5, 3))


def test_arguments_are_checked_by_kind():
    check_arguments(_objective(), optax.sgd(0.1))
    with pytest.raises(TypeError, match="chemtrain.learn.Objective, got dict"):
        check_arguments({}, optax.sgd(0.1))
    with pytest.raises(TypeError, match="optax.GradientTransformation, got function"):
        check_arguments(_objective(), lambda g: g)


def test_reuse_counts_of_an_older_state_are_zero():
    state = ReweightingState(params={}, opt_state={}, reuses=[2, 1])
    assert reuses_of(state, 4) == [2, 1, 0, 0]
    assert reuses_of(state, 1) == [2]
    assert reuses_of(ReweightingState(params={}, opt_state={}), 2) == [0, 0]


def test_a_checkpoint_is_refused_until_the_epoch_completes():
    assert why_not_resumable(3, False, None, "ck") is None
    assert "inside on_update" in why_not_resumable(3, True, None, "ck")
    failed = why_not_resumable(3, False, ("failed", 7), "ck")
    assert "Epoch 3 did not complete (update 7 failed; the error state in 'ck'" in failed
    assert "on_update raised KeyError after update 2" in why_not_resumable(
        3, False, ("callback", 2, "KeyError"), "ck")
    assert "interrupted after 5 updates" in why_not_resumable(3, False, ("interrupted", 5), "ck")


def test_apply_update_returns_the_next_state_and_changes_nothing(tmp_path):
    """One update of a toy loop (the mean-energy objective on a bonded pair,
    tests/_support/mean_energy.py) called directly: the next state, report
    and recomputed trajectories come back; the trainer's state and
    trajectory store are as they were. Expected values from the stored
    snapshots' bond energies alone: a constant shift does not reweight, so
    the gradient of (<bond> + shift - target)^2 is 2 (<bond> + shift - target)."""
    import jax
    import numpy as np
    from mp_objective import TARGETS, trainer
    from chemtrain.trainers.reweighting_update import apply_update
    with jax.enable_x64(True):
        tr, bond_energies = trainer(str(tmp_path), updates=0, max_reuses=1)
        state0, store = tr.state, tr.trajectories
        kept = {i: store.states[i] for i in range(2)}
        state1, report, predictions, new = apply_update(tr._loop(), state0, [0, 1], 0)
        assert tr.state is state0 and all(store.states[i] is kept[i] for i in range(2))
        assert new == {} and predictions == {} and report["derived"] == {}
        means = [np.mean(bond_energies(i)) for i in range(2)]
        losses = [(m - t) ** 2 for m, t in zip(means, TARGETS)]
        grad = np.mean([2 * (m - t) for m, t in zip(means, TARGETS)])
        np.testing.assert_allclose(float(state1.params["shift"]), -0.25 * grad, rtol=1e-9)
        np.testing.assert_allclose(report["loss"], np.mean(losses), rtol=1e-9)
        assert state1.update_count == 1 and state1.update_losses == [report["loss"]]
        assert state1.reuses == [1, 1] and state0.reuses == [0, 0]
        for i in range(2):
            rec = report["statepoints"][i]
            assert rec["statepoint"] == i and rec["update"] == 0 and rec["recomputed"] is False
            np.testing.assert_allclose(rec["loss"], losses[i], rtol=1e-9)    # the loop's
            np.testing.assert_allclose(rec["mean_energy"], means[i], rtol=1e-9)  # the objective's
            assert rec["n_eff"] == pytest.approx(rec["n_snapshots"], rel=1e-9)
            assert rec["pool_n_eff"] == rec["n_eff"]       # a pool of one
        # one reuse later every trajectory is recomputed: returned, not committed
        state2, report, _, new = apply_update(tr._loop(), state1, [0, 1], 0)
        assert sorted(new) == [0, 1] and all(store.states[i] is kept[i] for i in range(2))
        assert sorted(report["derived"]) == [0, 1]     # for the store, with the new ones
        assert all(r["recomputed"] for r in report["statepoints"].values())
        assert state2.reuses == [0, 0] and state2.update_count == 2
        assert not np.allclose(bond_energies(0, new[0]), bond_energies(0))
