"""Upstream chemtrain's own two-particle DiffTRe test, trained by this project
and (optionally) by upstream chemtrain 0.2.0 in the same sitting, alternating
(issue 47): time to the answer at the default reuse rule.

    .venv/bin/python benchmarks/difftre_upstream_test.py --seeds 0 1 2 3 4 \\
        [--rule default|upstream] [--upstream ~/upstream-venv/bin/python]

The problem is upstream's test (``tests/test_trainers/test_difftre.py`` of
chemtrain 0.2.0, as ``../shared/bench/upstream_difftre.py`` runs it): a
harmonic bond between two particles in a 1 nm box, kT 2.56, Langevin dt 0.01,
gamma 0.5, mass 10, trajectories of 1,100 time units (100 equilibration,
1,000 snapshots) in 2 chains, reweight_ratio 0.99, RMS-scaled steps decaying
from 0.05 to 0.005 over 300 updates, RDF target of r_0 0.35. The smoothed
loss's exact minimum is r_0 0.3553.

Prints one JSON line per run: ``total_train_s`` (the 300 ``train(1)``
calls), ``recomputes``, the final r_0 and the mean of the last two updates'
r_0 (with their error against 0.3553 in %), the final RDF MSE against the
analytic target. Why both r_0 figures: at this optimizer's last learning
rate (0.005, RMS-normalised) the parameters alternate between two values
about 0.005 apart over the last updates whatever estimates the gradient, so
the last iterate is up to ~0.7 % from the optimum by construction; the mean
of the last two is the centre of that cycle. ``--upstream`` runs upstream's
script (``../shared/bench/upstream_difftre.py``) with the same seed before
each of ours.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

R0_OPT = 0.3553
UPSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                        "bench", "upstream_difftre.py")


def analytic_rdf(r, r_0=0.35, b=250.0, kT=2.56, box=1.0):
    """The g(r) of upstream's test: a Gaussian bond-length density of
    stiffness b / kT around r_0, as upstream's test writes it."""
    b = b / kT
    norm = np.sqrt(np.pi / (2 * b)) * (1 + b * r_0 ** 2) / b
    return box ** 3 / (16 * np.pi) * np.exp(-0.5 * b * (r - r_0) ** 2) / norm


def ours(seed: int, rule: str, updates: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from jax_md import energy, partition, simulate, space

    from chemtrain import quantity
    from chemtrain.learn import ReuseRule
    from chemtrain.simulate import process_printouts
    from chemtrain.trainers import Difftre, RunOptions

    displacement, shift = space.periodic_general(1.0)

    def template(p):
        return energy.simple_spring_bond(displacement, jnp.asarray([[0, 1]]), length=p["r_0"],
                                         epsilon=100 * p["scaled_b"], alpha=2.0)
    bins = quantity.rdf_discretization(1.0, 50, 0.0)
    target = analytic_rdf(np.asarray(bins.bin_centers))
    optimizer = optax.chain(optax.scale_by_rms(0.9),
                            optax.scale_by_schedule(optax.exponential_decay(-0.05, 300, 0.1)))
    r0s = []
    options = {} if rule == "default" else {
        "reuse": ReuseRule(pool=1, max_reuse_se=None, max_reuses=None)}
    trainer = Difftre({"r_0": jnp.asarray(0.3), "scaled_b": jnp.asarray(1.5)}, optimizer,
                      reweight_ratio=0.99, key=jax.random.PRNGKey(seed),
                      checkpoint_path=tempfile.mkdtemp(prefix="difftre-upstream-test-"),
                      **options, options=RunOptions(progress=False, on_update=lambda rec: r0s.append(
                          float(rec["params_after"]["r_0"]))))
    start = np.array([[0.0, 0.0, 0.0], [0.11, 0.09, 0.12]])
    trainer.add_statepoint(
        template, functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.01, kT=2.56,
                                    gamma=0.5, mass=10.0),
        partition.neighbor_list(displacement, 1.0, 0.5), process_printouts(0.01, 1100, 100, 1.0),
        {"kT": 2.56}, {"rdf": quantity.rdf(displacement, bins, box=1.0,
                                           periodic_images="nearest")},
        np.stack([start, start]), targets={"rdf": {"target": target, "gamma": 1.0}},
        vmap_batch=2)
    started = time.perf_counter()
    for _ in range(updates):
        trainer.train(1)
    total = time.perf_counter() - started
    pred = np.asarray(trainer.predictions[0]["rdf"])
    mid = 0.5 * (r0s[-1] + r0s[-2])
    return {"tool": "chemtrain", "rule": rule, "seed": seed, "updates": updates,
            "total_train_s": round(total, 2),
            "recomputes": sum(r["recomputed"] for e in trainer.history for r in e["statepoints"]),
            "pool": trainer.trajectories.pools[0],
            "r_0": r0s[-1], "r_0_error_pct": round(100 * (r0s[-1] / R0_OPT - 1), 3),
            "r_0_last_two": mid, "last_two_error_pct": round(100 * (mid / R0_OPT - 1), 3),
            "final_rdf_mse": float(np.mean((pred - target) ** 2))}


def upstream(python: str, seed: int, updates: int) -> dict:
    out = subprocess.run([python, UPSTREAM, "--updates", str(updates)], capture_output=True,
                         text=True, env=dict(os.environ, SEED=str(seed)), check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    r0 = row["params"]["r_0"]
    return {"tool": "upstream chemtrain 0.2.0", "seed": seed, "updates": updates,
            "total_train_s": round(row["total_train_s"], 2), "r_0": r0,
            "r_0_error_pct": round(100 * (r0 / R0_OPT - 1), 3),
            "final_rdf_mse": row["final_rdf_mse"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--rule", choices=("default", "upstream"), default="default")
    p.add_argument("--upstream", default=None, help="python of upstream chemtrain's venv")
    args = p.parse_args(argv)
    for seed in args.seeds:
        if args.upstream:
            print(json.dumps(upstream(args.upstream, seed, args.updates)), flush=True)
        print(json.dumps(ours(seed, args.rule, args.updates)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
