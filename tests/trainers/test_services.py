"""Trainer services in one process: explicit templates, input checks the
trainer makes, and a failed step whose error state cannot be written.
(Checkpoint folders owned by one run: test_checkpoint.py.)"""
import jax
import numpy as np
import pytest

from builders import trainer
from chemtrain.models import EnergyTemplate, as_template
from chemtrain.trainers import TrainingError


def test_template_attributes_are_refused_not_ignored(problem, tmp_path):
    _, _, template, _ = problem

    def old_style(params):
        return template(params)
    old_style.chek_vma = False  # a typo used to be ignored silently
    with pytest.raises(TypeError, match=r"carries the attribute\(s\) \['chek_vma'\].*EnergyTemplate"):
        trainer(problem, tmp_path, template=old_style)
    wrapped = as_template(EnergyTemplate(template, check_vma=False))
    assert wrapped.check_vma is False and wrapped.fn is template
    with pytest.raises(TypeError, match="must be callable"):
        as_template(3)


def test_negative_gamma_and_positions_dtype(problem, tmp_path):
    data = problem[0]
    with pytest.raises(ValueError, match=r"gammas\['F'\] = -1.0 must be a finite number >= 0"):
        trainer(problem, tmp_path, gammas={"U": 1.0, "F": -1.0})
    tr = trainer(problem, tmp_path)
    with pytest.raises(TypeError, match="float32 positions, but nbrs_init was allocated with "
                                        "float64"):
        tr.set_datasets(dict(data, R=data["R"].astype(np.float32)))


def test_failed_step_still_explains_when_error_state_cannot_be_written(problem, tmp_path):
    data, params, template, nbrs = problem
    small = nbrs.set(idx=nbrs.idx[:, :10], max_occupancy=10)  # overflows on every frame
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the checkpoint folder should be")
    tr = trainer(problem, blocker / "ckpt", nbrs=small)
    tr.set_datasets(data)
    with pytest.raises(TrainingError, match="neighbor list overflowed.*the error state could "
                                            "not be written"):
        tr.train(1)
    for a, b in zip(jax.tree.leaves(tr.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
