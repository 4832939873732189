"""On-the-fly active learning of a Cu-Au alloy with surfaces, heated past
melting, with EMT as the oracle: ``chemtrain.active`` against random
selection from the same kind of MD frames.

    .venv/bin/python examples/active/cu_au_on_the_fly.py --out runs/active_cuau
    .venv/bin/python examples/active/cu_au_on_the_fly.py --quick   # a smoke run, 4 min

The system: a random Cu-Au bulk alloy (32 atoms, periodic) and a Cu-Au
(111) slab with vacuum (16 atoms), MD at 600 K and 1600 K (EMT's alloy melts
near 1300 K). The seed set is 20 structures rattled about the two starting
structures; the test set is 48 frames of EMT's own Langevin MD of both
structures at 300-1600 K (not seen by the loop, which runs MD with the
committee). Each round the committee (4 small MACE members) runs the MD,
up to 10 frames are labelled and the members are retrained from their
current parameters. ``diverse_t<T>`` picks among the frames whose spread
passes T times the training set's median by farthest-point sampling;
``random`` draws from all frames of its MD runs and gets more rounds
(``--random_rounds``, default twice ``--rounds``), so that one can read how
many labels it needs to reach the active loop's final error. The final
committee's calibration is measured on the odd test frames, with the scale
fitted on the even ones.

Measured (2026-12-06, 2 cores; docs/examples.md): about 1.2 min per round
of the active loop, 1.5 min per round of random selection near 140 labels.
The parts are tested in tests/test_active.py.

Writes ``<out>/<run>_seed<k>/`` (each a resumable ``chemtrain.active``
folder: start the script again and it continues), ``<out>/curves.png`` and
``<out>/results.json`` (merged with an earlier call's seeds).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

SIZES = ["--num_channels", "16", "--max_L", "0", "--max_ell", "2", "--correlation", "2",
         "--r_max", "4.5", "--radial_MLP", "[32, 32]", "--batch_size", "4"]


def starting_structures(seed: int = 7):
    from ase.build import bulk, fcc111
    rng = np.random.default_rng(seed)
    alloy = bulk("Cu", "fcc", a=3.61, cubic=True) * (2, 2, 2)
    alloy.numbers = np.where(rng.uniform(size=len(alloy)) < 0.5, 79, 29)
    alloy.set_cell(alloy.cell * 1.065, scale_atoms=True)   # Vegard's law at half gold, roughly
    slab = fcc111("Cu", size=(2, 2, 4), vacuum=6.0, a=3.84)
    slab.numbers = np.where(rng.uniform(size=len(slab)) < 0.5, 79, 29)
    slab.info.pop("adsorbate_info", None)
    return [alloy, slab]


def emt_labelled(atoms):
    from ase.calculators.emt import EMT
    from chemtrain.active.files import labelled_copy
    a = atoms.copy()
    a.calc = EMT()
    return labelled_copy(atoms, a.get_potential_energy(), a.get_forces())


def seed_labels(structures, n: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        a = structures[k % len(structures)].copy()
        a.rattle(float(rng.uniform(0.03, 0.12)), seed=int(rng.integers(1 << 30)))
        out.append(emt_labelled(a))
    return out


def test_frames(structures, per_run: int, seed: int):
    """Frames of EMT's own MD of each structure at four temperatures."""
    from ase import units
    from ase.calculators.emt import EMT
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    rng = np.random.default_rng(seed)
    out = []
    for atoms in structures:
        for t in (300.0, 700.0, 1200.0, 1600.0):
            a = atoms.copy()
            a.calc = EMT()
            MaxwellBoltzmannDistribution(a, temperature_K=t, rng=rng)
            dyn = Langevin(a, 2 * units.fs, temperature_K=t, friction=0.02 / units.fs,
                           fixcm=False, rng=rng)
            for _ in range(per_run):
                dyn.run(150)
                out.append(emt_labelled(a))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/active_cuau")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--thresholds", type=float, nargs="+", default=[1.0],
                   help="relative thresholds of the active loop (x the training set's median "
                        "spread); each is a run of its own")
    p.add_argument("--random_rounds", type=int,
                   help="rounds of random selection (default: twice --rounds)")
    p.add_argument("--quick", action="store_true", help="2 rounds, short MD, few epochs")
    args = p.parse_args(argv)
    from ase.calculators.emt import EMT
    from chemtrain import active
    structures = starting_structures()
    rounds = 2 if args.quick else args.rounds
    test = test_frames(structures, 2 if args.quick else 6, seed=123)
    path = os.path.join(args.out, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else {}   # earlier calls' seeds
    for seed in args.seeds:
        labels = seed_labels(structures, 20, seed)
        runs = [(f"diverse_t{t:g}", "diverse", t, rounds) for t in args.thresholds]
        runs.append(("random", "random", 2.0, args.random_rounds or 2 * rounds))
        for name, strategy, threshold, n_rounds in runs:
            settings = active.Settings(
                rounds=n_rounds, labels_per_round=10, ensemble_size=4,
                epochs_first=10 if args.quick else 60, epochs_per_round=5 if args.quick else 20,
                finetune_args=SIZES, temperatures_K=(600.0, 1600.0),
                md_steps=200 if args.quick else 1000, record_every=10, threshold=threshold,
                selection=strategy, seed=seed)
            folder = os.path.join(args.out, f"{name}_seed{seed}")
            print(f"== {name}, seed {seed}: {folder}", flush=True)
            out = active.run(folder, oracle=EMT, seeds=structures, labelled=labels,
                             settings=settings, test=test,
                             say=lambda line: print(line, flush=True))
            results[f"{name}_seed{seed}"] = [
                (s["labels"], active.report.test_rmse(s.get("trained"))) for s in out["rounds"]]
            if strategy == "diverse":
                results[f"calibration_{name}_seed{seed}"] = calibrate(out["members"], test)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "curves.png"))
    for seed in args.seeds:
        for t in args.thresholds:
            print(f"threshold {t:g}: " + verdict(results[f"diverse_t{t:g}_seed{seed}"],
                                                 results[f"random_seed{seed}"], seed))
        for kind, c in results[f"calibration_diverse_t{args.thresholds[0]:g}_seed{seed}"].items():
            print(f"  {kind} spread on the held-out half of the test frames: within 1/2/3 std "
                  f"{c['within']['1']:.3f}/{c['within']['2']:.3f}/{c['within']['3']:.3f} "
                  f"(Gaussian 0.683/0.954/0.997), miscalibration area "
                  f"{c['miscalibration_area']:.3f}, Spearman {c['spearman']:.2f}, scale "
                  f"{c['scale']:.3g}")
    return 0


def calibrate(members, test) -> dict:
    """The final committee's calibration on the odd test frames, raw and with
    the spread's scale fitted on the even ones."""
    from chemtrain import uncertainty as U
    from chemtrain.finetune.family import committee_of
    committee = committee_of(members)
    fit, held = test[0::2], test[1::2]
    reference = lambda frames: [a.arrays["REF_forces"] for a in frames]  # noqa: E731
    scale = U.fit_scale(U.committee_forces(committee, fit), reference(fit))
    predictions = U.committee_forces(committee, held)
    out = {}
    for kind, s in (("raw", 1.0), ("scaled", scale)):
        report = U.calibration(predictions, reference(held), s)
        report["within"] = {str(k): v for k, v in report["within"].items()}
        out[kind] = {k: v for k, v in report.items() if k != "per_structure"}
    return out


def labels_to_reach(curve, target: float):
    """The fewest labels at which ``curve`` ((labels, RMSE) per round) is at or below ``target``."""
    hits = [n for n, e in curve if e is not None and e <= target]
    return min(hits) if hits else None


def verdict(active_curve, random_curve, seed: int) -> str:
    n_active, e_active = active_curve[-1]
    n_random = labels_to_reach(random_curve, e_active)
    most = random_curve[-1][0]
    reach = (f"random selection reaches it with {n_random} labels "
             f"({n_random / n_active:.2f}x)" if n_random else
             f"random selection does not reach it within {most} labels (> {most / n_active:.2f}x)")
    return f"seed {seed}: active loop: test force RMSE {e_active:.4f} eV/Å with {n_active} " \
           f"labels; {reach}"


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = sorted((k, v) for k, v in results.items() if not k.startswith("calibration"))
    for k, (name, curve) in enumerate(curves):
        n, e = zip(*[(a, b) for a, b in curve if b is not None])
        ax.plot(n, e, "s--" if name.startswith("random") else "o-", ms=3, color=f"C{k}",
                label=name)
    ax.set_xlabel("labels")
    ax.set_ylabel("test force RMSE (eV/Å)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
