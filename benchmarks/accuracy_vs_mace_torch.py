"""Accuracy and wall time: chemtrain against mace-torch's own trainer, same job.

    .venv/bin/python benchmarks/accuracy_vs_mace_torch.py                 # defaults below
    .venv/bin/python benchmarks/accuracy_vs_mace_torch.py --epochs 2      # quick end-to-end check

Trains the MACE of chemtrain's main job (``examples/mace_jax/finetune_md22.py``,
a call of ``chemtrain-finetune``) from scratch twice on the same data, split, architecture,
batch size and number of optimizer steps: with chemtrain and with mace-torch's
``mace_run_train`` (float32, CPU). Both trained models are then measured on the
same test structures by the same code (``chemtrain.finetune.report.summary``:
energy error per atom in eV/atom, force-component errors in eV/A), and the
script prints both tables, both wall times and the ratio of our test force
RMSE to mace-torch's (target <= 1.1), then one JSON line with all figures.

Data: ``--data`` (default the nanotube stand-in, MD22 format: R Angstrom, z,
E kcal/mol, F kcal/mol/A; 1 kcal/mol = 1/23.060547830619 eV) is copied into
``--work`` and split at random (``--seed``; ``--train/--valid/--test``, default
60/10/50). The split is written as ``train.xyz``, ``valid.xyz`` and
``test.xyz`` (extxyz, ``info['REF_energy']`` eV, ``arrays['REF_forces']`` eV/A,
no cell, pbc False: mace-torch then builds its graphs in free space), which
go to both tools (chemtrain: ``--train_file``, ``--valid_file``, ``--test_file``).

Architecture (both sides): ScaleShiftMACE, 2 x RealAgnosticResidualInteractionBlock
(also the first), hidden irreps 8x0e, spherical harmonics up to l = 1,
correlation 2, r_max 4 A, 10 Bessel functions, polynomial cutoff p = 5,
radial MLP [64, 64, 64], MLP irreps 16x0e, non-linear last readout,
avg_num_neighbors from the training data, scale = RMS training force
component, shift 0, E0s by least squares on the training energies
(mace-torch ``--E0s average``). The mace_run_train flags that give exactly this:
``--model ScaleShiftMACE --interaction RealAgnosticResidualInteractionBlock
--interaction_first RealAgnosticResidualInteractionBlock --num_channels 8
--max_L 0 --max_ell 1 --correlation 2 --r_max 4.0 --num_interactions 2
--num_radial_basis 10 --num_cutoff_basis 5 --radial_MLP "[64, 64, 64]"
--MLP_irreps 16x0e --gate silu --mean 0.0 --std <RMS force>``. In
mace-torch ``--max_L`` is the L of the hidden irreps (0: scalars only) and
``--max_ell`` the degree of the edge spherical harmonics (chemtrain's
``max_ell``). ``--model MACE`` would silently replace a residual first
interaction by RealAgnosticInteractionBlock, and ``--model ScaleShiftMACE``
without ``--mean/--std`` sets the shift to the mean per-atom energy, hence
ScaleShiftMACE with ``--mean 0 --std`` (the RMS force computed here as both
tools compute it: sqrt of the mean squared training force component).

Optimizer: same batch size, epochs (so the same 30 steps per epoch) and
learning rate (2e-2, the main job's; mace-torch's default is 1e-2); each tool's own defaults
otherwise, except that chemtrain gets the main job's optimizer flags
(``finetune_md22.OPTIMIZER``: plain Adam, no gradient clipping, no weight
decay, cosine decay of the learning rate to 5 % over the run, no EMA).
mace-torch's defaults: Adam with ``amsgrad=True``, weight decay 5e-7 (L2,
on the interaction weights), ``ReduceLROnPlateau`` (factor 0.8, patience 50
epochs: a constant learning rate over runs this short), gradient-norm
clipping at 10, no EMA, no Stage Two. chemtrain-finetune's own defaults are
mace-torch's optimizer; on this short run with the cosine decay they give a
worse fit (test force RMSE 0.232 against 0.207 eV/A; see the example's
comment). Both tools keep the model of the epoch with the lowest validation
loss by default; ``--export_model last`` (chemtrain) and
``--save_all_checkpoints`` (mace-torch) make each final model the last
epoch's, the same number of steps on both sides (``--mace-best`` evaluates
both tools' best-validation models instead).

Losses. Both tools get the same ``--energy_weight`` and ``--forces_weight``
in mace-torch's units (its "weighted" loss: w_E (energy error per atom, eV)^2
+ w_F (force component error, eV/A)^2); chemtrain-finetune converts them to
its gammas exactly (``chemtrain.finetune.model.gammas``). Default 1 and 1,
the main job's.

Timing on a shared machine: torch's OpenMP threads (one per core) degrade
badly when other jobs hold the cores. On the 2-core project machine at load
average 3-5, mace_run_train's epochs took 62-169 s with torch's default
threads and 12-13 s with ``--torch-threads 1`` (OMP_NUM_THREADS=1); chemtrain's
took 34-44 s (first epoch 72 s, compiling). On the quiet machine (load below
2) at the defaults: 6.5-8.8 s and 12.3-14.0 s (docs/performance.md). The fastest epoch of each side
(printed) is the least loaded figure. mace-torch is also not bit-reproducible
on CPU: two runs with the same seed and files agreed for 2 epochs and then
drifted apart (test force RMSE 0.253 and 0.281 eV/A after 5 epochs at the
earlier defaults, learning rate 1e-2).

Output: the chemtrain run's folder (``--work``/chemtrain), mace-torch's
(``--work``/mace_torch, log in logs/), and ``--work``/result.json. Both tools
run one after the other in their own process on the same cores; wall times
are whole runs (start-up, data, statistics, compilation, training, their own
evaluations).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

from chemtrain.finetune import data as D, model as M, report as R

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(REPO, "examples", "mace_jax", "nanotube_standin.npz")
sys.path.insert(0, os.path.join(REPO, "examples", "mace_jax"))
from finetune_md22 import OPTIMIZER as MAIN_JOB_OPTIMIZER  # noqa: E402  (the main job's Adam)

KCAL_PER_EV = 23.060547830619
# next to this Python (a venv), else on PATH (pip --target's bin/ on the GPU machine)
MACE_RUN_TRAIN = os.path.join(os.path.dirname(sys.executable), "mace_run_train")
if not os.path.exists(MACE_RUN_TRAIN):
    MACE_RUN_TRAIN = shutil.which("mace_run_train") or MACE_RUN_TRAIN


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=STANDIN, help="MD22-format .npz")
    p.add_argument("--train", type=int, default=60)
    p.add_argument("--valid", type=int, default=10)
    p.add_argument("--test", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="split, initialisation, shuffling")
    p.add_argument("--epochs", type=int, default=12, help="the main job's")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-2, help="the main job's (mace-torch's default: 1e-2)")
    p.add_argument("--energy-weight", type=float, default=1.0,
                   help="--energy_weight of both tools (mace-torch's units)")
    p.add_argument("--forces-weight", type=float, default=1.0,
                   help="--forces_weight of both tools (mace-torch's units)")
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--max-ell", type=int, default=1)
    p.add_argument("--correlation", type=int, default=2)
    p.add_argument("--r-max", type=float, default=4.0)
    p.add_argument("--mace-best", action="store_true",
                   help="evaluate both tools' best-validation models (their defaults) instead "
                        "of their last epochs'")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for mace_run_train (default: torch's own, one per core); "
                        "1 on a machine shared with other jobs, see the docstring")
    p.add_argument("--work", default="/tmp/accuracy_vs_mace_torch", help="work folder (its chemtrain/ and mace_torch/ are replaced)")
    return p.parse_args(argv)


# -- data -------------------------------------------------------------------------
def write_split(args) -> dict:
    """Copy the data into the work folder, split it and write the three
    extxyz files."""
    from ase import Atoms
    from ase.io import write
    os.makedirs(args.work, exist_ok=True)
    src = os.path.join(args.work, "data.npz")
    shutil.copyfile(args.data, src)   # a snapshot: the source may be rewritten meanwhile
    sha = hashlib.sha256(open(src, "rb").read()).hexdigest()
    f = np.load(src)
    R, z, E, F = f["R"], f["z"].astype(int), f["E"].reshape(len(f["R"])), f["F"]
    need = args.train + args.valid + args.test
    if need > len(R):
        raise SystemExit(f"{need} structures asked for, {args.data} holds {len(R)}")
    order = np.random.default_rng(args.seed).permutation(len(R))[:need]
    rows = {"train": order[:args.train], "valid": order[args.train:args.train + args.valid],
            "test": order[args.train + args.valid:]}
    files = {"rows": {k: v.tolist() for k, v in rows.items()}, "sha256": sha, "n_atoms": len(z),
             "z": z.tolist()}
    for name, r in rows.items():
        frames = []
        for i in r:
            a = Atoms(numbers=z, positions=R[i], pbc=False)
            a.info["REF_energy"] = float(E[i]) / KCAL_PER_EV
            a.arrays["REF_forces"] = F[i] / KCAL_PER_EV
            frames.append(a)
        files[name] = os.path.join(args.work, f"{name}.xyz")
        write(files[name], frames, format="extxyz")
    return files


def read_xyz(path):
    """Positions (A), atomic numbers, energies (eV), forces (eV/A) of an extxyz file."""
    from ase.io import read
    frames = read(path, index=":", format="extxyz")
    return (frames, np.array([a.info["REF_energy"] for a in frames]),
            np.stack([a.arrays["REF_forces"] for a in frames]))


def as_chemtrain_units(frames, energies_eV, forces_eV_A):
    """What ``chemtrain.finetune.report.summary`` expects: R nm, U kJ/mol, F kJ/mol/nm, mask."""
    pos = np.stack([a.positions for a in frames]) * D.LENGTH
    return {"R": pos, "U": np.asarray(energies_eV) * D.ENERGY,
            "F": np.asarray(forces_eV_A) * D.FORCE,
            "species": np.stack([a.numbers for a in frames]), "mask": np.ones(pos.shape[:2], bool)}


def run_chemtrain(files, args) -> dict:
    """Train with ``python -m chemtrain.finetune``; return {"before": S, "after": S, "wall_s": ...}."""
    out = os.path.join(args.work, "chemtrain")
    shutil.rmtree(out, ignore_errors=True)
    w_e, w_f = args.energy_weight, args.forces_weight
    cmd = [sys.executable, "-m", "chemtrain.finetune", "--train_file", files["train"],
           "--valid_file", files["valid"], "--test_file", files["test"],
           "--energy_key", "REF_energy", "--forces_key", "REF_forces",
           "--num_channels", str(args.channels), "--max_L", "0", "--max_ell", str(args.max_ell),
           "--correlation", str(args.correlation), "--r_max", str(args.r_max),
           "--num_interactions", "2", "--num_radial_basis", "10", "--num_cutoff_basis", "5",
           "--energy_weight", repr(w_e), "--forces_weight", repr(w_f),
           "--batch_size", str(args.batch), "--max_num_epochs", str(args.epochs),
           "--lr", str(args.lr), "--seed", str(args.seed), "--default_dtype", "float32",
           "--E0s", "average", "--results_dir", out,
           "--export_model", "best" if args.mace_best else "last", *MAIN_JOB_OPTIMIZER]
    res = _run(cmd, os.path.join(args.work, "chemtrain.log"), cwd=REPO)
    with open(os.path.join(out, "results.json")) as fh:
        results = json.load(fh)
    return {"before": results.get("before"), "after": results["after"], "wall_s": res["wall_s"],
            "train_loop_s": _epoch_seconds(out), "epoch_s": _epoch_times(out),
            "n_params_reported": None,
            "load_end": res["load_end"], "command": cmd}


def _epoch_times(out):
    """The trainer's per-epoch times (training and validation) from metrics.jsonl."""
    logs = glob.glob(os.path.join(out, "**", "metrics.jsonl"), recursive=True)
    if not logs:
        return []
    records = [json.loads(line) for line in open(logs[0]) if line.strip()]
    return [float(r["time_s"]) for r in records if "time_s" in r]


def _epoch_seconds(out):
    times = _epoch_times(out)
    return float(sum(times)) if times else None


def chemtrain_param_count(args, z) -> int:
    """sum(p.size) of chemtrain's initial parameters for this architecture."""
    import jax
    from chemtrain.models import mace
    cfg = M.random_config(sorted(set(int(a) for a in z)), 1.0, 1.0, num_channels=args.channels,
                          max_ell=args.max_ell, correlation=args.correlation, r_max=args.r_max)
    params = mace.init_params(cfg, jax.random.PRNGKey(args.seed), np.float32)
    return int(sum(p.size for p in jax.tree.leaves(params)))


# -- mace-torch ---------------------------------------------------------------------
def run_mace_torch(files, args) -> dict:
    work = os.path.join(args.work, "mace_torch")
    shutil.rmtree(work, ignore_errors=True)
    _, _, f_train = read_xyz(files["train"])
    rms = float(np.sqrt(np.mean(f_train.astype(np.float64) ** 2)))   # as both tools compute it
    w_e, w_f = args.energy_weight, args.forces_weight
    cmd = [MACE_RUN_TRAIN, "--name", "mace", "--work_dir", work, "--seed", str(args.seed),
           "--device", "cpu", "--default_dtype", "float32",
           "--train_file", files["train"], "--valid_file", files["valid"],
           "--test_file", files["test"], "--energy_key", "REF_energy", "--forces_key", "REF_forces",
           "--E0s", "average",
           "--model", "ScaleShiftMACE", "--interaction", "RealAgnosticResidualInteractionBlock",
           "--interaction_first", "RealAgnosticResidualInteractionBlock",
           "--num_channels", str(args.channels), "--max_L", "0", "--max_ell", str(args.max_ell),
           "--correlation", str(args.correlation), "--r_max", str(args.r_max),
           "--num_interactions", "2", "--num_radial_basis", "10", "--num_cutoff_basis", "5",
           "--radial_MLP", "[64, 64, 64]", "--MLP_irreps", "16x0e", "--gate", "silu",
           "--mean", "0.0", "--std", repr(rms),
           "--loss", "weighted", "--energy_weight", repr(w_e), "--forces_weight", repr(w_f),
           "--batch_size", str(args.batch), "--valid_batch_size", str(args.batch),
           "--max_num_epochs", str(args.epochs), "--lr", str(args.lr)]
    if not args.mace_best:
        cmd.append("--save_all_checkpoints")
    threads = {"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else None
    res = _run(cmd, os.path.join(args.work, "mace_torch.log"), env_extra=threads)
    model_path = os.path.join(work, "mace.model")
    logs = [p for p in glob.glob(os.path.join(work, "logs", "*.log")) if "debug" not in p]
    log = open(logs[0]).read() if logs else res["stdout"]
    return {"model": model_path, "wall_s": res["wall_s"], "rms_force": rms,
            "train_loop_s": _log_span(log, "Started training", "Training complete"),
            "epoch_s": _log_epoch_times(log),
            "load_end": res["load_end"], "log": log, "command": cmd}


def evaluate_mace_torch(model_path, files):
    """Test-set errors of mace-torch's model, by chemtrain's summary."""
    import mace.calculators  # import mace before e3nn: e3nn's import torch.load's a file torch's default refuses
    import torch
    model = torch.load(model_path, weights_only=False, map_location="cpu")  # our own file
    n_params = int(sum(p.numel() for p in model.parameters()))
    e0s = model.atomic_energies_fn.atomic_energies.detach().cpu().numpy().ravel().tolist()
    calc = mace.calculators.MACECalculator(models=model, device="cpu", default_dtype="float32")

    def predict(frames):
        E, F = [], []
        for a in frames:
            a = a.copy()
            a.calc = calc
            E.append(a.get_potential_energy())   # includes the E0s
            F.append(a.get_forces())
        return np.array(E), np.stack(F)

    t0 = time.perf_counter()
    frames, e_ref, f_ref = read_xyz(files["test"])
    e, f = predict(frames)
    ref = as_chemtrain_units(frames, e_ref, f_ref)
    pred = as_chemtrain_units(frames, e, f)
    out = {"after": R.summary(pred, ref), "n_params": n_params, "E0s": e0s}
    out["eval_s"] = time.perf_counter() - t0
    return out


def mace_log_test_rmse(log):
    """mace-torch's own test-set RMSEs from its final table (meV/atom, meV/A), if found."""
    if "Error-table on TEST" not in log:
        return None
    table = log.split("Error-table on TEST")[-1]
    rows = [line for line in table.splitlines() if re.match(r"\|\s*\w", line)][1:2]
    try:
        cells = [c.strip() for c in rows[0].split("|") if c.strip()]
        return {"energy_meV_per_atom": float(cells[1]), "force_meV_per_A": float(cells[2])}
    except (IndexError, ValueError):
        return None


def _log_epoch_times(log):
    """mace-torch's per-epoch times (training and validation): differences of the
    time stamps of its 'Initial:' and 'Epoch N:' validation lines."""
    import datetime
    stamps = [datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f")
              for line in log.splitlines() if re.search(r"INFO: (Initial|Epoch \d+):", line)]
    return [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]


def _log_span(log, start, end):
    """Seconds between the first log lines containing ``start`` and ``end``."""
    import datetime
    stamp = lambda key: next((datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f")
                              for line in log.splitlines() if key in line), None)
    a, b = stamp(start), stamp(end)
    return (b - a).total_seconds() if a and b else None


# -- helpers ------------------------------------------------------------------------
def _run(cmd, log_path, cwd=None, env_extra=None):
    print("$ " + " ".join(f"'{c}'" if " " in c else c for c in cmd), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    wall = time.perf_counter() - t0
    with open(log_path, "w") as fh:
        fh.write(proc.stdout)
    if proc.returncode:
        print(proc.stdout[-4000:])
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}); log: {log_path}")
    print(f"  {wall:.1f} s; load average at the end {os.getloadavg()[0]:.1f} "
          f"({os.cpu_count()} cores)", flush=True)
    return {"stdout": proc.stdout, "wall_s": wall, "load_end": os.getloadavg()[0]}


def per_epoch_ratio(ours, theirs):
    """chemtrain's seconds per epoch over mace-torch's, after compilation:
    the medians of epochs 2 onwards on each side (chemtrain's first epoch
    compiles; mace-torch's first is kept out too, alike), and the ratio of
    the fastest epochs (the least loaded figure on a shared machine). None
    with fewer than two epochs on a side."""
    import statistics
    if len(ours) < 2 or len(theirs) < 2:
        return None
    a, b = statistics.median(ours[1:]), statistics.median(theirs[1:])
    return {"chemtrain_s": a, "mace_torch_s": b, "median": a / b,
            "fastest": min(ours[1:]) / min(theirs[1:])}


def row(name, s, wall=None, loop=None):
    e, f = s["energy_eV_per_atom"], s["force_eV_per_A"]
    sec = lambda t: f"{t:8.1f}" if t is not None else " " * 8
    return (f"{name:<38} {e['MAE']:10.5f} {e['RMSE']:10.5f} {f['MAE']:9.4f} {f['RMSE']:9.4f} "
            f"{sec(wall)} {sec(loop)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    files = write_split(args)
    n_atoms = files["n_atoms"]
    w_e, w_f = args.energy_weight, args.forces_weight
    print(f"{args.data} (sha256 {files['sha256'][:12]}): train {args.train}, valid {args.valid}, "
          f"test {args.test}, seed {args.seed}; {n_atoms} atoms; batch {args.batch}, "
          f"{args.epochs} epochs ({args.epochs * (args.train // args.batch)} steps), lr {args.lr}; "
          f"energy_weight {w_e:.4g}, forces_weight {w_f:.4g} (both tools)",
          flush=True)

    ct = run_chemtrain(files, args)
    mt = run_mace_torch(files, args)
    ev = evaluate_mace_torch(mt["model"], files)
    n_ct = chemtrain_param_count(args, files["z"])

    ratio = ct["after"]["force_eV_per_A"]["RMSE"] / ev["after"]["force_eV_per_A"]["RMSE"]
    own = mace_log_test_rmse(mt["log"])
    print()
    print(f"Test set: {args.test} structures. Energies eV/atom, forces eV/A (components).")
    print(f"{'':<38} {'E MAE':>10} {'E RMSE':>10} {'F MAE':>9} {'F RMSE':>9} {'wall s':>8} "
          f"{'epochs s':>8}")
    if ct.get("before"):
        print(row("chemtrain, initial model", ct["before"]))
    print(row("chemtrain", ct["after"], ct["wall_s"], ct.get("train_loop_s")))
    print(row("mace-torch (mace_run_train)", ev["after"], mt["wall_s"], mt["train_loop_s"]))
    print("wall s: the whole run; epochs s: its training epochs with their validation passes "
          "(chemtrain: sum of metrics.jsonl time_s; mace-torch: log time from 'Started training' "
          "to 'Training complete', including its initial validation)")
    fmt = lambda ts: ", ".join(f"{t:.1f}" for t in ts)
    print(f"seconds per epoch (30 steps of {args.batch} + validation; the first compiles in "
          f"chemtrain): chemtrain [{fmt(ct.get('epoch_s', []))}], mace-torch "
          f"[{fmt(mt['epoch_s'])}]; on a shared machine the fastest epoch is the least loaded")
    epoch_ratio = per_epoch_ratio(ct.get("epoch_s", []), mt["epoch_s"])
    if epoch_ratio is not None:
        print(f"seconds per epoch after compilation (median over epochs 2..): chemtrain "
              f"{epoch_ratio['chemtrain_s']:.2f}, mace-torch {epoch_ratio['mace_torch_s']:.2f}; "
              f"ratio chemtrain / mace-torch {epoch_ratio['median']:.3f} (fastest epochs "
              f"{epoch_ratio['fastest']:.3f}; target <= 1.0: "
              f"{'met' if epoch_ratio['median'] <= 1.0 else 'NOT met'})")
    print(f"parameters: chemtrain {n_ct}" +
          (f" (run reports {ct['n_params_reported']})" if ct.get("n_params_reported") else "") +
          f", mace-torch {ev['n_params']}")
    if own:
        print(f"mace-torch's own test table: energy RMSE {own['energy_meV_per_atom']} meV/atom, "
              f"force RMSE {own['force_meV_per_A']} meV/A (ours above: "
              f"{1e3 * ev['after']['energy_eV_per_atom']['RMSE']:.1f}, "
              f"{1e3 * ev['after']['force_eV_per_A']['RMSE']:.1f})")
    print(f"force RMSE chemtrain / mace-torch: {ratio:.3f} (target <= 1.1: "
          f"{'met' if ratio <= 1.1 else 'NOT met'})")

    result = {"cores": os.cpu_count(), "data": args.data, "data_sha256": files["sha256"], "seed": args.seed,
              "train": args.train, "valid": args.valid, "test": args.test, "batch": args.batch,
              "epochs": args.epochs, "steps": args.epochs * (args.train // args.batch),
              "lr": args.lr, "energy_weight": w_e, "forces_weight": w_f,
              "mace_model": "best-validation" if args.mace_best else "last epoch",
              "torch_threads": args.torch_threads,
              "chemtrain": {"before": ct.get("before"), "after": ct["after"], "wall_s": ct["wall_s"],
                            "train_loop_s": ct.get("train_loop_s"), "epoch_s": ct.get("epoch_s"),
                            "n_params": n_ct,
                            "load_end": ct.get("load_end"),
                            "command": ct["command"]},
              "mace_torch": {"after": ev["after"],
                             "wall_s": mt["wall_s"], "train_loop_s": mt["train_loop_s"], "epoch_s": mt["epoch_s"],
                             "eval_s": ev["eval_s"],
                             "load_end": mt["load_end"],
                             "n_params": ev["n_params"], "E0s": ev["E0s"], "std": mt["rms_force"],
                             "own_test_rmse": own, "command": mt["command"]},
              "force_rmse_ratio": ratio, "target": 1.1, "target_met": ratio <= 1.1,
              "epoch_ratio": epoch_ratio}
    with open(os.path.join(args.work, "result.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
