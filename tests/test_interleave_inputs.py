"""InterleaveTrainers on bad input (issue 37): nothing written over, no
mixed checkpoint restored, no rank left waiting. One 3-epoch fused run
(tests/_support/fused_systems.py) with a checkpoint per epoch serves every
case; cases that change files work on copies of its folder."""
import hashlib
import json
import os
import shutil

import jax
import pytest

import mp
from chemtrain.checkpoint import CheckpointError
from chemtrain.trainers import InterleaveTrainers
from fused_systems import fused


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The folder of a 3-epoch fused run checkpointed after every epoch."""
    root = tmp_path_factory.mktemp("fused_run")
    with jax.enable_x64(True):
        full, _, _ = fused(str(root))
        full.train(3, checkpoint_freq=1)
    return os.path.join(str(root), "fused")


def digest(folder):
    """name -> sha256 of every file below ``folder``."""
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(base, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_train_before_add_trainer_is_a_clear_error(tmp_path):
    empty = InterleaveTrainers(str(tmp_path / "f"), progress=False)
    with pytest.raises(RuntimeError, match=r"add_trainer"):
        empty.train(1)
    with pytest.raises(RuntimeError, match=r"add_trainer"):
        empty.strategy   # noqa: B018


def test_training_on_from_an_earlier_epoch_refuses_to_write_over_later_ones(run, tmp_path):
    folder = str(tmp_path / "fused")
    shutil.copytree(run, folder)   # fused(tmp_path) checkpoints into tmp_path/fused
    before = digest(folder)
    resumed, _, _ = fused(str(tmp_path))
    resumed.restore(os.path.join(folder, "epoch_00001"))
    with pytest.raises(CheckpointError, match=r"after epoch 1 \(epoch_00002, epoch_00003\)"):
        resumed.train(1, checkpoint_freq=1)
    assert digest(folder) == before   # the refusal came before any epoch was trained
    assert resumed.epoch == 1


def test_a_mixed_folder_is_refused(run, tmp_path):
    mixed = str(tmp_path / "mixed")
    shutil.copytree(os.path.join(run, "epoch_00002"), mixed)
    # the state a kill leaves if a new FM.npz lands beside the old RE.npz and fused.npz
    shutil.copy(os.path.join(run, "epoch_00003", "FM.npz"), os.path.join(mixed, "FM.npz"))
    other, fm, _ = fused(str(tmp_path / "o"))
    with pytest.raises(CheckpointError, match=r"FM.npz' is not the file .*epoch 2.*epoch 3"):
        other.restore(mixed)
    assert fm.epoch == 0   # no trainer was restored


def test_an_interrupted_save_leaves_an_incomplete_folder(run, tmp_path):
    folder = str(tmp_path / "fused")
    shutil.copytree(run, folder)
    resumed, _, re_trainer = fused(str(tmp_path / "o"))
    resumed.restore(os.path.join(folder, "epoch_00003"))
    target = os.path.join(folder, "epoch_00003")

    def broken(path):   # the disk fills while the second trainer's file is written
        raise OSError(28, "No space left on device")
    re_trainer.save_checkpoint = broken
    with pytest.raises(OSError):
        resumed.save_checkpoint(target)
    assert not os.path.exists(os.path.join(target, "fused.npz"))
    again, _, _ = fused(str(tmp_path / "p"))
    with pytest.raises(CheckpointError, match="fused.npz is missing"):
        again.restore(target)


def test_save_checkpoint_onto_another_runs_folder_is_refused(run, tmp_path):
    folder = str(tmp_path / "fused")
    shutil.copytree(run, folder)
    before = digest(folder)
    other, fm, _ = fused(str(tmp_path / "o"))
    other.train(1)
    with pytest.raises(CheckpointError, match=r"another run"):
        other.save_checkpoint(os.path.join(folder, "epoch_00001"))
    with pytest.raises(CheckpointError, match=r"another run"):   # a single trainer too
        fm.save_checkpoint(os.path.join(folder, "epoch_00001", "FM.npz"))
    with pytest.raises(CheckpointError, match=r"is a file"):
        other.save_checkpoint(os.path.join(folder, "epoch_00001", "FM.npz"))
    assert digest(folder) == before
    # its own folder may be saved again (same run)
    other.save_checkpoint(str(tmp_path / "mine"))
    other.save_checkpoint(str(tmp_path / "mine"))
    assert os.path.exists(tmp_path / "mine" / "fused.npz")


@pytest.mark.parametrize("case", ["num_updates", "order"])
def test_ranks_that_disagree_on_the_turns_all_stop(tmp_path, case):
    """mpirun -np 2 where rank 1 adds a trainer with another num_updates, or
    the trainers in the other order: before, both ranks waited for ever."""
    out = tmp_path / case
    out.mkdir()
    rc, log, seconds = mp.mpirun(2, [os.path.join(mp.HERE, "mp_fused.py"), "--out", str(out),
                                     "--disagree", case], timeout=240)
    assert rc == 0, log[-4000:]
    for rank in range(2):
        got = json.loads((out / f"disagree_{rank}.json").read_text())
        assert got["error"] == "ValueError", got
        assert "disagree on the InterleaveTrainers turns" in got["message"], got
        assert "RE" in got["message"] and "FM" in got["message"], got
