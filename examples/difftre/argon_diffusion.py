"""Learning from dynamics: Lennard-Jones argon fitted to its measured
self-diffusion coefficient (Rahman's liquid argon, Han and Yu's test).

    python examples/difftre/argon_diffusion.py [--updates 30] [--segments 100]
        [--segment-ps 2.0] [--dt 0.004] [--check-segments 200] [--out argon_diffusion]
        [--all-pairs] [--segment-batch 1]

The system (Rahman, Phys. Rev. 136, A405 (1964)): 864 argon atoms in a
3.47786 nm box (1.374 g/cm^3) at 94.4 K, mass 39.948 amu, a Lennard-Jones
potential cut off at 1.0 nm (smoothly from 0.9 nm), Langevin NVT sampling
(friction 1/ps) and velocity-Verlet NVE segments. The target is the
measured D = 2.36e-9 m^2/s (2.36e-3 nm^2/ps). The start is Han and Yu's
(Nat. Commun. 16, 2025): sigma 0.338 nm, epsilon 0.894 kJ/mol, whose D is
about 19 % too high.

Each update reweights the stored snapshots of one NVT trajectory (the
start states, ``--segments`` of them, 1 ps apart) to the current
parameters, runs an NVE segment of ``--segment-ps`` from each, and takes
the Green-Kubo D's loss and its exact gradient (the start states' weights
and the segments: :mod:`chemtrain.learn.dynamics`); Adam per parameter as
Han and Yu (sigma 2e-4 nm, epsilon 1e-2 kJ/mol per step). After training,
a fresh NVT trajectory of the final parameters (another seed) gives
``--check-segments`` new start states, and their segments the independent
check of D.

Writes under ``--out``: ``results.json`` (D per update, parameters, times,
the check; rewritten after every update, ``finished`` false until the
check is done) and ``diffusion.png``. The defaults are Han and Yu's numbers,
an accelerator's job: on one TPU v5e with ``--all-pairs --segment-batch
10`` (the potential summed over all pairs, no neighbor list: 90 times
cheaper there, ``benchmarks/argon_costs.py``) an update of 100 segments
of 2 ps took 20 s, of 60 segments 12 s (results in
``docs/guides/dynamics.md``). On 2 CPU cores keep the neighbor list: an
update of 100 segments takes about 18 minutes (``benchmarks/dynamics.py``),
so try ``--segments 10 --segment-ps 1 --updates 3`` there.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import chemtrain  # noqa: F401  (before jax_md)
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import partition, simulate, space

from chemtrain.learn import ReuseRule, dynamics_objective, make_segment, simulation_functions
from chemtrain.learn import dynamics
from chemtrain.learn.dynamics import check_steps
from chemtrain.models.pair import lennard_jones_template
from chemtrain.simulate import process_printouts, sample_langevin
from chemtrain.trainers import Reweighting, RunOptions
from chemtrain.units import kT as kT_of

BOX, N_CELLS, MASS, TEMPERATURE = 3.47786, 6, 39.948, 94.4
D_TARGET = 2.36e-3                       # nm^2/ps (2.36e-9 m^2/s)
START = {"sigma": 0.338, "epsilon": 0.894}


def lattice():
    """864 atoms on the fcc lattice of the box."""
    a = BOX / N_CELLS
    basis = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    cells = np.stack(np.meshgrid(*[np.arange(N_CELLS)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return ((cells[:, None, :] + basis[None] + 0.25) * a).reshape(-1, 3).astype(np.float32)


def neighbor_fn(displacement, all_pairs: bool = False, cell_list: bool = True):
    """The neighbor list: a Dense list of the 1.0 nm cutoff with a 0.1 nm skin
    (built with jax-md's cell list, or from all distances), or, for a
    potential on all pairs (``--all-pairs``), a list that is never rebuilt
    (its skin exceeds any displacement in the box): the trainer's
    bookkeeping needs one, the energy ignores it."""
    if all_pairs:
        return partition.neighbor_list(displacement, BOX, 1.0, dr_threshold=4 * BOX,
                                       disable_cell_list=True,
                                       format=partition.NeighborListFormat.Dense)
    return partition.neighbor_list(displacement, BOX, 1.0, dr_threshold=0.1,
                                   capacity_multiplier=1.5, disable_cell_list=not cell_list,
                                   format=partition.NeighborListFormat.Dense)


def melt(template, shift, nbr_fn, params, dt, seed):
    """The lattice melted: 10 ps of Langevin dynamics at 3 x 94.4 K, then 5 ps
    at 94.4 K (chemtrain.simulate.sample_langevin, which re-allocates an
    overflowing neighbor list)."""
    R = jnp.asarray(lattice())
    for kT, ps in ((3 * kT_of(TEMPERATURE), 10.0), (kT_of(TEMPERATURE), 5.0)):
        R = jnp.asarray(sample_langevin(template(params), nbr_fn, shift, R, kT=kT, dt=dt,
                                        n_frames=1, steps_per_frame=round(ps / dt), mass=MASS,
                                        seed=seed)[0])
    return np.asarray(R)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--segments", type=int, default=100, help="start states per trajectory")
    p.add_argument("--segment-ps", type=float, default=2.0)
    p.add_argument("--dt", type=float, default=0.004, help="time step (ps)")
    p.add_argument("--check-segments", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-batch", type=int, default=1,
                   help="start states whose segments run at once (vmapped): 10 with "
                        "--all-pairs on a TPU; keep 1 with a neighbor list")
    p.add_argument("--all-pairs", action="store_true",
                   help="sum the potential over all pairs, without a neighbor list (faster on "
                        "a TPU: benchmarks/argon_costs.py)")
    p.add_argument("--out", default="argon_diffusion")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    displacement, shift = space.periodic(BOX)
    template = lennard_jones_template(displacement, 1.0, all_pairs=args.all_pairs)
    nbr_fn = neighbor_fn(displacement, args.all_pairs)
    kT = kT_of(TEMPERATURE)
    started = time.perf_counter()
    reference = melt(template, shift, nbr_fn, {k: jnp.asarray(v) for k, v in START.items()},
                     args.dt, args.seed)
    print(f"melted in {time.perf_counter() - started:.0f} s", flush=True)

    segment = make_segment(template, shift, args.dt, check_steps(args.dt, args.segment_ps),
                           neighbors=not args.all_pairs)
    spec = {"segment": segment, "functionals": {"D": dynamics.diffusion()},
            "targets": {"D": {"gamma": 1e6}}, "vmap_batch": 10,
            "segment_batch": args.segment_batch}
    timings = process_printouts(args.dt, 5.0 + args.segments, 5.0, 1.0)
    labels = {"sigma": "sigma", "epsilon": "epsilon"}
    optimizer = optax.multi_transform({"sigma": optax.adam(2e-4), "epsilon": optax.adam(1e-2)},
                                      labels)
    records = []

    def save(**more):   # after every update, so that a run cut short keeps its updates
        path = os.path.join(args.out, "results.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"start": START, "D_target": D_TARGET, "updates": records,
                       "settings": vars(args), **more}, f, indent=1)
        os.replace(path + ".tmp", path)

    def on_update(record):
        r = record["statepoints"][0]
        records.append({"update": record["update"], "D": r["predictions"]["D"],
                        "sigma": float(record["params_before"]["sigma"]),
                        "epsilon": float(record["params_before"]["epsilon"]),
                        "n_eff": r["n_eff"], "recomputed": r["recomputed"],
                        "seconds": time.perf_counter() - started})
        print(f"update {record['update']}: D {r['predictions']['D']:.4e} nm^2/ps "
              f"({100 * (r['predictions']['D'] / D_TARGET - 1):+.1f} %), sigma "
              f"{records[-1]['sigma']:.5f}, epsilon {records[-1]['epsilon']:.5f}, N_eff "
              f"{r['n_eff']:.1f}{' (new trajectory)' if r['recomputed'] else ''}", flush=True)
        save(finished=False)

    trainer = Reweighting(dynamics_objective(), args.seed,
                          {k: jnp.asarray(v) for k, v in START.items()}, optimizer,
                          reuse=ReuseRule(pool=1), options=RunOptions(
                              progress=False, on_update=on_update,
                              checkpoint_path=os.path.join(args.out, "checkpoints")))
    fns = simulation_functions(template, functools.partial(
        simulate.nvt_langevin, shift_fn=shift, dt=args.dt, kT=kT, gamma=1.0), nbr_fn, timings,
        10)
    trainer.add(fns, {"kT": kT, "mass": MASS}, reference, targets=spec["targets"],
                target_values={"D": D_TARGET}, n_snapshots=timings.n_snapshots, spec=spec)
    trainer.initialize_trajstates()
    started = time.perf_counter()
    trainer.train(args.updates)
    train_s = time.perf_counter() - started

    # the independent check: a fresh trajectory of the final parameters
    final = {k: float(v) for k, v in trainer.params.items()}
    check = Reweighting(dynamics_objective(), args.seed + 1000,
                        {k: jnp.asarray(v) for k, v in final.items()}, optax.sgd(0.0),
                        reuse=ReuseRule(pool=1), options=RunOptions(
                            progress=False, checkpoint_path=os.path.join(args.out, "check")))
    check_timings = process_printouts(args.dt, 5.0 + 0.5 * args.check_segments, 5.0, 0.5)
    check_fns = simulation_functions(template, functools.partial(
        simulate.nvt_langevin, shift_fn=shift, dt=args.dt, kT=kT, gamma=1.0), nbr_fn,
        check_timings, 10)
    check.add(check_fns, {"kT": kT, "mass": MASS}, reference, targets=spec["targets"],
              target_values={"D": D_TARGET}, n_snapshots=check_timings.n_snapshots, spec=spec)
    check.initialize_trajstates()
    check.train(1)
    D_check = check.history[-1]["statepoints"][0]["predictions"]["D"]
    save(finished=True, final=final, D_check=D_check, D_check_error=D_check / D_TARGET - 1,
         seconds_per_update=train_s / max(1, args.updates),
         check_start_states=check_timings.n_snapshots)
    print(f"final sigma {final['sigma']:.5f} nm, epsilon {final['epsilon']:.5f} kJ/mol; fresh "
          f"check D {D_check:.4e} nm^2/ps ({100 * (D_check / D_TARGET - 1):+.1f} % from the "
          f"target), {train_s / max(1, args.updates):.0f} s per update", flush=True)
    plot(records, D_check, os.path.join(args.out, "diffusion.png"))


def plot(records, D_check, path):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5.5, 3.2), constrained_layout=True)
    ax = fig.subplots()
    ax.plot([r["update"] for r in records], [r["D"] * 1e3 for r in records], "o-",
            label="trainer's estimate")
    ax.axhline(D_TARGET * 1e3, color="k", ls="--", label="target (experiment)")
    ax.axhline(D_check * 1e3, color="C1", ls=":", label="fresh check, final parameters")
    ax.set_xlabel("update")
    ax.set_ylabel("D (1e-3 nm$^2$/ps)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
