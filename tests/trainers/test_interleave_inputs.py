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
from chemtrain.trainers import InterleaveTrainers, RunOptions
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
    empty = InterleaveTrainers(str(tmp_path / "f"), options=RunOptions(progress=False))
    with pytest.raises(RuntimeError, match=r"add_trainer"):
        empty.train(1)
    with pytest.raises(RuntimeError, match=r"add_trainer"):
        empty.strategy   # noqa: B018


def test_add_trainer_takes_only_trainers(tmp_path):
    """The Trainer protocol: an object without a trainer's members is refused
    by name (ForceMatching and RelativeEntropy pass it in every fused run:
    tests/_support/fused_systems.py)."""
    from chemtrain.trainers.protocol import MEMBERS, missing_members

    class Half:
        params, history, epoch = {}, [], 0

        def train(self, max_epochs, checkpoint_freq=None):
            pass
    fused = InterleaveTrainers(str(tmp_path / "f"), options=RunOptions(progress=False))
    with pytest.raises(TypeError, match=r"Trainer protocol\); Half has no 'save_checkpoint'"):
        fused.add_trainer(Half())
    assert missing_members(Half()) == ["save_checkpoint", "restore", "strategy", "store"]
    assert set(MEMBERS) == {"params", "train", "save_checkpoint", "restore", "history", "epoch",
                            "strategy", "store"}


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


# -- a failed restore, unwritable outputs and whose turn failed -----------------
def test_a_failed_restore_leaves_no_trainer_restored(run, tmp_path):
    """The second trainer's file does not fit (RE built with two state
    points, the checkpoint has one): before, the first was already restored
    and the set was half restored."""
    import numpy as np
    resumed, fm, re_trainer = fused(str(tmp_path), kTs=(2.56, 3.0))
    params, run_id = jax.tree.map(np.asarray, fm.params), fm.store.run_id
    with pytest.raises(CheckpointError, match=r"n_statepoints=1, .*; this run has .*n_statepoints=2"):
        resumed.restore(os.path.join(run, "epoch_00002"))
    assert (fm.epoch, re_trainer.epoch, resumed.epoch) == (0, 0, 0)
    assert fm.store.run_id == run_id
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fm.params), params)


@pytest.mark.parametrize("case", ["checkpoints_in_a_file", "plot_in_a_missing_folder",
                                  "unwritable_checkpoints"])
def test_outputs_that_cannot_be_written_are_refused_before_training(tmp_path, case):
    """Before, these failed only after a fused epoch had trained."""
    import tempfile
    options = {}
    if case == "checkpoints_in_a_file":
        (tmp_path / "fused").write_text("not a folder")
        expected = r"checkpoint_base_path .*fused' is a file, not a folder"
    elif case == "plot_in_a_missing_folder":
        options["plot_file"] = str(tmp_path / "missing" / "loss.png")
        expected = r"plot_file .*loss.png' is in the folder .*missing', which does not exist"
    else:
        try:
            tempfile.TemporaryFile(dir="/sys").close()
            pytest.skip("no folder here refuses writes by root")
        except OSError:
            pass
        expected = r"checkpoint_base_path '/sys/.*' cannot be written"
    together, fm, _ = fused(str(tmp_path), **options)
    if case == "unwritable_checkpoints":
        together.folder = together.store.folder = "/sys/chemtrain_fused"
    with pytest.raises(ValueError, match=expected + r".*Nothing was trained"):
        together.train(1, checkpoint_freq=1)
    assert fm.epoch == 0 and together.epoch == 0


def test_a_failed_turn_names_whose_parameters_it_started_from(tmp_path):
    """A failure in one trainer's turn used to read as that trainer's own
    problem even when the parameters it was handed came from the other."""
    import numpy as np
    import optax
    from chemtrain.trainers import ForceMatching
    from chemtrain.trainers import TrainingError
    from fused_systems import ex, labelled_frames
    # FM whose optimizer gives NaN: its step 0 is refused, naming the optimizer
    together, fm, re_trainer = fused(str(tmp_path / "a"))
    data, nbrs = labelled_frames(re_trainer)
    bad = ForceMatching(fm.params, optax.scale(float("nan")),
                        re_trainer.statepoints[0].fns.energy_fn_template, nbrs, batch=8,
                        checkpoint_path=str(tmp_path / "a" / "bad_fm"),
                        options=RunOptions(progress=False))
    bad.set_dataset(data, "training")
    first = InterleaveTrainers(str(tmp_path / "a" / "f"), options=RunOptions(progress=False))
    first.add_trainer(bad, 1, "FM")
    first.add_trainer(re_trainer, 1, "RE")
    with pytest.raises(TrainingError, match=r"optimizer's update gives non-finite parameters or "
                                            r"optimizer state in step 0 of epoch 0") as e:
        first.train(1)
    assert "in 'FM''s turn of fused epoch 0, which started from the initial parameters" \
        in " ".join(e.value.__notes__)
    assert all(np.isfinite(np.asarray(v)) for v in jax.tree.leaves(bad.params))
    # RE whose update overflows, after FM's turn: its note names FM's parameters
    re_bad, _ = ex.bond_trainer(0, updates=4, frames=40, production=2.0, progress=False,
                                optimizer=optax.chain(optax.scale(1e200), optax.adam(1e-3)),
                                checkpoint_path=str(tmp_path / "b" / "re"), sim_batch_size=-1)
    good = ForceMatching(fm.params, optax.adam(0.01), re_bad.statepoints[0].fns.energy_fn_template,
                         nbrs, batch=8, checkpoint_path=str(tmp_path / "b" / "fm"),
                         options=RunOptions(progress=False))
    good.set_dataset(data, "training")
    second = InterleaveTrainers(str(tmp_path / "b" / "f"), options=RunOptions(progress=False))
    second.add_trainer(good, 1, "FM")
    second.add_trainer(re_bad, 1, "RE")
    with pytest.raises(TrainingError, match=r"optimizer state in update 0") as e:
        second.train(1)
    assert "in 'RE''s turn of fused epoch 0, which started from the parameters 'FM''s turn " \
           "handed on" in " ".join(e.value.__notes__)
