"""``chemtrain-finetune`` with NequIP (issue 49): SevenNet-0 fine-tuned on
EMT-labelled copper and written back as a SevenNet checkpoint; a random
NequIP committee, resumed, and picked from with ``chemtrain-select``; the
flags a NequIP cannot honour, refused by name.

The jobs run as a user starts them (one subprocess). The checks recompute
the reported test errors with sevenn's own calculator on the written
``.pth`` (a subprocess with sevenn's imports, see
``tests/_support/sevenn_calculator.py``), and compare the resumed run with
an uninterrupted one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mp
import paths
from cu_data import cu_frames
from finetune_jobs import run_jobs

SPLIT = ["--n_train", "4", "--n_valid", "2", "--n_test", "2", "--batch_size", "2"]
TINY = ["--model", "NequIP", "--num_channels", "4", "--max_L", "1", "--num_interactions", "2",
        "--r_max", "4.0", "--radial_MLP", "[8]"]
CONSTANT = ["--scheduler", "constant"]
# the parallel modes' runs: float64, two epochs, no export
EXACT = [*TINY, *CONSTANT, "--default_dtype", "float64", "--max_num_epochs", "2",
         "--no_torch_export"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("nequip_jobs")
    xyz = str(d / "cu.xyz")
    cu_frames(xyz, n=8)

    def job(name, *extra, out=None):
        return name, ["--train_file", xyz, "--results_dir", str(d / (out or name)), *SPLIT,
                      *extra]
    texts = run_jobs([
        job("sevennet", "--foundation_model", "sevennet-0", "--trust_foundation_model",
            "--E0s", "estimated", "--stress_weight", "1", "--max_num_epochs", "2"),
        job("committee", *TINY, "--ensemble_size", "2", "--max_num_epochs", "1",
            "--freeze", "embedding"),
        # a constant learning rate: the cosine schedule spans --max_num_epochs
        job("first", *TINY, *CONSTANT, "--max_num_epochs", "1", "--no_torch_export"),
        job("resumed", *TINY, *CONSTANT, "--max_num_epochs", "2", "--restart_latest",
            "--no_torch_export",
            out="first"),
        job("straight", *TINY, *CONSTANT, "--max_num_epochs", "2", "--no_torch_export"),
        job("single", *EXACT, "--parallelism", "single"),
        job("jax", *EXACT, "--parallelism", "jax")], "local")
    texts.update(run_jobs([job("mpi", *EXACT, "--parallelism", "mpi")], "mpi"))
    name, argv = job("distributed", *EXACT, "--parallelism", "jax")
    codes, texts[name] = mp.distributed(2, [json.dumps(argv)], script="finetune_distributed.py",
                                        timeout=600)
    assert codes == [0, 0], texts[name][-3000:]
    return {"dir": d, "xyz": xyz, "texts": texts}


def results(folder):
    with open(os.path.join(folder, "results.json")) as f:
        out = json.load(f)
    for key in ("model_npz", "model_sevennet"):
        if key in out:
            out[key] = os.path.join(folder, out[key])
    return out


def sevenn_predictions(checkpoint, frames, tmp_path):
    """Energies and forces of sevenn's SevenNetCalculator on ``checkpoint``."""
    side = os.path.join(sys.prefix, "sevenn-side")
    assert os.path.isdir(os.path.join(side, "e3nn")), (
        f"{side} is missing: scripts/setup.sh unpacks sevenn's imports there")
    structures = {str(k): {"numbers": a.numbers.tolist(), "positions": a.positions.tolist(),
                           "cell": np.asarray(a.cell).tolist(), "pbc": a.pbc.tolist()}
                  for k, a in enumerate(frames)}
    with open(tmp_path / "in.json", "w") as f:
        json.dump(structures, f)
    subprocess.run([sys.executable, os.path.join(paths.SUPPORT, "sevenn_calculator.py"),
                    checkpoint, str(tmp_path / "in.json"), str(tmp_path / "out.json")],
                   check=True, env={**os.environ, "PYTHONPATH": side}, timeout=300)
    with open(tmp_path / "out.json") as f:
        out = json.load(f)
    return [out[str(k)] for k in range(len(frames))]


def test_sevennet_0_fine_tuned_and_written_back(jobs, tmp_path):
    """SevenNet-0 fine-tuned for two epochs: the written .pth in sevenn's own
    calculator gives the test errors the job reported; only Cu's shift
    moved (--E0s estimated), every other element's and the scales stayed
    (sevenn's train_shift_scale False); the weights were trained."""
    import ase.io
    from chemtrain.models import nequip
    text = jobs["texts"]["sevennet"]
    out = results(jobs["dir"] / "sevennet")
    assert out["model"] == "NequIP" and out["epoch"] == 2
    assert "frozen: scale, shift" in text and "E0s 'estimated'" in text
    assert "SevenNetCalculator(model=" in text
    cfg, tuned = nequip.load(out["model_npz"])
    _, published = nequip.load_sevennet("sevennet-0", trusted=True)
    cu = cfg.atomic_numbers.index(29)
    others = np.arange(cfg.num_elements) != cu
    np.testing.assert_array_equal(tuned["scale"], np.float32(published["scale"]))
    np.testing.assert_array_equal(tuned["shift"][others], np.float32(published["shift"][others]))
    assert abs(tuned["shift"][cu] - published["shift"][cu]) > 0.1   # EMT's Cu is near 0 eV
    moved = np.abs(tuned["layers"][0]["linear_1"]["l0"] - published["layers"][0]["linear_1"]["l0"])
    assert moved.max() > 1e-4

    frames = ase.io.read(jobs["xyz"], ":")
    test = [frames[i] for i in out["test_rows"]]
    theirs = sevenn_predictions(out["model_sevennet"], test, tmp_path)
    e = [abs(p["energy"] - a.info["REF_energy"]) / len(a) for p, a in zip(theirs, test)]
    f = np.concatenate([np.abs(np.array(p["forces"]) - a.arrays["REF_forces"]).ravel()
                        for p, a in zip(theirs, test)])
    after = out["after"]
    assert after["energy_eV_per_atom"]["MAE"] == pytest.approx(np.mean(e), rel=1e-4, abs=1e-5)
    assert after["force_eV_per_A"]["MAE"] == pytest.approx(np.mean(f), rel=1e-3, abs=1e-5)
    assert after != out["before"]


def test_a_nequip_committee_and_chemtrain_select(jobs, tmp_path):
    """A random NequIP committee of two (embedding frozen): two different
    members, each loaded by the calculator; chemtrain-select picks from
    their spread."""
    from chemtrain.calculator import CommitteeCalculator
    from chemtrain.finetune.select import main as select
    from chemtrain.models import nequip
    text = jobs["texts"]["committee"]
    folder = jobs["dir"] / "committee"
    out = results(folder)
    assert "No --foundation_model: a random NequIP" in text and "frozen: embedding" in text
    assert "CommitteeCalculator.from_nequip(" in text
    members = [str(folder / f"model_member{k}.npz") for k in range(2)]
    (c0, p0), (c1, p1) = (nequip.load(m) for m in members)
    assert c0 == c1 and out["model"] == "NequIP"
    assert not np.allclose(p0["layers"][0]["linear_1"]["l0"], p1["layers"][0]["linear_1"]["l0"])
    assert not any(os.path.exists(folder / f"model_member{k}.pth") for k in range(2))
    calc = CommitteeCalculator.from_nequip(members)
    import ase.io
    atoms = ase.io.read(jobs["xyz"], "0")
    atoms.calc = calc
    assert calc.n_members == 2 and atoms.get_forces().shape == (len(atoms), 3)
    assert select(["--model_dir", str(folder), "--pool", jobs["xyz"], "--n", "2",
                   "--out", str(tmp_path / "picked.xyz")]) == 0
    assert len(ase.io.read(tmp_path / "picked.xyz", ":")) == 2


def test_a_resumed_nequip_run_is_the_uninterrupted_one(jobs):
    from chemtrain.models import nequip
    assert "Resumed from" in jobs["texts"]["resumed"]
    _, resumed = nequip.load(results(jobs["dir"] / "first")["model_npz"])
    _, straight = nequip.load(results(jobs["dir"] / "straight")["model_npz"])
    import jax
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode,shards", [("jax", 2), ("mpi", 2), ("distributed", 2)])
def test_force_matching_with_nequip_in_every_parallel_mode_equals_single(jobs, mode, shards):
    """Two devices of one process, two MPI ranks, two jax.distributed
    processes: the trained parameters equal one device's to 1e-6 (float64)."""
    from chemtrain.models import nequip
    import jax
    out = results(jobs["dir"] / mode)
    assert out["n_shards"] == shards and out["epoch"] == 2, out
    _, single = nequip.load(results(jobs["dir"] / "single")["model_npz"])
    _, other = nequip.load(out["model_npz"])
    for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(single)):
        assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(b)), mode
    trained = results(jobs["dir"] / "single")
    assert trained["after"] != trained["before"]   # two epochs did change the model


@pytest.mark.parametrize("extra,message", [
    (["--pt_train_file", "X.xyz"], "readout heads"),
    (["--foundation_head", "Default"], "a NequIP has one"),
    (["--freeze", "5"], "name NequIP's instead"),
    (["--weight_decay", "1e-6"], "without weight decay"),
    (["--num_channels", "16"], "keeps its own size"),
    (["--model", "MACE"], "is a NequIP model"),
])
def test_flags_a_nequip_cannot_honour_are_refused(jobs, tmp_path, extra, message):
    from chemtrain.finetune import DataError, run
    with pytest.raises(DataError, match=message):
        run(["--train_file", jobs["xyz"], "--foundation_model", "sevennet-0",
             "--trust_foundation_model", "--results_dir", str(tmp_path / "x"), *SPLIT, *extra])
    assert not os.path.exists(tmp_path / "x")


def test_random_nequip_refuses_mace_size_flags_and_untrusted_checkpoints(jobs, tmp_path):
    from chemtrain.finetune import DataError, run
    base = ["--train_file", jobs["xyz"], "--results_dir", str(tmp_path / "x"), *SPLIT]
    with pytest.raises(DataError, match="--model NequIP has no --correlation"):
        run([*base, *TINY, "--correlation", "3"])
    with pytest.raises(DataError, match="--trust_foundation_model"):
        run([*base, "--foundation_model", "sevennet-0"])
    with pytest.raises(DataError, match="does not exist"):
        run([*base, "--foundation_model", str(tmp_path / "none.pth")])
    assert not os.path.exists(tmp_path / "x")
