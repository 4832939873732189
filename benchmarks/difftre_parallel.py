"""DifftreParallel over MPI ranks: wall time per epoch for 4 state points on
1 and 2 ranks, and the share spent in communication.

    .venv/bin/python benchmarks/difftre_parallel.py [--ranks 1,2] [--epochs 3] [--particles 128]

System: the argon-like Lennard-Jones fluid of benchmarks/difftre.py at four
temperatures (100, 120, 140, 160 K), learning sigma and epsilon from RDF
targets. All four state points form one update (``sim_batch_size=-1``),
so 2 ranks compute 2 state points each. ``--reweight-ratio 1`` (the default)
recomputes every trajectory in every update: the simulation cost that
spreading state points over ranks is meant to divide. Each rank count runs
as its own ``mpirun -np N`` job; the first epoch (compilation) is dropped and
the median of the others kept. "Communication" is the slowest rank's time
per epoch in exchanging recomputed trajectory states and summing gradients
(the trainer's ``comm_s``); "waiting" is its time waiting for the other
ranks to finish their state points (``wait_s``: load imbalance).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args):
    import logging

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    sys.path.insert(0, HERE)
    from difftre import build

    from chemtrain import quantity
    from chemtrain.simulate import process_printouts
    from chemtrain.trainers.difftre import DifftreParallel
    from chemtrain.trainers import RunOptions
    from chemtrain.units import kT
    logging.basicConfig(level=logging.WARNING)
    system = build(args.particles, jnp.float32)
    kTs = np.array([kT(t) for t in (100.0, 120.0, 140.0, 160.0)])
    rdf = quantity.rdf_discretization(0.85, 130, 0.2)
    dt = 0.01
    timings = process_printouts(dt, dt * (100 + 10 * args.snapshots), dt * 100, dt * 10)
    trainer = DifftreParallel(
        jax.random.PRNGKey(0), {"sigma": jnp.asarray(0.32), "epsilon": jnp.asarray(0.99)},
        optax.rmsprop(0.01), system["template"], system["simulator"], system["neighbor_fn"],
        timings, {"kT": kTs, "mass": np.full(4, 39.95)},
        {"rdf": quantity.rdf(system["displacement"], rdf, box=system["box"])},
        {"rdf": {"target": np.ones((4, 130)), "gamma": 1.0}},
        reference_states=np.broadcast_to(np.asarray(system["R0"]), (4, *system["R0"].shape)),
        sim_batch_size=-1, reweight_ratio=args.reweight_ratio, parallelism="auto",
        checkpoint_path=os.path.join(args.out, "ckpt"), options=RunOptions(progress=False))
    trainer.initialize_trajstates()
    trainer.train(1 + args.epochs)
    epochs = trainer.history[1:]
    if trainer.strategy.is_root:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"time_s": float(np.median([e["time_s"] for e in epochs])),
                       "comm_s": float(np.median([e["comm_s"] for e in epochs])),
                       "wait_s": float(np.median([e["wait_s"] for e in epochs])),
                       "recomputed": sum(r["recomputed"] for e in epochs
                                         for r in e["statepoints"]),
                       "statepoint_updates": sum(len(e["statepoints"]) for e in epochs),
                       "ranks": trainer.strategy.process_count}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--particles", type=int, default=128)
    p.add_argument("--snapshots", type=int, default=100)
    p.add_argument("--reweight-ratio", type=float, default=1.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device per rank
    env.setdefault("JAX_PLATFORMS", "cpu")
    results = {}
    for n in [int(r) for r in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as out:
            cmd = [mpirun, "-np", str(n), sys.executable, os.path.abspath(__file__), "--worker",
                   "--out", out, "--epochs", str(args.epochs), "--particles",
                   str(args.particles), "--snapshots", str(args.snapshots),
                   "--reweight-ratio", str(args.reweight_ratio)]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if run.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
            with open(os.path.join(out, "result.json")) as f:
                results[n] = json.load(f)
        r = results[n]
        print(f"{n} rank(s): {r['time_s']:.2f} s per epoch, communication {r['comm_s']:.3f} s "
              f"({100 * r['comm_s'] / r['time_s']:.1f} %), waiting {r['wait_s']:.3f} s "
              f"({100 * r['wait_s'] / r['time_s']:.1f} %); {r['recomputed']} of "
              f"{r['statepoint_updates']} state-point updates recomputed", flush=True)
    base = min(results)
    for n in sorted(results):
        if n != base:
            print(f"speed-up {n} ranks over {base}: "
                  f"{results[base]['time_s'] / results[n]['time_s']:.2f}x")
    print(f"({args.particles} LJ particles, 4 state points, {args.snapshots} snapshots of 10 "
          f"steps after 100, float32, median of {args.epochs} epochs after the first)")


if __name__ == "__main__":
    main()
