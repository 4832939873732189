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
from chemtrain.trainers.state import DifftreState, RelEntropyState


def _objective(numbers=None):
    return Objective("toy", result=lambda *a: None, contributions=lambda *a: None,
                     records=lambda *a: None, numbers=numbers or {})


def test_policies_take_values_true_or_none():
    assert policies(None, None) == (None, RestartPolicy())
    assert policies(True, None)[0] == StepSizeSearch()
    assert policies(False, RestartPolicy(2.0, 5)) == (None, RestartPolicy(2.0, 5))
    with pytest.raises(TypeError, match="StepSizeSearch.*got int"):
        policies(3, None)
    with pytest.raises(TypeError, match="RestartPolicy.*got tuple"):
        policies(None, (1.5, 3))


def test_arguments_are_checked_by_kind():
    check_arguments(_objective({"s_rel": 0.0}), RelEntropyState, optax.sgd(0.1), None)
    with pytest.raises(TypeError, match="chemtrain.learn.Objective, got dict"):
        check_arguments({}, DifftreState, optax.sgd(0.1), None)
    with pytest.raises(TypeError, match=r"DifftreState has no field \['s_rel'\]"):
        check_arguments(_objective({"s_rel": 0.0}), DifftreState, optax.sgd(0.1), None)
    with pytest.raises(TypeError, match="optax.GradientTransformation, got function"):
        check_arguments(_objective(), DifftreState, lambda g: g, None)
    with pytest.raises(TypeError, match="on_update must be a function.*got int"):
        check_arguments(_objective(), DifftreState, optax.sgd(0.1), 1)


def test_reuse_counts_of_an_older_state_are_zero():
    state = DifftreState(params={}, opt_state={}, reuses=[2, 1])
    assert reuses_of(state, 4) == [2, 1, 0, 0]
    assert reuses_of(state, 1) == [2]
    assert reuses_of(DifftreState(params={}, opt_state={}), 2) == [0, 0]


def test_a_checkpoint_is_refused_until_the_epoch_completes():
    assert why_not_resumable(3, False, None, "ck") is None
    assert "inside on_update" in why_not_resumable(3, True, None, "ck")
    failed = why_not_resumable(3, False, ("failed", 7), "ck")
    assert "Epoch 3 did not complete (update 7 failed; the error state in 'ck'" in failed
    assert "on_update raised KeyError after update 2" in why_not_resumable(
        3, False, ("callback", 2, "KeyError"), "ck")
    assert "interrupted after 5 updates" in why_not_resumable(3, False, ("interrupted", 5), "ck")
