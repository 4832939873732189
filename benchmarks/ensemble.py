"""Committees: K members trained in one vectorised step against K single
trainings, the committee calculator against K separate calculators, and
peak memory against K.

    .venv/bin/python benchmarks/ensemble.py [--members 4] [--frames 48] [--epochs 3]

System: bulk Cu cells (fcc, 2x2x2 conventional, 32 atoms, rattled, EMT
labels), precomputed graphs, a small MACE (8 channels, L_max 0,
spherical harmonics to l = 1, correlation 2, r_max 4 A, radial MLP
[16, 16]), float32, batch 4.

1. Training, each side in a fresh process, one after the other: an
   ``EnsembleOfModels`` of K members against K ``ForceMatching`` runs of the
   same members on the same data, one after the other (each with its own
   compilation). Wall time per epoch after the first (compiling) epoch;
   for the K single runs the sum of their per-epoch times. Ratio target on
   CPU: at most 0.6. ``--model pair``: the same comparison on a pair MLP
   (32 hidden units, 32 Lennard-Jones particles), training only.
2. The ASE calculators on one 108-atom cell: a ``CommitteeCalculator`` of K
   members against K ``ChemtrainCalculator`` calls (median of 20 after
   warm-up).
3. Peak resident memory of a training process against K (1 = one
   ``ForceMatching``), each in a fresh process.

Prints one line per measurement and one JSON line with everything.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = dict(num_channels=8, max_L=0, max_ell=1, correlation=2, r_max=4.0,
             radial_MLP=(16, 16))


def frames(n, seed=0, size=2):
    from ase.build import bulk
    from ase.calculators.emt import EMT
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = bulk("Cu", "fcc", a=3.61, cubic=True) * (size, size, size)
        a.rattle(0.08, seed=int(rng.integers(1 << 30)))
        a.calc = EMT()
        a.info["REF_energy"] = a.get_potential_energy()
        a.arrays["REF_forces"] = a.get_forces()
        a.calc = None
        out.append(a)
    return out


def pair_problem(n_frames, k):
    """(data, members' initial params, template, nbrs) of the pair-MLP variant."""
    import jax
    from jax_md import partition, space
    from chemtrain.models import init_pair_mlp, pair_mlp_template
    from chemtrain.simulate import lj_fluid_dataset
    data, box, _, _ = lj_fluid_dataset(n_particles=32, n_frames=n_frames)
    disp, _ = space.periodic(box)
    nbrs = partition.neighbor_list(disp, box, 0.9, format=partition.Sparse).allocate(
        data["R"][0], extra_capacity=8)
    members = [init_pair_mlp(jax.random.PRNGKey(s), hidden=(32, 32), n_basis=8)
               for s in range(k)]
    return data, members, pair_mlp_template(disp, 0.9, n_basis=8, r_min=0.2), nbrs


def problem(n_frames, k):
    """(data, members' initial params, template, cfg) of the benchmark."""
    import ase.io
    import jax
    from chemtrain.finetune import data as D
    from chemtrain.finetune import model as M
    from chemtrain.models import mace
    path = os.path.join(tempfile.mkdtemp(), "cu.xyz")
    ase.io.write(path, frames(n_frames), format="extxyz")
    d = D.to_model_arrays(D.read(path), SIZES["r_max"] * D.LENGTH, np.float32, True)
    rms = float(np.sqrt(np.mean(d["F"] ** 2))) / D.FORCE
    cfg = M.random_config([29], D.mean_pairs(d), rms, **SIZES)
    members = [mace.init_params(cfg, jax.random.PRNGKey(s), np.float32) for s in range(k)]
    return d, members, mace.energy_fn_template(cfg, None), cfg


def train_child(kind, k, n_frames, epochs, model="mace"):
    """One training in this process; returns seconds per epoch after the first."""
    import optax
    from chemtrain.trainers import EnsembleOfModels, ForceMatching, RunOptions
    opts = dict(batch=4, options=RunOptions(progress=False), parallelism="single",
                checkpoint_path=tempfile.mkdtemp())
    if model == "mace":
        data, members, template, _ = problem(n_frames, k)
        nbrs = None
        opts.update(gammas={"U": 1.0, "F": 1.0}, weights_keys={"U": "U_weight"})
    else:
        data, members, template, nbrs = pair_problem(n_frames, k)
    if kind == "ensemble":
        runs = [EnsembleOfModels(members, optax.adam(1e-3), template, nbrs, **opts)]
    else:
        runs = [ForceMatching(p, optax.adam(1e-3), template, nbrs, seed=i, **opts)
                for i, p in enumerate(members)]
    per_epoch = 0.0
    for tr in runs:
        tr.set_dataset(data, "training")
        tr.train(1)   # compiles
        started = time.perf_counter()
        tr.train(epochs)
        per_epoch += (time.perf_counter() - started) / epochs
    return {"kind": kind, "members": k, "epoch_s": per_epoch,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def calculator_times(k, repeats=20):
    import ase.build
    from chemtrain.calculator import ChemtrainCalculator, CommitteeCalculator
    _, members, _, cfg = problem(8, k)
    atoms = ase.build.bulk("Cu", "fcc", a=3.61, cubic=True) * (3, 3, 3)
    atoms.rattle(0.05, seed=1)
    singles = [ChemtrainCalculator.from_mace(cfg, p) for p in members]
    committee = CommitteeCalculator.from_mace(cfg, members)

    def one_by_one():
        for calc in singles:
            calc.reset()   # else ASE returns the cached results of the same atoms
            a = atoms.copy()
            a.calc = calc
            a.get_forces()

    def together():
        committee.reset()
        a = atoms.copy()
        a.calc = committee
        a.get_forces()

    times = {}
    for name, fn in (("separate", one_by_one), ("committee", together)):
        fn()
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        times[name] = float(np.median(samples))
    return times


def child(args):
    out = train_child(*args)
    print("RESULT " + json.dumps(out), flush=True)


def fresh(kind, k, n_frames, epochs, model="mace"):
    cmd = [sys.executable, __file__, "--child", kind, str(k), str(n_frames), str(epochs), model]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in text.splitlines()
                           if line.startswith("RESULT "))[7:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--frames", type=int, default=48)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--memory-k", default="1,2,4,8", help="K values of the memory measurement")
    p.add_argument("--model", default="mace", choices=["mace", "pair"],
                   help="the members: the small MACE (default) or a pair MLP on 32 "
                        "Lennard-Jones particles (training only)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, k, n, e, model = args.child
        return child((kind, int(k), int(n), int(e), model))
    import jax
    k = args.members
    results = {"benchmark": "ensemble", "model": args.model, "members": k,
               "frames": args.frames, "backend": jax.default_backend(),
               "host_cpus": os.cpu_count()}
    ens = fresh("ensemble", k, args.frames, args.epochs, args.model)
    one = fresh("single", k, args.frames, args.epochs, args.model)
    results["training"] = {"vectorised_epoch_s": ens["epoch_s"],
                           "sequential_epoch_s": one["epoch_s"],
                           "ratio": ens["epoch_s"] / one["epoch_s"]}
    print(f"training, {k} members, {args.frames} structures, batch 4: vectorised "
          f"{ens['epoch_s']:.2f} s per epoch, {k} single runs {one['epoch_s']:.2f} s "
          f"(sum), ratio {ens['epoch_s'] / one['epoch_s']:.3f} (target <= 0.6)", flush=True)
    if args.model != "mace":
        print(json.dumps(results))
        return
    calc = calculator_times(k)
    results["calculator"] = dict(calc, ratio=calc["committee"] / calc["separate"])
    print(f"calculator, 108 atoms: committee of {k} {1e3 * calc['committee']:.1f} ms, {k} "
          f"separate calls {1e3 * calc['separate']:.1f} ms, ratio "
          f"{calc['committee'] / calc['separate']:.3f}", flush=True)
    memory = []
    for m in (int(x) for x in args.memory_k.split(",")):
        r = fresh("single" if m == 1 else "ensemble", m, args.frames, args.epochs)
        memory.append({"members": m, "peak_rss_mb": r["peak_rss_mb"], "epoch_s": r["epoch_s"]})
        print(f"peak RSS with {m} member(s): {r['peak_rss_mb']:.0f} MB "
              f"(epoch {r['epoch_s']:.2f} s)", flush=True)
    results["memory"] = memory
    print(json.dumps(results))


if __name__ == "__main__":
    main()
