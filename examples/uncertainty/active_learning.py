"""Active learning with a committee: label the structures the committee is
least sure about, against labelling structures at random.

    .venv/bin/python examples/uncertainty/active_learning.py [--seed 0]   # about 7 min on 2 cores
    .venv/bin/python examples/uncertainty/active_learning.py --quick    # a smoke run, 2 min

Data (ASE's EMT, eV and Angstrom): a pool of Cu/Au structures of four kinds,
bulk Cu, bulk Au, random bulk Cu-Au alloys (32 atoms each) and (111)
slabs of Cu or Au with vacuum (16 atoms); a test set of the same kinds
(drawn separately) and a calibration set. The seed set is narrow on
purpose: bulk Cu and bulk Au only.

Each round trains a 4-member committee of a small MACE from scratch with
``chemtrain-finetune --ensemble_size 4`` on the labels so far, measures its
test force RMSE, then adds 20 pool structures: the 20 with the largest
force spread (``chemtrain.uncertainty.select``, as ``chemtrain-select``
does), or 20 at random. Three rounds after the seed: 20, 40, 60, 80 labels.
The plot shows test force RMSE against labels for both strategies; the
final uncertainty committee's calibration (Spearman correlation of
predicted spread and actual error, errors within 1/2/3 predicted std, raw
and with the scale fitted on the calibration set) is printed and drawn.
Whatever the outcome, it is printed as measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = ["--num_channels", "8", "--max_L", "0", "--max_ell", "1", "--correlation", "2",
         "--r_max", "4.0", "--radial_MLP", "[16, 16]"]
KINDS = ("bulk Cu", "bulk Au", "bulk alloy", "slab")


def structure(kind: str, rng):
    from ase.build import bulk, fcc111
    if kind == "slab":
        metal = ("Cu", "Au")[rng.integers(2)]
        a = fcc111(metal, size=(2, 2, 4), vacuum=6.0, a=3.61 if metal == "Cu" else 4.08)
        a.info.pop("adsorbate_info", None)   # not plain data: extxyz cannot write it
    else:
        metal = {"bulk Cu": "Cu", "bulk Au": "Au"}.get(kind, "Cu")
        a = bulk(metal, "fcc", a=3.61 if metal == "Cu" else 4.08, cubic=True) * (2, 2, 2)
        if kind == "bulk alloy":
            gold = rng.uniform(0.2, 0.8)
            a.numbers = np.where(rng.uniform(size=len(a)) < gold, 79, 29)
            a.set_cell(a.cell * (1 + 0.13 * gold), scale_atoms=True)   # Vegard's law, roughly
    a.set_cell(a.cell * (1 + 0.03 * rng.standard_normal()), scale_atoms=True)
    a.rattle(float(rng.uniform(0.02, 0.1)), seed=int(rng.integers(1 << 30)))
    return a


def labelled(kinds, seed):
    from ase.calculators.emt import EMT
    rng = np.random.default_rng(seed)
    out = []
    for kind in kinds:
        a = structure(kind, rng)
        a.calc = EMT()
        a.info.update(REF_energy=a.get_potential_energy(), kind=kind)
        a.arrays["REF_forces"] = a.get_forces()
        a.calc = None
        out.append(a)
    return out


def train(frames, test_file, folder, epochs, seed):
    """A committee trained on ``frames``; returns (test force RMSE, member files)."""
    import ase.io
    from chemtrain.finetune import run
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "train.xyz")
    ase.io.write(path, frames, format="extxyz")
    results = run(["--train_file", path, "--test_file", test_file, "--valid_fraction", "0.1",
                   "--results_dir", os.path.join(folder, "run"), "--ensemble_size", "4",
                   "--max_num_epochs", str(epochs), "--batch_size", "4", "--lr", "0.01",
                   "--seed", str(seed), "--no_torch_export", *SIZES])
    return results["after"]["force_eV_per_A"]["RMSE"], results["members_npz"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/active_learning")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per_round", type=int, default=20)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--pool", type=int, default=200)
    p.add_argument("--seed", type=int, default=0,
                   help="draws the sets (seed to seed + 4), the random picks and the training")
    p.add_argument("--quick", action="store_true", help="small sets and few epochs: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.per_round, args.epochs, args.pool = 1, 6, 3, 24
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    import ase.io
    from chemtrain.calculator import CommitteeCalculator
    from chemtrain.uncertainty import (calibration, committee_forces, fit_scale,
                                       plot_calibration, select)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    n_seed = 2 * max(args.per_round // 2, 2)
    seed_set = labelled(["bulk Cu", "bulk Au"] * (n_seed // 2), seed=args.seed + 1)
    pool = labelled([KINDS[i % 4] for i in range(args.pool)], seed=args.seed + 2)
    test = labelled([KINDS[i % 4] for i in range(max(args.pool // 4, 8))], seed=args.seed + 3)
    calib = labelled([KINDS[i % 4] for i in range(max(args.pool // 8, 8))], seed=args.seed + 4)
    test_file = os.path.join(args.out, "test.xyz")
    ase.io.write(test_file, test, format="extxyz")

    curves = {}
    picked_kinds = {}
    members = {}
    for strategy in ("uncertainty", "random"):
        labels, left = list(seed_set), list(range(len(pool)))
        curve, kinds = [], []
        for r in range(args.rounds + 1):
            folder = os.path.join(args.out, strategy, f"round{r}")
            if r == 0 and strategy == "random":   # the same seed committee for both
                rmse, files = curves["uncertainty"][0][1], members["seed"]
            else:
                rmse, files = train(labels, test_file, folder, args.epochs, seed=args.seed)
            if r == 0:
                members["seed"] = files
            curve.append((len(labels), rmse))
            print(f"{strategy:>11}, round {r}: {len(labels)} labels, test force RMSE "
                  f"{rmse:.4f} eV/A", flush=True)
            if r == args.rounds:
                members[strategy] = files
                break
            if strategy == "uncertainty":
                committee = CommitteeCalculator.from_mace(files)
                chosen = select(committee, [pool[i] for i in left], args.per_round)
            else:
                chosen = rng.choice(len(left), args.per_round, replace=False)
            take = [left[int(i)] for i in chosen]
            kinds.append([pool[i].info["kind"] for i in take])
            labels += [pool[i] for i in take]
            left = [i for i in left if i not in set(take)]
        curves[strategy], picked_kinds[strategy] = curve, kinds

    committee = CommitteeCalculator.from_mace(members["uncertainty"])
    ref = lambda frames: [a.arrays["REF_forces"] for a in frames]  # noqa: E731
    scale = fit_scale(committee_forces(committee, calib), ref(calib))
    test_pred = committee_forces(committee, test)
    raw, fitted = calibration(test_pred, ref(test)), calibration(test_pred, ref(test), scale)
    for name, rep in (("raw", raw), ("scaled", fitted)):
        print(f"calibration on the test set ({name}, scale {rep['scale']:.3g}): Spearman "
              f"{rep['spearman']:.3f}; force components within 1/2/3 predicted std: "
              f"{rep['within'][1]:.3f}/{rep['within'][2]:.3f}/{rep['within'][3]:.3f} "
              f"(Gaussian 0.683/0.954/0.997)")
    plot_calibration(fitted, os.path.join(args.out, "calibration.png"))
    for strategy, kinds in picked_kinds.items():
        counts = {k: sum(x.count(k) for x in kinds) for k in KINDS}
        print(f"{strategy} picked: {counts}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.8))
    for strategy, curve in curves.items():
        n, rmse = zip(*curve)
        ax.plot(n, rmse, "o-", label=f"{strategy} selection")
    ax.set_xlabel("labelled structures")
    ax.set_ylabel("test force RMSE (eV/Å)")
    ax.set_title("4-member committee, EMT Cu/Au", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "active_learning.png"), dpi=120)
    summary = {"curves": curves, "picked_kinds": picked_kinds, "calibration": {
        k: {kk: v for kk, v in rep.items() if kk != "per_structure"}
        for k, rep in (("raw", raw), ("scaled", fitted))}}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"Plots: {args.out}/active_learning.png, {args.out}/calibration.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
