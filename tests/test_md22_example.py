"""The MD22 example scripts (examples/mace_jax): fine-tuning and benchmark.

Both scripts run for one short epoch on a few structures of the committed
stand-in, with a tiny MACE, as a user starts them: single and jax (two CPU
devices) in one subprocess, mpi on two ranks under mpirun, each from the
``.npz`` and from an HDF5 file made by the converter. To share start-up, one
process runs several jobs in a row (``main(argv)`` once per job). The checks
read what the scripts print and write, and recompute the fine-tuned test
errors independently from the saved model and the raw data.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mp

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples", "mace_jax")
STANDIN = os.path.join(EXAMPLES, "nanotube_standin.npz")
BENCHMARK = os.path.join(EXAMPLES, "benchmark_md22.py")
TINY = ["--channels", "4", "--max-ell", "1", "--correlation", "2", "--r-max", "4.0"]
SPLIT = ["--train", "4", "--valid", "2", "--test", "2", "--batch", "2"]
MAE_LINE = re.compile(r"Test MAE, (.+?): energy ([0-9.]+) eV/atom \(RMSE ([0-9.]+)\), "
                      r"forces ([0-9.]+) eV/A \(RMSE ([0-9.]+)\)")
EV = 96.48533212   # kJ/mol
KCAL = 4.184       # kJ/mol
# several jobs in one process; the root prints a marker before each
DRIVER = """
import os, sys, json
sys.path.insert(0, {examples!r})
import finetune_md22
root = os.environ.get("PMI_RANK", "0") == "0"
for name, argv in json.loads(sys.argv[1]):
    if root:
        print(f"=== job {{name}} ===", flush=True)
    finetune_md22.main(argv)
    sys.stdout.flush()
""".format(examples=EXAMPLES)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Ten structures of the stand-in as an MD22 .npz and as chemtrain HDF5."""
    from chemtrain.data.convert import convert
    d = tmp_path_factory.mktemp("md22")
    full = np.load(STANDIN)
    npz = str(d / "small.npz")
    np.savez(npz, **{k: (full[k][:10] if k in ("R", "E", "F") else full[k]) for k in full.files})
    h5 = str(d / "small.h5")
    convert(npz, h5, progress=False)
    return {"npz": npz, "h5": h5, "dir": d}


def job(data, name, source, method, *extra, epochs=1, out=None):
    """(name, argv) of one fine-tuning job; ``out`` defaults to a folder named ``name``."""
    out = str(data["dir"] / (out or name))
    return name, ["--data", data[source], "--parallelism", method, "--out", out,
                  "--epochs", str(epochs), *SPLIT, *TINY, *extra]


def run_jobs(jobs, method, timeout=1200):
    """Run ``[(name, argv), ...]`` in one process (mpi: on two ranks); return
    {name: what the job printed}."""
    args = ["-c", DRIVER, json.dumps(jobs)]
    if method == "mpi":
        code, text, _ = mp.mpirun(2, args, devices=1, timeout=timeout)
    else:
        out = subprocess.run([sys.executable, *args], env=mp.env(devices=2), capture_output=True,
                             text=True, timeout=timeout)
        code, text = out.returncode, out.stdout + out.stderr
    assert code == 0, text[-4000:]
    parts = re.split(r"=== job (\S+) ===\n", text)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def foundation(data):
    """A tiny random mace-torch model (H, C, O) saved as a .model file."""
    import mace  # noqa: F401  (before e3nn)
    import torch
    from e3nn import o3
    from mace import modules
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    model = modules.ScaleShiftMACE(
        r_max=4.0, num_bessel=8, num_polynomial_cutoff=5, max_ell=1, interaction_cls=block,
        interaction_cls_first=block, num_interactions=2, num_elements=3,
        hidden_irreps=o3.Irreps("4x0e"), MLP_irreps=o3.Irreps("8x0e"),
        atomic_energies=np.array([-1.0, -2.0, -3.0]), avg_num_neighbors=10.0,
        atomic_numbers=[1, 6, 8], correlation=2, gate=torch.nn.functional.silu,
        radial_MLP=[8, 8], atomic_inter_scale=1.0, atomic_inter_shift=0.0)
    path = str(data["dir"] / "foundation.model")
    torch.save(model, path)
    return path


@pytest.fixture(scope="module")
def local_outputs(data, foundation):
    """single and jax (two CPU devices) in one process, from .npz and HDF5,
    and a second single job that resumes the first; they share JAX's
    compilation cache."""
    cache = ["--jax-cache", str(data["dir"] / "jax_cache")]
    return run_jobs([job(data, "npz_single", "npz", "single", *cache),
                     job(data, "npz_single_resumed", "npz", "single", "--resume", *cache, epochs=2,
                         out="npz_single"),
                     job(data, "h5_single", "h5", "single", *cache),
                     job(data, "npz_jax", "npz", "jax", *cache),
                     job(data, "h5_jax", "h5", "jax", *cache),
                     job(data, "npz_foundation", "npz", "single", "--foundation", foundation,
                         "--trust-foundation")],
                    "local")


@pytest.fixture(scope="module")
def mpi_outputs(data):
    """mpi on two ranks, from .npz and HDF5, in one mpirun."""
    return run_jobs([job(data, "npz_mpi", "npz", "mpi"), job(data, "h5_mpi", "h5", "mpi")], "mpi")


_ENERGY_FORCES = {}


def independent_errors(out_dir, data_path):
    """Test-set MAEs of the saved model computed here, in float64, from the
    model file and the raw MD22-format data (not with the example's code):
    energies in eV/atom, forces in eV/A."""
    import jax
    import jax.numpy as jnp
    from jax_md import partition, space
    from chemtrain.models import mace
    results = json.load(open(os.path.join(out_dir, "results.json")))
    cfg, params = mace.load(os.path.join(out_dir, "model.npz"))
    raw = np.load(data_path)
    rows = np.asarray(results["test_rows"])
    R = jnp.asarray(raw["R"][rows] / 10.0, jnp.float64)          # Angstrom -> nm
    E_ref = raw["E"].reshape(-1)[rows] * KCAL / EV                # kcal/mol -> eV
    F_ref = raw["F"][rows] * KCAL / EV                            # kcal/mol/A -> eV/A
    key = cfg.to_json()
    if key not in _ENERGY_FORCES:
        disp, _ = space.free()
        nbrs = partition.neighbor_list(disp, 100.0, cfg.r_max / 10, format=partition.Sparse,
                                       disable_cell_list=True).allocate(R[0], extra_capacity=20)
        template = mace.energy_fn_template(cfg, disp)
        species = jnp.asarray(raw["z"])
        _ENERGY_FORCES[key] = jax.jit(lambda p, r: jax.value_and_grad(
            lambda x: template(p)(x, nbrs.update(x), species=species))(r))
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params)
    E, F = zip(*[_ENERGY_FORCES[key](params, r) for r in R])
    E = np.array(E) / EV                                          # kJ/mol -> eV
    F = -np.stack(F) / EV / 10.0                                  # kJ/mol/nm -> eV/A
    n_atoms = R.shape[1]
    return float(np.mean(np.abs(E - E_ref))) / n_atoms, float(np.mean(np.abs(F - F_ref))), results


def check_job(text, out_dir, data_path, method, n_shards, epochs=1):
    """Printed MAEs (once, by the root), plot, checkpoint, results file; the
    fine-tuned MAEs agree with an independent computation."""
    lines = MAE_LINE.findall(text)
    assert len(lines) == 2, text[-3000:]
    (start, *before), (final, *after) = lines
    assert final == f"fine-tuned (epoch {epochs})", final
    before, after = [float(x) for x in before], [float(x) for x in after]
    assert np.all(np.isfinite(before + after)) and after != before
    with open(os.path.join(out_dir, "parity.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"Parity plot: {os.path.join(out_dir, 'parity.png')}" in text
    assert os.path.exists(os.path.join(out_dir, "checkpoints", f"epoch_{epochs:05d}.npz"))
    e_mae, f_mae, results = independent_errors(out_dir, data_path)
    assert results["parallelism"] == method and results["n_shards"] == n_shards
    assert results["epoch"] == epochs and results["n_test"] == 2
    # printed with 5 (energy) and 4 (force) decimals, from float32 training
    assert abs(after[0] - e_mae) <= 1e-5 + 1e-3 * e_mae, (after, e_mae)
    assert abs(after[2] - f_mae) <= 1e-4 + 1e-3 * f_mae, (after, f_mae)
    assert results["after"]["force_eV_per_A"]["MAE"] == pytest.approx(f_mae, rel=1e-3)
    assert f"-> {method}, {n_shards} shard(s)" in text
    return start


# ------------------------------------------------------------------ fine-tuning

@pytest.mark.parametrize("name,source,method,n_shards", [
    ("npz_single", "npz", "single", 1), ("h5_single", "h5", "single", 1),
    ("npz_jax", "npz", "jax", 2), ("h5_jax", "h5", "jax", 2)])
def test_finetune_single_and_jax(data, local_outputs, name, source, method, n_shards):
    text = local_outputs[name]
    if name == "npz_single":  # its folder now holds the resumed run (test_finetune_resume)
        assert "Test MAE, fine-tuned (epoch 1)" in text and "Parity plot:" in text
    else:
        assert check_job(text, str(data["dir"] / name), data["npz"], method, n_shards) == "starting model"
    assert "No --foundation: starting from a randomly initialised MACE" in text


def test_finetune_resume(data, local_outputs):
    """The second job continued the first one's run: it restored epoch 1,
    trained epoch 2, and the metrics file holds both epochs."""
    first, resumed = local_outputs["npz_single"], local_outputs["npz_single_resumed"]
    out = data["dir"] / "npz_single"
    assert "Test MAE, fine-tuned (epoch 1)" in first
    assert f"Resumed from {out / 'checkpoints' / 'epoch_00001.npz'} (epoch 1)" in resumed
    assert MAE_LINE.findall(resumed)[0][0] == "restored model (epoch 1)"
    check_job(resumed, str(out), data["npz"], "single", 1, epochs=2)
    # the restored model is the one the first job ended with
    ended = MAE_LINE.findall(first)[1][1:]
    restored = MAE_LINE.findall(resumed)[0][1:]
    assert ended == restored
    history = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [h["epoch"] for h in history] == [0, 1]


def test_finetune_foundation(data, local_outputs, foundation):
    """--foundation: a mace-torch file is converted and trained; E0s of the
    elements in the data are refitted, the others kept."""
    text = local_outputs["npz_foundation"]
    assert f"Fine-tuning {foundation}:" in text and "No --foundation" not in text
    out = str(data["dir"] / "npz_foundation")
    assert check_job(text, out, data["npz"], "single", 1) == "starting model"
    from chemtrain.models import mace
    cfg, _ = mace.load(os.path.join(out, "model.npz"))
    assert cfg.atomic_numbers == (1, 6, 8) and cfg.r_max == 4.0
    assert cfg.atomic_energies[2] == -3.0                       # oxygen: not in the data
    assert cfg.atomic_energies[:2] != (-1.0, -2.0)              # H, C: refitted


@pytest.mark.parametrize("name", ["npz_mpi", "h5_mpi"])
def test_finetune_mpi(data, mpi_outputs, name):
    check_job(mpi_outputs[name], str(data["dir"] / name), data["npz"], "mpi", 2)


def test_finetune_refuses_bad_input(data, tmp_path):
    sys.path.insert(0, EXAMPLES)
    import finetune_md22
    with pytest.raises(SystemExit, match=r"--train 8 \+ --valid 2 \+ --test 2 = 12 structures, "
                                         r"but .*small.npz holds 10"):
        finetune_md22.main(["--data", data["npz"], "--train", "8", "--valid", "2", "--test", "2",
                            "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="missing.npz does not exist"):
        finetune_md22.main(["--data", str(tmp_path / "missing.npz"), "--out", str(tmp_path / "b")])
    (tmp_path / "c" / "checkpoints").mkdir(parents=True)
    (tmp_path / "c" / "checkpoints" / "epoch_00001.npz").write_bytes(b"")
    with pytest.raises(SystemExit, match="holds checkpoints of an earlier run .*--resume"):
        finetune_md22.main(["--data", data["npz"], "--out", str(tmp_path / "c"), *SPLIT])
    with pytest.raises(SystemExit, match="--resume: no checkpoint"):
        finetune_md22.main(["--data", data["npz"], "--out", str(tmp_path / "d"), "--resume", *SPLIT])


def test_finetune_refuses_untrusted_foundation(data, foundation, tmp_path):
    """A mace-torch file is a pickle: without --trust-foundation it is not read."""
    sys.path.insert(0, EXAMPLES)
    import finetune_md22
    from chemtrain.models.mace.torch_io import UntrustedFileError
    with pytest.raises(UntrustedFileError, match="trusted=True"):
        finetune_md22.main(["--data", data["npz"], "--foundation", foundation,
                            "--out", str(tmp_path / "e"), *SPLIT, *TINY])


# ------------------------------------------------------------------- benchmark

@pytest.mark.parametrize("source", ["npz", "h5"])
def test_benchmark_json(data, tmp_path, source):
    out = tmp_path / "bench.json"
    args = [BENCHMARK, "--data", data["npz"], "--runs", "single:1,jax:2,mpi:2", "--train", "4",
            "--batch", "2", "--epochs", "2", "--discard", "1", "--json", str(out), *TINY]
    proc = subprocess.run([sys.executable, *args] + (["--hdf5"] if source == "h5" else []),
                          env=mp.env(devices=1), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.load(open(out))
    assert report["config"]["batch"] == 2 and report["config"]["hdf5"] == (source == "h5")
    m = report["machine"]
    assert m["cpu"] and m["cpu_count"] >= 1 and m["versions"]["jax"] and m["versions"]["chemtrain"]
    runs = {(r["method"], r["n_shards"]): r for r in report["runs"]}
    assert set(runs) == {("single", 1), ("jax", 2), ("mpi", 2)}
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
    assert "single:1  epoch" in proc.stdout and "mpi:2  epoch" in proc.stdout
