"""MPI ranks (mpirun) and jax.distributed processes: equivalence with one
device, state broadcast, 'auto' selection, laziness, failures, bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mp
from problems import lj_fluid


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data, box, _ = lj_fluid()
    path = tmp_path_factory.mktemp("mp") / "data.npz"
    np.savez(path, R=data["R"], U=data["U"], F=data["F"], R0=data["R"][0], box=box)
    return str(path)


def check_run(out_dir, reference, n_procs):
    final = dict(np.load(os.path.join(out_dir, "final.npz")))
    ref, train_losses, val_losses, init = reference
    assert set(final) == set(ref)
    for k in ref:
        rel = np.max(np.abs(final[k] - ref[k])) / np.max(np.abs(ref[k]))
        assert rel < 1e-6, (k, rel)
    losses = json.load(open(os.path.join(out_dir, "losses.json")))
    assert losses["step"] == 10
    np.testing.assert_allclose(losses["train"], train_losses, rtol=1e-6)
    np.testing.assert_allclose(losses["val"], val_losses, rtol=1e-6)
    # every process held the root's parameters and optimizer state after construction,
    # although each built its own from another seed (--rank-init)
    inits = [dict(np.load(os.path.join(out_dir, f"init_{i}.npz"))) for i in range(n_procs)]
    for other in inits[1:]:
        assert set(other) == set(inits[0])
        for k in inits[0]:
            np.testing.assert_array_equal(other[k], inits[0][k], err_msg=k)
    import jax
    leaf = np.asarray(jax.tree.leaves(init)[0])
    assert np.array_equal(inits[0][next(k for k in inits[0] if k.startswith("['params']"))], leaf)


def test_mpi_two_ranks_match_single(data_file, reference, tmp_path):
    rc, out, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_run.py"), "--data", data_file,
                               "--out", str(tmp_path), "--parallelism", "mpi", "--rank-init"])
    assert rc == 0, out[-4000:]
    assert strategies(tmp_path, 2) == ["mpi 2", "mpi 2"]
    check_run(tmp_path, reference, 2)


@pytest.mark.parametrize("devices", [1, 2])
def test_jax_distributed_two_processes_match_single(data_file, reference, tmp_path, devices):
    codes, out = mp.distributed(2, ["--data", data_file, "--out", str(tmp_path),
                                    "--parallelism", "jax", "--rank-init"], devices=devices)
    assert codes == [0, 0], out[-4000:]
    assert strategies(tmp_path, 2) == [f"jax {2 * devices}"] * 2
    check_run(tmp_path, reference, 2)


def strategies(out_dir, n, name="strategy"):
    """What each process wrote (one file each: ranks share one stdout)."""
    return [(out_dir / f"{name}_{i}.txt").read_text() for i in range(n)]


def test_auto_selection(data_file, tmp_path):
    script = os.path.join(mp.HERE, "mp_run.py")
    for case, launch in [("single", 1), ("jax", 2), ("mpi", "mpirun"), ("jax-dist", "dist")]:
        out_dir = tmp_path / case
        out_dir.mkdir()
        args = ["--data", data_file, "--out", str(out_dir), "--report-only"]
        if launch == "mpirun":
            rc, out, _ = mp.mpirun(2, [script, *args])
            assert rc == 0, out[-2000:]
            assert strategies(out_dir, 2, "resolved") == ["mpi", "mpi"]
        elif launch == "dist":
            codes, out = mp.distributed(2, args)
            assert codes == [0, 0], out[-2000:]
            assert strategies(out_dir, 2, "resolved") == ["jax", "jax"]
        else:
            out = subprocess.run([sys.executable, script, *args], env=mp.env(launch),
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
            assert strategies(out_dir, 1, "resolved") == [case]


def test_mixing_mpi_and_jax_distributed_is_an_error(data_file, tmp_path):
    rc, out, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_run.py"), "--data", data_file,
                               "--out", str(tmp_path), "--report-only", "--distributed-mpi"])
    assert rc != 0
    assert "Both jax.distributed (2 processes) and MPI (2 ranks) are active" in out


def test_failure_on_one_rank_stops_all(data_file, tmp_path):
    import time
    rc, out, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_run.py"), "--data", data_file,
                               "--out", str(tmp_path), "--parallelism", "mpi",
                               "--fail-rank", "1"], timeout=300)
    seconds = time.time() - float((tmp_path / "fail_time_1.txt").read_text())
    assert rc != 0
    assert "OSError: simulated read failure on process 1" in out
    assert "DONE" not in out
    assert seconds < 60, seconds  # from the failure to the end of mpirun


def test_consistency_check_names_the_diverged_leaf(data_file, tmp_path):
    rc, out, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_run.py"), "--data", data_file,
                               "--out", str(tmp_path), "--parallelism", "mpi", "--diverge"])
    assert rc != 0
    assert "Replicas diverged after step 5" in out
    assert "['params']['layers'][1]['w'] differs between process" in out
    assert "DONE" not in out


def test_rank_with_two_devices(data_file, tmp_path):
    rc, out, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_run.py"), "--data", data_file,
                               "--out", str(tmp_path), "--parallelism", "mpi"], devices=2)
    assert rc != 0 and "sees 2 JAX devices" in out and "CUDA_VISIBLE_DEVICES" in out


def test_batch_not_divisible_by_ranks(data_file, tmp_path):
    rc, out, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_run.py"), "--data", data_file,
                               "--out", str(tmp_path), "--parallelism", "mpi", "--batch", "3"])
    assert rc != 0 and "batch=3 is not divisible by the number of shards (2, parallelism='mpi')" in out


def fake_package(root, name, message):
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise ImportError({message!r})\n")
    return str(root)


def test_mpi_without_mpi4jax_or_mpi4py(data_file, tmp_path):
    script = [os.path.join(mp.HERE, "mp_run.py"), "--data", data_file, "--out", str(tmp_path),
              "--parallelism", "mpi"]
    broken = fake_package(tmp_path / "no_mpi4jax", "mpi4jax", "simulated broken mpi4jax build")
    rc, out, _ = mp.mpirun(2, script, PYTHONPATH=os.pathsep.join([broken, mp.HERE]))
    assert rc != 0 and "needs the package mpi4jax" in out and "pip install 'chemtrain[mpi]'" in out
    no_mpi4py = fake_package(tmp_path / "no_mpi4py", "mpi4py", "simulated missing mpi4py")
    out = subprocess.run([sys.executable, *script],
                         env=mp.env(1, PYTHONPATH=os.pathsep.join([no_mpi4py, mp.HERE])),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "needs the package mpi4py" in out.stderr
    assert "pip install 'chemtrain[mpi]'" in out.stderr


@pytest.mark.parametrize("parallelism,devices", [("single", 1), ("jax", 2), ("auto", 1)])
def test_training_without_mpi_modules(data_file, tmp_path, parallelism, devices):
    """Single and jax training import neither mpi4py nor mpi4jax, and still
    run when mpi4jax is broken."""
    broken = fake_package(tmp_path / "fake", "mpi4jax", "simulated broken mpi4jax build")
    out = subprocess.run([sys.executable, os.path.join(mp.HERE, "mp_run.py"), "--data", data_file,
                          "--out", str(tmp_path), "--parallelism", parallelism, "--check-no-mpi"],
                         env=mp.env(devices, PYTHONPATH=os.pathsep.join([broken, mp.HERE])),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DONE 0" in out.stdout


# -- failures end every process; errors raised together keep their class --------------
def run_case(case, data_file, tmp_path, n=2, timeout=300, parallelism="mpi", **files):
    """(return code, output, seconds from the failure to the end of mpirun);
    upper-case ``files`` keys are environment variables of the ranks."""
    import time
    env = {k: v for k, v in files.items() if k.isupper()}
    extra = [x for k, v in files.items() if not k.isupper()
             for x in (f"--{k.replace('_', '-')}", v)]
    rc, out, _ = mp.mpirun(n, [os.path.join(mp.HERE, "mp_failures.py"), "--case", case, "--data",
                               data_file, "--out", str(tmp_path), "--parallelism", parallelism,
                               *extra], timeout=timeout, **env)
    ended = time.time()
    failed = [float(p.read_text()) for p in tmp_path.glob("fail_time_*.txt")]
    return rc, out, ended - min(failed) if failed else None


def errors(tmp_path, n=2):
    return [(tmp_path / f"error_{i}.txt").read_text() if (tmp_path / f"error_{i}.txt").exists()
            else "" for i in range(n)]


def write_h5(path, data, rows):
    import h5py
    with h5py.File(path, "w") as f:
        for k in ("R", "U", "F"):
            f[k] = data[k][:rows]
    return str(path)


def test_rank_raising_between_train_calls_ends_all(data_file, tmp_path):
    rc, out, seconds = run_case("between", data_file, tmp_path)
    assert rc != 0
    assert "RuntimeError: user code failed between train() calls on process 1" in out
    assert "FINISHED-NORMALLY" not in out and seconds < 60, seconds


def test_hdf5_missing_on_one_rank_or_differing_ends_all(data_file, tmp_path):
    with np.load(data_file) as z:
        data = {k: z[k] for k in ("R", "U", "F")}
    a, b = write_h5(tmp_path / "a.h5", data, 24), write_h5(tmp_path / "b.h5", data, 20)
    (tmp_path / "missing").mkdir()
    rc, out, seconds = run_case("missing_h5", data_file, tmp_path / "missing", h5=a)
    assert rc != 0 and "FileNotFoundError" in out and "no_such_file.h5" in out
    assert "FINISHED-NORMALLY" not in out and seconds < 60, seconds
    (tmp_path / "differ").mkdir()
    rc, out, seconds = run_case("differing_h5", data_file, tmp_path / "differ", h5=a, h5_other=b)
    assert rc != 0 and "FINISHED-NORMALLY" not in out and seconds < 60, seconds
    for err in errors(tmp_path / "differ"):  # every rank raised the same error
        assert "ValueError: The processes of this run disagree on the HDF5 file" in err, err


def test_root_error_keeps_its_class_on_every_rank(data_file, tmp_path):
    rc, out, _ = run_case("root_error", data_file, tmp_path)
    assert rc == 0, out[-3000:]
    for err in errors(tmp_path):
        assert err.startswith("UnknownElementError: atomic number 99"), err


def test_restore_checks_ranks_agree_and_reads_on_root(data_file, tmp_path):
    rc, out, _ = run_case("restore", data_file, tmp_path)
    assert rc == 0, out[-3000:]
    for err in errors(tmp_path):
        first, second = err.strip().split("\n")
        assert first.startswith("ValueError: The processes of this run disagree on the "
                                "checkpoint to restore"), first
        assert second.startswith("CheckpointNotFoundError") and "missing.npz" in second, second


@pytest.mark.parametrize("linger", ["0", "3"])
def test_rank_whose_script_ends_does_not_leave_the_others_waiting(data_file, tmp_path, linger):
    """Process 1 leaves after one epoch (no error: its script just ends);
    process 0 trains on and would wait forever in its next collective. It
    is ended, with both ranks named, soon after the grace period.

    With ``linger``, process 1 ends only after process 0 has entered its
    next train() and sent process 1 a message. Finalizing MPI with that
    message unread used to fail, and mpirun then killed process 0 without a
    word and returned 0 (it happened at random under load without linger)."""
    rc, out, seconds = run_case("early_exit", data_file, tmp_path,
                                CHEMTRAIN_PEER_EXIT_GRACE_S="3", EARLY_EXIT_LINGER_S=linger)
    assert "PROCESS-1-ENDS" in out
    assert rc != 0 and "FINISHED-NORMALLY 0" not in out, (rc, out[-3000:])
    assert "process(es) [1] of this run ended" in out and "while process 0 is still" in out
    assert seconds < 60, seconds


def test_two_single_runs_under_mpirun_do_not_share_a_checkpoint_folder(data_file, tmp_path):
    """parallelism='single' under mpirun -np 2: two independent runs started
    together into one checkpoint folder. The folder is claimed atomically:
    one run trains and checkpoints, the other is refused before writing."""
    import glob
    from chemtrain.trainers.checkpoints import read_run_id
    rc, out, _ = run_case("single_race", data_file, tmp_path, parallelism="single")
    assert rc == 0, out[-3000:]
    errs = errors(tmp_path)
    refused = [e for e in errs if "already holds checkpoints of another run" in e]
    assert len(refused) == 1 and sum(e == "" for e in errs) == 1, errs
    runs = {read_run_id(p) for p in glob.glob(str(tmp_path / "ckpt" / "epoch_*.npz"))}
    assert len(runs) == 1 and None not in runs, runs


def test_jax_distributed_failure_ends_both(data_file, tmp_path):
    import time
    codes, out = mp.distributed(2, ["--data", data_file, "--out", str(tmp_path),
                                    "--parallelism", "jax", "--fail-rank", "1"], timeout=300)
    seconds = time.time() - float((tmp_path / "fail_time_1.txt").read_text())
    assert all(c != 0 for c in codes), (codes, out[-3000:])
    assert "OSError: simulated read failure on process 1" in out
    assert "another process failed" in out  # process 0 was told, not timed out
    assert "DONE" not in out and seconds < 120, seconds
