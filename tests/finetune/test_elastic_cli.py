"""Elastic resume through chemtrain-finetune (issue 50): a fine-tuning run
with --ema and a plateau scheduler on 4 devices (--parallelism jax) is
killed with SIGKILL after its second epoch and continued with
--restart_latest on 1 device, 2 devices and 3 MPI ranks; each ends with the model,
losses and learning-rate factors of the uninterrupted 1-device run."""
import json
import os
import random
import shutil
import subprocess
import sys
import time

import jax
import pytest

import mp
from cu_data import cu_frames
from problems import rel_err

# a global batch of 12: divisible by 4 devices, 1 and 3 ranks
FLAGS = ["--num_channels", "4", "--max_ell", "1", "--correlation", "2", "--r_max", "4.0",
         "--default_dtype", "float64", "--no_torch_export", "--n_train", "24", "--n_valid", "4",
         "--n_test", "4", "--batch_size", "12", "--seed", "1", "--ema", "--ema_decay", "0.5",
         "--scheduler", "ReduceLROnPlateau", "--scheduler_patience", "0", "--lr_factor", "0.5",
         "--checkpoint_every", "1"]
EPOCHS = 4
DRIVER = "import sys, mp; mp.session_compile_cache(); from chemtrain.finetune import run; " \
         "run(sys.argv[1:])"


def job(train, folder, parallelism, epochs=EPOCHS, *extra):
    return ["--train_file", train, "--results_dir", str(folder), "--max_num_epochs",
            str(epochs), *FLAGS, "--parallelism", parallelism, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 1-device run and the 4-device run killed after
    epoch 2 (checkpoints of later epochs removed, so every resume starts at
    epoch 2; its metrics file keeps the lines written after that checkpoint,
    as a kill before the next checkpoint leaves it)."""
    from chemtrain.finetune import run
    d = tmp_path_factory.mktemp("elastic_cli")
    train = str(d / "cu.xyz")
    cu_frames(train, n=32)
    run(job(train, d / "straight", "single"))
    killed = d / "killed"
    # more epochs than the others: it is always still training when killed
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *job(train, killed, "jax", 50)],
                            env=mp.env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    mark = killed / "checkpoints" / "epoch_00002.npz"
    deadline = time.time() + 400
    while not mark.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the 4-device run ended early: {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.3))
    proc.kill()
    text = proc.communicate()[0]
    assert proc.returncode == -9 and "-> jax, 4 shard(s)" in text, text[-3000:]
    for path in (killed / "checkpoints").glob("epoch_*.npz"):
        if int(path.stem.split("_")[1]) > 2:
            path.unlink()
    return {"train": train, "dir": d, "killed": killed, "straight": d / "straight"}


def check_same_run(folder, straight):
    from chemtrain.models import mace
    _, want = mace.load(os.path.join(straight, "model.npz"))
    _, got = mace.load(os.path.join(folder, "model.npz"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(a, b) <= 1e-9
    lines = lambda d: [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]  # noqa
    one, other = lines(straight), lines(folder)
    assert [r["epoch"] for r in other] == [r["epoch"] for r in one] == list(range(EPOCHS))
    for key in ("train_loss", "val_loss", "lr_scale"):
        assert rel_err([r[key] for r in other], [r[key] for r in one]) <= 1e-9, key
    with open(os.path.join(folder, "results.json")) as f, \
            open(os.path.join(straight, "results.json")) as g:
        assert json.load(f)["exported_epoch"] == json.load(g)["exported_epoch"]


def test_killed_on_four_devices_resumes_on_one(runs):
    from chemtrain.finetune import run
    folder = runs["dir"] / "on_one"
    shutil.copytree(runs["killed"], folder)
    run(job(runs["train"], folder, "single", EPOCHS, "--restart_latest"))
    check_same_run(folder, runs["straight"])


def test_killed_on_four_devices_resumes_on_two(runs):
    folder = runs["dir"] / "on_two"
    shutil.copytree(runs["killed"], folder)
    out = subprocess.run([sys.executable, "-c", DRIVER, *job(runs["train"], folder, "jax",
                                                            EPOCHS, "--restart_latest")],
                         env=mp.env(2), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "-> jax, 2 shard(s)" in out.stdout + out.stderr
    check_same_run(folder, runs["straight"])


@pytest.mark.all_cores
def test_killed_on_four_devices_resumes_on_three_ranks(runs):
    folder = runs["dir"] / "on_three"
    shutil.copytree(runs["killed"], folder)
    rc, log, _ = mp.mpirun(3, ["-c", DRIVER, *job(runs["train"], folder, "mpi", EPOCHS,
                                                  "--restart_latest")], timeout=600)
    assert rc == 0, log[-4000:]
    assert "-> mpi, 3 shard(s)" in log and "Resumed from" in log
    check_same_run(folder, runs["straight"])
