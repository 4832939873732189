"""``chemtrain-finetune`` (chemtrain.finetune) and the MD22 example, its thin call.

Jobs run as a user starts them, with a tiny MACE on a few structures:
several jobs in one subprocess (single and jax on two CPU devices; npz, HDF5
and extxyz; a resumed run; a mace-torch foundation model) and two under
``mpirun -np 2``. The checks read what the jobs print and write, recompute
the test errors from the saved model and the raw data with code of their
own, and load every exported ``.model`` in mace-torch's ``MACECalculator``.
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
from cu_data import cu_frames
from finetune_jobs import run_jobs
from mace_ref import STANDIN, small_standin

from paths import EXAMPLES as ALL_EXAMPLES

EXAMPLES = os.path.join(ALL_EXAMPLES, "mace_jax")
TINY = ["--num_channels", "4", "--max_ell", "1", "--correlation", "2", "--r_max", "4.0"]
SPLIT = ["--n_train", "4", "--n_valid", "2", "--n_test", "2", "--batch_size", "2"]
LINE = re.compile(r"Test errors, (.+?): energy MAE ([0-9.e+-]+) RMSE ([0-9.e+-]+) eV/atom; "
                  r"force MAE ([0-9.e+-]+) RMSE ([0-9.e+-]+) eV/Å")
EV, KCAL = 96.48533212, 4.184   # kJ/mol


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Ten stand-in structures as an MD22 .npz and as chemtrain HDF5; Cu cells as extxyz."""
    from chemtrain.data.convert import convert
    d = tmp_path_factory.mktemp("finetune")
    npz = small_standin(d)
    h5 = str(d / "small.h5")
    convert(npz, h5, progress=False)
    xyz = str(d / "cu.xyz")
    frames = cu_frames(xyz)
    # the same cells where the two test rows of a --n_test 2 --seed 0 split
    # have no stress label (the others keep theirs)
    import ase.io
    for i in np.random.default_rng(0).permutation(len(frames))[:2]:
        del frames[i].info["REF_stress"]
    partial = str(d / "cu_partial_stress.xyz")
    ase.io.write(partial, frames, format="extxyz")
    return {"npz": npz, "h5": h5, "xyz": xyz, "xyz_partial_stress": partial, "dir": d}


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


def job(data, name, source, method, *extra, epochs=1, out=None):
    out = str(data["dir"] / (out or name))
    return name, ["--train_file", data[source], "--parallelism", method, "--results_dir", out,
                  "--max_num_epochs", str(epochs), *SPLIT, *TINY, *extra]


@pytest.fixture(scope="module")
def local_outputs(data, foundation):
    cache = ["--jax_cache", str(data["dir"] / "jax_cache")]
    cu = ["--train_file", data["xyz"], "--n_train", "4", "--n_valid", "0", "--n_test", "2",
          "--stress_weight", "10", "--default_dtype", "float64"]
    return run_jobs([job(data, "npz_single", "npz", "single", *cache),
                     job(data, "npz_resumed", "npz", "single", "--restart_latest", *cache, epochs=2,
                         out="npz_single"),
                     job(data, "h5_single", "h5", "single", *cache),
                     job(data, "npz_jax", "npz", "jax", *cache),
                     job(data, "npz_foundation", "npz", "single", "--foundation_model", foundation,
                         "--trust_foundation_model"),
                     job(data, "cu_xyz", "xyz", "single", *cu, *cache),
                     job(data, "npz_zero", "npz", "single", "--no_torch_export", *cache,
                         epochs=0),
                     job(data, "cu_test_without_stress", "xyz_partial_stress", "single", *cu[2:],
                         "--no_torch_export", *cache, epochs=0)], "local")


@pytest.fixture(scope="module")
def mpi_outputs(data):
    return run_jobs([job(data, "npz_mpi", "npz", "mpi"), job(data, "h5_mpi", "h5", "mpi")], "mpi")


def independent_errors(out_dir, data_path):
    """Test-set energy and force MAEs of the saved model computed here, in
    float64, from the model file and the raw MD22-format data with a jax-md
    neighbor list (not the job's graphs)."""
    import jax
    import jax.numpy as jnp
    from jax_md import partition, space
    from chemtrain.models import mace
    results = read_results(out_dir)
    cfg, params = mace.load(results["model_npz"])
    raw = np.load(data_path)
    rows = np.asarray(results["test_rows"])
    R = jnp.asarray(raw["R"][rows] / 10.0, jnp.float64)
    E_ref = raw["E"].reshape(-1)[rows] * KCAL / EV
    F_ref = raw["F"][rows] * KCAL / EV
    disp, _ = space.free()
    nbrs = partition.neighbor_list(disp, 100.0, cfg.r_max / 10, format=partition.Sparse,
                                   disable_cell_list=True).allocate(R[0], extra_capacity=20)
    template = mace.energy_fn_template(cfg, disp)
    species = jnp.asarray(raw["z"])
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params)
    fn = jax.jit(jax.value_and_grad(lambda x: template(params)(x, nbrs.update(x), species=species)))
    E, F = zip(*[fn(r) for r in R])
    E, F = np.array(E) / EV, -np.stack(F) / EV / 10.0
    return float(np.mean(np.abs(E - E_ref))) / R.shape[1], float(np.mean(np.abs(F - F_ref))), results


def check_job(text, out_dir, method, n_shards, epochs=1):
    """Printed errors (once, by the root), plot, checkpoint, results; returns
    (label of the first line, results)."""
    lines = LINE.findall(text)
    assert len(lines) == 2, text[-3000:]
    (start, *before), (final, *after) = lines
    assert final == f"trained (epoch {epochs})", final
    assert np.all(np.isfinite([float(x) for x in before + after])) and after != before
    for png in ("parity.png", "curve.png"):
        with open(os.path.join(out_dir, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    assert (f"Parity plot: {os.path.join(out_dir, 'parity.png')}; learning curve: "
            f"{os.path.join(out_dir, 'curve.png')}") in text
    assert os.path.exists(os.path.join(out_dir, "checkpoints", f"epoch_{epochs:05d}.npz"))
    results = read_results(out_dir)
    assert results["parallelism"] == method and results["n_shards"] == n_shards
    assert results["epoch"] == epochs
    assert f"-> {method}, {n_shards} shard(s)" in text
    assert "MACECalculator(model_paths=" in text
    history = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    assert [h["epoch"] for h in history] == list(range(epochs))
    return start, results


def read_results(out_dir):
    """results.json, whose files are named relative to the results folder
    (so that a copied folder names its own), with those files as paths."""
    results = json.load(open(os.path.join(out_dir, "results.json")))
    for key in ("model_npz", "model_torch", "curve_plot"):
        if key in results:
            assert not os.path.isabs(results[key]) and os.sep not in results[key], results[key]
            results[key] = os.path.join(out_dir, results[key])
    return results


def check_npz_job(text, data, name, method, n_shards, epochs=1):
    out = str(data["dir"] / name)
    start, _ = check_job(text, out, method, n_shards, epochs)
    e_mae, f_mae, results = independent_errors(out, data["npz"])
    assert results["n_test"] == 2
    assert results["after"]["energy_eV_per_atom"]["MAE"] == pytest.approx(e_mae, rel=2e-3, abs=1e-6)
    assert results["after"]["force_eV_per_A"]["MAE"] == pytest.approx(f_mae, rel=2e-3)
    return start


def torch_matches(results, atoms_list, dtype):
    """The exported .model in mace-torch's own calculator gives chemtrain's
    energies (ChemtrainCalculator on the .npz) within 1e-5 relative."""
    import mace  # noqa: F401
    from mace.calculators import MACECalculator
    from chemtrain.calculator import ChemtrainCalculator
    torch_calc = MACECalculator(model_paths=results["model_torch"], device="cpu",
                                default_dtype=dtype)
    ours = ChemtrainCalculator.from_mace(results["model_npz"], dtype="float64")
    for atoms in atoms_list:
        a, b = atoms.copy(), atoms.copy()
        a.calc, b.calc = torch_calc, ours
        e_torch, e_ours = a.get_potential_energy(), b.get_potential_energy()
        assert e_torch == pytest.approx(e_ours, rel=1e-5), (e_torch, e_ours)


def nanotubes(rows):
    from ase import Atoms
    raw = np.load(STANDIN)
    return [Atoms(numbers=raw["z"], positions=raw["R"][r]) for r in rows]


# ---------------------------------------------------------------------- jobs

@pytest.mark.parametrize("name,method,n_shards", [("h5_single", "single", 1),
                                                  ("npz_jax", "jax", 2)])
def test_finetune_single_and_jax(data, local_outputs, name, method, n_shards):
    text = local_outputs[name]
    assert check_npz_job(text, data, name, method, n_shards) == "starting model"
    assert "No --foundation_model: a random MACE" in text and "E0s 'average'" in text


def test_finetune_zero_epochs_reports_the_start(data, local_outputs):
    """--max_num_epochs 0 evaluates and exports the starting model: the
    folder, results and parity plot exist; there is no curve to draw."""
    out = data["dir"] / "npz_zero"
    (start, *before), (final, *after) = LINE.findall(local_outputs["npz_zero"])
    assert (start, final) == ("starting model", "trained (epoch 0)") and after == before
    results = json.load(open(out / "results.json"))
    assert results["epoch"] == 0 and results["after"] == results["before"]
    assert (out / "parity.png").exists() and (out / "model.npz").exists()
    assert not (out / "curve.png").exists() and not (out / "model.model").exists()


def test_finetune_npz_resume_and_export(data, local_outputs):
    """The second job continued the first one's run (restored epoch 1, trained
    epoch 2, one metrics file); its export loads in mace-torch."""
    first, resumed = local_outputs["npz_single"], local_outputs["npz_resumed"]
    out = data["dir"] / "npz_single"
    assert "Test errors, trained (epoch 1)" in first
    assert f"Resumed from {out / 'checkpoints' / 'epoch_00001.npz'} (epoch 1)" in resumed
    assert check_npz_job(resumed, data, "npz_single", "single", 1, epochs=2) == \
        "restored model (epoch 1)"
    assert LINE.findall(first)[1][1:] == LINE.findall(resumed)[0][1:]
    results = read_results(out)
    torch_matches(results, nanotubes(results["test_rows"]), "float32")


def test_finetune_from_mace_torch(data, local_outputs, foundation):
    """A mace-torch file is converted and trained; E0s 'average' refit the
    elements in the data and keep the others; the export loads in mace-torch."""
    text = local_outputs["npz_foundation"]
    assert f"Fine-tuning {foundation}:" in text and "No --foundation_model" not in text
    assert check_npz_job(text, data, "npz_foundation", "single", 1) == "starting model"
    from chemtrain.models import mace
    results = read_results(data["dir"] / "npz_foundation")
    cfg, _ = mace.load(results["model_npz"])
    assert cfg.atomic_numbers == (1, 6, 8) and cfg.r_max == 4.0
    assert cfg.atomic_energies[2] == -3.0 and cfg.atomic_energies[:2] != (-1.0, -2.0)
    torch_matches(results, nanotubes(results["test_rows"]), "float32")


def test_finetune_extxyz_small_cells_with_stress(data, local_outputs):
    """Cu cells of 1 and 4 atoms, 3.6 Angstrom wide (a cutoff of 4 needs every
    periodic image): trained on energies, forces and stress from extxyz, in
    float64; mace-torch, which counts every image, gives the same energies."""
    import ase.io
    text = local_outputs["cu_xyz"]
    start, results = check_job(text, str(data["dir"] / "cu_xyz"), "single", 1)
    assert start == "starting model" and "stress MAE" in text
    assert set(results["after"]) == {"energy_eV_per_atom", "force_eV_per_A", "stress_eV_per_A3"}
    assert results["config"]["atomic_numbers"] == [29]
    frames = ase.io.read(data["xyz"], index=":")
    torch_matches(results, [frames[i] for i in results["test_rows"]] + frames[:2], "float64")


@pytest.mark.parametrize("name", ["npz_mpi", "h5_mpi"])
def test_finetune_mpi(data, mpi_outputs, name):
    check_npz_job(mpi_outputs[name], data, name, "mpi", 2)


# --------------------------------------------------------------- bad input

def _run(*argv):
    from chemtrain.finetune import run
    return run(list(argv))


def test_refuses_missing_forces_and_bad_split(data, tmp_path):
    from chemtrain.finetune import DataError
    path = str(tmp_path / "noforces.xyz")
    cu_frames(path, n=3, labels=("energy",))
    with pytest.raises(DataError, match=r"no forces under the key 'REF_forces' .*--forces_key.*"
                                        r"--forces_weight 0"):
        _run("--train_file", path, "--results_dir", str(tmp_path / "a"))
    with pytest.raises(DataError, match=r"no stress under the key 'virial'"):
        _run("--train_file", data["xyz"], "--stress_key", "virial", "--stress_weight", "1",
             "--results_dir", str(tmp_path / "a"))
    with pytest.raises(DataError, match=r"8 training \+ 2 validation \+ 2 test structures are "
                                        r"asked for, but .*small.npz' holds 10"):
        _run("--train_file", data["npz"], "--n_train", "8", "--n_valid", "2", "--n_test", "2",
             "--results_dir", str(tmp_path / "a"))
    with pytest.raises(DataError, match="missing.npz' does not exist"):
        _run("--train_file", str(tmp_path / "missing.npz"), "--results_dir", str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()


def test_an_error_on_one_mpi_rank_ends_every_rank(data, tmp_path):
    """mpirun -np 2 where rank 1's --train_file is missing (issue 37): rank 1
    stops with its one-line error before any trainer exists, and rank 0,
    which would wait for it in the first collective, ends too."""
    missing = str(tmp_path / "missing.npz")
    driver = ("import os, sys; from chemtrain.finetune import main; "
              "argv = sys.argv[1:]; rank = os.environ.get('PMI_RANK', '0'); "
              f"argv[1] = argv[1] if rank == '0' else {missing!r}; sys.exit(main(argv))")
    _, argv = job(data, "one_rank_missing", "npz", "mpi")
    code, text, seconds = mp.mpirun(2, ["-c", driver, *argv], devices=1, timeout=300)
    assert code != 0, text[-3000:]
    assert text.count("missing.npz' does not exist") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert seconds < 120, seconds
    assert not os.path.exists(str(data["dir"] / "one_rank_missing" / "checkpoints"))


def test_refuses_elements_the_foundation_lacks(data, foundation, tmp_path):
    from chemtrain.finetune import DataError
    with pytest.raises(DataError, match=r"atomic numbers \[29\] that the foundation model .* "
                                        r"does not know \(it has \[1, 6, 8\]\)"):
        _run("--train_file", data["xyz"], "--foundation_model", foundation,
             "--trust_foundation_model", "--results_dir", str(tmp_path / "b"))
    with pytest.raises(DataError, match="--trust_foundation_model"):
        _run("--train_file", data["npz"], "--foundation_model", foundation,
             "--results_dir", str(tmp_path / "b"))


def test_refuses_a_folder_holding_another_run(data, local_outputs, tmp_path):
    """Another run's folder is left byte for byte as it was; --restart_latest
    without a checkpoint is refused too."""
    from chemtrain.finetune import DataError
    out = data["dir"] / "h5_single"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(DataError, match="holds another run .*--restart_latest"):
        _run("--train_file", data["npz"], "--results_dir", str(out), *SPLIT, *TINY)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with pytest.raises(DataError, match="--restart_latest: no checkpoint"):
        _run("--train_file", data["npz"], "--results_dir", str(tmp_path / "d"), "--restart_latest")


def test_console_script_and_example_are_thin_calls(data):
    """``python -m chemtrain.finetune`` ends bad input with exit code 2 and
    the message; the example passes its flags through to it."""
    out = subprocess.run([sys.executable, "-m", "chemtrain.finetune", "--train_file",
                          str(data["dir"] / "nothing.xyz")], capture_output=True, text=True,
                         env=mp.env(), timeout=300)
    assert out.returncode == 2 and "nothing.xyz' does not exist" in out.stderr
    sys.path.insert(0, EXAMPLES)
    import finetune_md22
    assert finetune_md22.main(["--train_file", str(data["dir"] / "nothing.npz")]) == 2


def test_hdf5_cells_need_stored_graphs(data, tmp_path):
    """Periodic cells in an HDF5 training file without graphs are refused
    (a jax-md list would count one image of each pair), naming the fix."""
    from chemtrain.data.convert import convert
    from chemtrain.finetune import DataError
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator
    frames = ase.io.read(data["xyz"], index=":")
    for a in frames:   # the converter reads ASE's own labels
        a.calc = SinglePointCalculator(a, energy=a.info.pop("REF_energy"),
                                       forces=a.arrays.pop("REF_forces"))
    plain = str(tmp_path / "cu_plain.xyz")
    ase.io.write(plain, frames, format="extxyz")
    h5 = str(tmp_path / "cu.h5")
    convert(plain, h5, progress=False)
    with pytest.raises(DataError, match=r"periodic cells but no graphs.*--graph-cutoff 0\.4"):
        _run("--train_file", h5, "--n_train", "4", "--n_valid", "1", "--n_test", "1",
             "--results_dir", str(tmp_path / "e"), *TINY)


# ------------------------------------------- bad input found before any work (issue 37)
def _files(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_test_set_without_stress_reports_no_stress_error(data, local_outputs):
    """--stress_weight with test structures that have no stress label used
    to report 'stress MAE 0 RMSE 0'."""
    text = local_outputs["cu_test_without_stress"]
    assert "The testing set has no stress labels: no stress errors are reported." in text, text
    assert "stress MAE" not in text, text
    with open(data["dir"] / "cu_test_without_stress" / "results.json") as f:
        results = json.load(f)
    assert "stress_eV_per_A3" not in results["after"], results["after"]
    assert "force_eV_per_A" in results["after"]


@pytest.mark.parametrize("change, named", [
    (["--seed", "1"], r"--seed \(then 0, now 1\); the split \(--n_train"),
    (["--num_channels", "8"], r"--num_channels \(then 4, now 8\)"),
    (["--default_dtype", "float64"], r"--default_dtype \(then 'float32', now 'float64'\)"),
    (["--train_file", "h5"], r"--train_file \(then '.*small.npz', now '.*small.h5'\)"),
])
def test_a_resumed_run_refuses_other_data_split_or_model(data, local_outputs, change, named):
    """--restart_latest with another --seed put training structures into the
    test set; with another --train_file the weights went on as another
    model; with another --num_channels a checkpoint traceback named no flag.
    The run's folder is left byte for byte as it was."""
    from chemtrain.finetune import DataError
    out = data["dir"] / "npz_single"
    before = _files(out)
    _, argv = job(data, "npz_single", "npz", "single", "--restart_latest", epochs=3)
    if change[0] == "--train_file":
        argv[argv.index("--train_file") + 1] = data["h5"]
    else:
        argv += change
    with pytest.raises(DataError, match=r"--restart_latest continues the run in .*npz_single.*"
                                        r"started otherwise: .*" + named):
        _run(*argv)
    assert _files(out) == before


def test_a_truncated_newest_checkpoint_offers_the_previous_one(data, local_outputs, tmp_path):
    import shutil
    out = tmp_path / "copy"
    shutil.copytree(data["dir"] / "npz_single", out)
    newest = sorted((out / "checkpoints").glob("epoch_*.npz"))
    assert [p.name for p in newest] == ["epoch_00001.npz", "epoch_00002.npz"]
    newest[-1].write_bytes(newest[-1].read_bytes()[:1000])
    from chemtrain.finetune import DataError
    _, argv = job(data, "npz_single", "npz", "single", "--restart_latest", epochs=3)
    argv[argv.index("--results_dir") + 1] = str(out)
    with pytest.raises(DataError, match=r"cannot read the newest checkpoint .*epoch_00002.npz.*"
                                        r"move it away; --restart_latest then resumes from "
                                        r".*epoch_00001.npz"):
        _run(*argv)


def test_size_flags_a_foundation_model_would_ignore_are_refused(data, foundation, tmp_path):
    """--num_channels 64 --r_max 6 with --foundation_model were ignored
    without a word; flags equal to the model's own sizes pass."""
    from chemtrain.finetune import DataError
    with pytest.raises(DataError, match=r"keeps its own size, so --num_channels 64 \(the model "
                                        r"has 4\), --r_max 6.0 \(the model has 4.0\) would be "
                                        r"ignored"):
        _run("--train_file", data["npz"], "--foundation_model", foundation,
             "--trust_foundation_model", "--num_channels", "64", "--r_max", "6",
             "--results_dir", str(tmp_path / "f"))
    assert not (tmp_path / "f").exists()


def test_hdf5_graphs_shorter_than_r_max_are_refused(data, tmp_path):
    """Graphs converted at 3 Å trained a 4 Å model on 48 edges of 72."""
    from chemtrain.data.convert import convert
    from chemtrain.finetune import DataError
    h5 = str(tmp_path / "short_graphs.h5")
    convert(data["npz"], h5, progress=False, graph_cutoff=0.3)
    with pytest.raises(DataError, match=r"graphs built to 3 Å, shorter than the model's r_max "
                                        r"4 Å.*--graph-cutoff 0.4 \(nm\), or train with "
                                        r"--r_max 3"):
        _run("--train_file", h5, *SPLIT, *TINY, "--results_dir", str(tmp_path / "g"))
    assert not (tmp_path / "g").exists()


def test_ranks_that_read_different_data_all_stop(data, tmp_path):
    """mpirun -np 2 where rank 1's copy of the file has shifted energies:
    each rank used to fit its own E0s (test energy MAE 1.117 against 0.867).
    Every rank stops with one message before training."""
    with np.load(data["npz"]) as z:
        shifted = dict(z)
    shifted["E"] = shifted["E"] + 50.0
    other = str(tmp_path / "shifted.npz")
    np.savez(other, **shifted)
    out = tmp_path / "run"
    driver = ("import os, sys; from chemtrain.finetune import main; "
              "argv = sys.argv[1:]; rank = os.environ.get('PMI_RANK', '0'); "
              f"argv[1] = argv[1] if rank == '0' else {other!r}; sys.exit(main(argv))")
    _, argv = job(data, "x", "npz", "mpi", out=str(out))
    code, text, seconds = mp.mpirun(2, ["-c", driver, *argv], devices=1, timeout=300)
    assert code != 0, text[-3000:]
    assert text.count("The processes of this run disagree on the data, split and model set-up") \
        == 1, text[-3000:]
    assert "the content of --train_file" in text and "Traceback" not in text, text[-3000:]
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("*.npz"))
