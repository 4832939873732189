"""The MD22 benchmark script (examples/mace_jax/benchmark_md22.py).

It runs for two short epochs on a few structures of the committed stand-in,
with a tiny MACE, as a user starts it: single, jax (two CPU devices) and mpi
(two ranks), from the ``.npz`` and from an HDF5 file. The fine-tuning job
(the example is a thin call of ``chemtrain-finetune``) is tested in
``finetune/test_job.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import mp
from mace_ref import small_standin

from paths import EXAMPLES as ALL_EXAMPLES

EXAMPLES = os.path.join(ALL_EXAMPLES, "mace_jax")
BENCHMARK = os.path.join(EXAMPLES, "benchmark_md22.py")
TINY = ["--channels", "4", "--max-ell", "1", "--correlation", "2", "--r-max", "4.0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Ten structures of the stand-in as an MD22 .npz."""
    d = tmp_path_factory.mktemp("md22")
    npz = small_standin(d)
    return {"npz": npz, "dir": d}


# each method once, each source once: the HDF5 file is read by MPI ranks,
# where its parallel loader matters most
@pytest.mark.parametrize("source,runs", [("npz", "single:1,jax:2"),
                                         pytest.param("h5", "mpi:2", marks=pytest.mark.all_cores)])
def test_benchmark_json(data, tmp_path, source, runs):
    out = tmp_path / "bench.json"
    args = [BENCHMARK, "--data", data["npz"], "--runs", runs, "--train", "4",
            "--batch", "2", "--epochs", "2", "--discard", "1", "--json", str(out), *TINY]
    proc = subprocess.run([sys.executable, *args] + (["--hdf5"] if source == "h5" else []),
                          env=mp.env(devices=1), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.load(open(out))
    assert report["config"]["batch"] == 2 and report["config"]["hdf5"] == (source == "h5")
    m = report["machine"]
    assert m["cpu"] and m["cpu_count"] >= 1 and m["versions"]["jax"] and m["versions"]["chemtrain"]
    expected = {(method, int(n)) for method, n in (spec.split(":") for spec in runs.split(","))}
    runs = {(r["method"], r["n_shards"]): r for r in report["runs"]}
    assert set(runs) == expected
    for (method, n), r in runs.items():
        assert len(r["epoch_s_all"]) == 2 and r["epoch_s_kept"] == r["epoch_s_all"][1:]
        assert r["epoch_s_median"] == r["epoch_s_kept"][0] > 0 and r["steps_per_epoch"] == 2
        assert r["structures_per_s"] == pytest.approx(4 / r["epoch_s_median"])
        assert len(r["per_process_epoch_s"]) == r["processes"] == (2 if method == "mpi" else 1)
        # the epoch time is the slowest process's (measured inside train(), so
        # at most what each process measured around it)
        slowest = max(p[1] for p in r["per_process_epoch_s"])
        assert r["slowest_process_epoch_s_median"] == pytest.approx(slowest)
        assert r["epoch_s_kept"][0] <= slowest + 1e-3
        assert r["pairs_max"] <= r["neighbor_capacity"] <= 1.1 * r["pairs_max"] + 1
        assert r["n_atoms"] == 370 and len(r["devices"]) == (2 if method == "jax" else 1)
        assert r["validation_pass_s"] > 0 and r["checkpoint_write_s"] > 0 and r["checkpoint_bytes"] > 0
    for method, n in expected:
        assert f"{method}:{n}  epoch" in proc.stdout
