"""Reweighting trainers on problems with known answers (issue 31): does the
answer stay at the optimum when trajectories are reused?

    .venv/bin/python benchmarks/reweighting_known_answers.py --problem re-bond \
        --updates 800 --seeds 0 1 2 3 [--max-reuse-se 0.2 | --max-reuse-se 0] \
        [--max-reuses 4 | --max-reuses -1] [--pool 1] [--reweight-ratio 0.9] [--plot kb.png]

Problems (``benchmarks/reweighting_problems.py``):

- ``re-bond``: RelativeEntropy, two beads with a harmonic bond against 4,000
  exact reference configurations (true b0 0.154 nm, kb 4e4 kJ/mol/nm^2);
- ``difftre-bond``: Difftre on the same system with exact moment targets;
- ``re-lj``: RelativeEntropy on the LJ fluid of
  ``examples/relative_entropy/cg_bond_and_lj.py`` (true sigma 0.34 nm,
  epsilon 0.99 kJ/mol; two temperatures).

``--max-reuse-se 0 --max-reuses -1`` switches both new rules off (only
``N_eff < reweight_ratio N``, the rule before issue 31); ``--pool 1`` reweights
one trajectory (DiffTRe's rule before issue 47). Prints one JSON line per
seed: the parameters after every 100 updates, the final ones, their range
over the last quarter of the updates (relative to the final value) and the
number of updates that recomputed a trajectory; with ``--plot`` every
parameter against the update for every seed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import chemtrain  # noqa: F401  (before jax_md)
import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "relative_entropy"))
import reweighting_problems as rp  # noqa: E402


def build(problem, seed, options):
    if problem == "re-bond":
        trainer, lengths = rp.relative_entropy_bond(seed, **options)
        b0, kb = rp.relative_entropy_optimum(lengths)
        return trainer, rp.bond_params, {"b0": rp.BOND["b0"], "kb": rp.BOND["kb"]}, \
            {"b0": b0, "kb": kb}
    if problem == "difftre-bond":
        return rp.difftre_bond(seed, **options), rp.bond_params, \
            {"b0": rp.BOND["b0"], "kb": rp.BOND["kb"]}, None
    import cg_bond_and_lj as ex
    trainer, truth = ex.lj_trainer(seed, **options)
    return trainer, lambda p: {k: float(v) for k, v in ex.lj_parameters(p).items()}, truth, None


def run(problem, seed, updates, options):
    rows = []

    def on_update(record):
        r = record["statepoints"]
        rows.append(dict(convert(record["params_after"]),
                         recomputed=any(v["recomputed"] for v in r.values())))
    trainer, convert, truth, optimum = build(problem, seed, dict(options, on_update=on_update))
    started = time.perf_counter()
    trainer.train(updates // max(1, len(trainer.batches())))
    names = list(truth)
    values = {k: np.array([row[k] for row in rows]) for k in names}
    q = max(1, len(rows) // 4)
    out = {"problem": problem, "seed": seed, "updates": len(rows),
           "reweight_ratio": trainer.reweight_ratio, "max_reuse_se": trainer.max_reuse_se,
           "max_reuses": trainer.max_reuses, "pool": trainer.trajectories.pools.get(0, 1),
           "truth": truth, "reference_optimum": optimum,
           "at": {n: {k: round(float(values[k][n - 1]), 6) for k in names}
                  for n in range(100, len(rows) + 1, 100)},
           "final": {k: float(values[k][-1]) for k in names},
           "final_error": {k: float(values[k][-1] / truth[k] - 1) for k in names},
           "last_quarter_range": {k: float(np.ptp(values[k][-q:]) / values[k][-1])
                                  for k in names},
           "recomputes": int(sum(row["recomputed"] for row in rows)),
           "train_s": round(time.perf_counter() - started, 1)}
    return out, values


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problem", choices=("re-bond", "difftre-bond", "re-lj"), default="re-bond")
    p.add_argument("--updates", type=int, default=400)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--reweight-ratio", type=float, default=None)
    p.add_argument("--max-reuse-se", type=float, default=None,
                   help="0: rule off; default: the trainer's default")
    p.add_argument("--max-reuses", type=int, default=None,
                   help="-1: no limit; default: the trainer's default")
    p.add_argument("--pool", type=int, default=None,
                   help="trajectories reweighted together; default: the trainer's default")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    options = {"progress": False}
    if args.reweight_ratio is not None:
        options["reweight_ratio"] = args.reweight_ratio
    rule = {}
    if args.max_reuse_se is not None:
        rule["max_reuse_se"] = args.max_reuse_se or None
    if args.max_reuses is not None:
        rule["max_reuses"] = None if args.max_reuses < 0 else args.max_reuses
    if args.pool is not None:
        rule["pool"] = args.pool
    if rule:
        from chemtrain.learn import ReuseRule
        options["reuse"] = ReuseRule(**rule)
    curves = []
    for seed in args.seeds:
        options["checkpoint_path"] = tempfile.mkdtemp(prefix="known-answers-")
        out, curve = run(args.problem, seed, args.updates, options)
        print(json.dumps(out), flush=True)
        curves.append((seed, curve, out))
    if args.plot:
        from matplotlib.figure import Figure
        names = list(curves[0][2]["truth"])
        fig = Figure(figsize=(5.2 * len(names), 3.8), constrained_layout=True)
        axes = fig.subplots(1, len(names))
        for ax, name in zip(axes, names):
            truth = curves[0][2]["truth"][name]
            for seed, curve, out in curves:
                ax.plot(np.arange(1, len(curve[name]) + 1), curve[name], lw=1,
                        label=f"seed {seed}")
            ax.axhline(truth, color="k", ls="--", lw=1, label="truth")
            ax.axhspan(truth * 0.95, truth * 1.05, color="k", alpha=0.08, label="within 5 %")
            ax.set_xlabel("update")
            ax.set_ylabel(name)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{args.problem}: reweight_ratio {curves[0][2]['reweight_ratio']}, "
                     f"max_reuse_se {curves[0][2]['max_reuse_se']}, "
                     f"max_reuses {curves[0][2]['max_reuses']}", fontsize=9)
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
