"""Elastic resume: a force-matching run and a committee (EMA, plateau
scheduler, bootstrap) trained on 4 devices ('jax') are killed (SIGKILL) at a
random step and continued on 1 device ('single'), 2 devices ('jax'), 3
MPI ranks and 2 jax.distributed processes; each ends where an uninterrupted 1-device run of as many epochs
ends (tests/_support/elastic.py)."""
import json
import os
import random
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import elastic
import mp
from problems import rel_err

SCRIPT = os.path.join(mp.HERE, "elastic.py")
KINDS = ("fm", "committee")


def kill_at_random_step(folder):
    """Start the 4-device run and SIGKILL it at a random moment after both
    trainers wrote their checkpoint of epoch 2."""
    proc = subprocess.Popen([sys.executable, SCRIPT, "--mode", "killable", "--out", str(folder)],
                            env=mp.env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    marks = [folder / kind / "epoch_00002.npz" for kind in KINDS]
    deadline = time.time() + 300
    while not all(m.exists() for m in marks):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the 4-device run ended early: {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.5))
    proc.kill()   # SIGKILL: no handler runs, a checkpoint may be half written
    proc.communicate()
    assert proc.returncode == -9


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("killed")
    kill_at_random_step(folder)
    return folder


_UNINTERRUPTED = {}


def uninterrupted(kind, epochs, folder):
    """The 1-device run of ``epochs`` epochs that never stopped (each
    (kind, epochs) trained once in this module: a run is deterministic)."""
    if (kind, epochs) not in _UNINTERRUPTED:
        tr = elastic.trainer(kind, str(folder))
        tr.train(epochs)
        _UNINTERRUPTED[kind, epochs] = elastic.result(tr)
    return _UNINTERRUPTED[kind, epochs]


def assert_same_run(got, want, rtol=1e-9):
    assert got["epoch"] == want["epoch"]
    for part in ("params", "opt_state"):
        assert len(got[part]) == len(want[part])
        for i, (a, b) in enumerate(zip(got[part], want[part])):
            assert rel_err(a, b) <= rtol, (part, i, rel_err(a, b))
    for part in ("train_losses", "val_losses"):
        assert len(got[part]) == len(want[part]) == want["epoch"]
        assert rel_err(got[part], want[part]) <= rtol, part


@pytest.mark.parametrize("kind", KINDS)
def test_killed_on_four_devices_resumes_on_one_and_two(killed, kind, tmp_path):
    path = elastic.newest(str(killed / kind))
    for n in (1, 2):
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",)) if n > 1 else None
        tr = elastic.trainer(kind, str(tmp_path / f"on{n}"), "jax" if n > 1 else "single", mesh)
        tr.restore(path)
        written = tr.epoch
        assert written >= 2
        tr.train(elastic.MORE)
        got = elastic.result(tr)
        assert got["n_shards"] == n
        assert_same_run(got, uninterrupted(kind, written + elastic.MORE, tmp_path / f"u{n}"))
    # and the resume matters: the run it continued had stopped training
    assert rel_err(got["params"][0], uninterrupted(kind, written, tmp_path / "short")
                   ["params"][0]) > 1e-6


@pytest.mark.all_cores
@pytest.mark.parametrize("launch", ["mpi", "jax.distributed"])
def test_killed_on_four_devices_resumes_on_other_processes(killed, tmp_path, launch):
    """3 MPI ranks; 2 jax.distributed processes of 1 device each."""
    args = [SCRIPT, "--mode", "resume", "--out", str(tmp_path), "--from", str(killed)]
    if launch == "mpi":
        n, (rc, log, _) = 3, mp.mpirun(3, args, timeout=600)
    else:
        n, (codes, log) = 2, mp.distributed(2, args[1:], timeout=600, script="elastic.py")
        rc = max(codes)
    assert rc == 0, log[-4000:]
    for kind in KINDS:
        ranks = [json.loads((tmp_path / f"{kind}_{r}.json").read_text())
                 for r in range(n)]
        assert all(r == ranks[0] for r in ranks[1:])
        assert ranks[0]["n_shards"] == n
        want = uninterrupted(kind, ranks[0]["epoch"], tmp_path / f"u_{kind}")
        assert_same_run(ranks[0], want)
