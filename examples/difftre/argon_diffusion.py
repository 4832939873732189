"""Learning from dynamics: Lennard-Jones argon fitted to its measured
self-diffusion coefficient (Rahman's liquid argon, Han and Yu's test).

    python examples/difftre/argon_diffusion.py [--updates 30] [--segments 100]
        [--segment-ps 2.0] [--dt 0.004] [--step-scale 3] [--b1 0.5] [--decay-after 12]
        [--decay-to 0.05] [--check-segments 600] [--out argon_diffusion] [--all-pairs]
        [--segment-batch 1] [--resume]
    python examples/difftre/argon_diffusion.py --plot-from RESULTS.json [...] [--out DIR]

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
and the segments: :mod:`chemtrain.learn.dynamics`). Adam per parameter,
at 3x Han and Yu's step sizes (sigma 6e-4 nm, epsilon 3e-2 kJ/mol) with a
short memory (b1 0.5), held for 12 updates, then cosine-decayed to 5 %
at the last update. Why not Han and Yu's Adam (their step sizes, b1 0.9,
constant): its momentum carries D past the target and the noise keeps it
there (30 updates ended 2.8 % low), and decaying its steps after 8
updates stopped one seed 5.4 % short. Measured runs:
``docs/guides/dynamics.md``.

The check is independent of the trainer: the lattice melted again with
the final parameters (another seed), ``--check-segments`` start states
0.5 ps apart from a fresh Langevin run, new Maxwell-Boltzmann momenta for
each, and the mean Green-Kubo D of their NVE segments with its standard
error (no reweighting: every start state is sampled at the final
parameters).

Writes under ``--out``: ``results.json`` (D per update, parameters, times,
the check; rewritten after every update, ``finished`` false until the
check is done) and ``argon_diffusion.png`` (``--plot-from`` draws it from
one or more ``results.json``, e.g. on a machine without matplotlib),
``start_positions.npy`` (the melted lattice) and ``checkpoints/`` (the
trainer's checkpoint of the last update: parameters, optimizer and
trajectory). A run cut short (a time limit, a crash) continues with
``--resume`` and the same settings: its updates and its check are bitwise
those of a run that never stopped (checked on 2 CPU cores with ``--segments
2 --segment-ps 0.2 --updates 3``, killed after update 1). A folder that
holds a run is not overwritten without ``--resume``.

The defaults (Han and Yu's 100 segments of 2 ps) are an accelerator's
job: on one TPU v5e with ``--all-pairs --segment-batch 10`` (the
potential summed over all pairs, no neighbor list: 90 times cheaper
there, ``benchmarks/argon_costs.py``) an update of 100 segments took 20
s, of 60 segments 11.5 s, and 30 updates of 60 segments and the check
6.5-7.5 minutes. On 2 CPU cores keep the neighbor list: an update of 100
segments takes about 18 minutes (``benchmarks/dynamics.py``), so try
``--segments 4 --segment-ps 1 --updates 3 --check-segments 20`` there.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import time

import chemtrain  # noqa: F401  (before jax_md)
import jax
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
    p.add_argument("--step-scale", type=float, default=3.0,
                   help="Han and Yu's step sizes (sigma 2e-4 nm, epsilon 1e-2 kJ/mol) times this")
    p.add_argument("--b1", type=float, default=0.5, help="Adam's first-moment decay")
    p.add_argument("--decay-after", type=int, default=12,
                   help="updates at the full step sizes before the cosine decay (-1: none)")
    p.add_argument("--decay-to", type=float, default=0.05,
                   help="the step sizes at the last update, as a fraction of the first")
    p.add_argument("--check-segments", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-batch", type=int, default=1,
                   help="start states whose segments run at once (vmapped): 10 with "
                        "--all-pairs on a TPU; keep 1 with a neighbor list")
    p.add_argument("--all-pairs", action="store_true",
                   help="sum the potential over all pairs, without a neighbor list (faster on "
                        "a TPU: benchmarks/argon_costs.py)")
    p.add_argument("--out", default="argon_diffusion")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint (one per update), "
                        "with the same settings")
    p.add_argument("--plot-from", nargs="+", metavar="RESULTS",
                   help="only draw the plot of these results.json files, into --out")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plot_from:
        runs = []
        for name in args.plot_from:
            with open(name) as f:
                runs.append(json.load(f))
        plot(runs, os.path.join(args.out, "argon_diffusion.png"))
        return
    if not (args.decay_after < 0 or 0 < args.decay_to <= 1):
        p.error(f"--decay-to must be in (0, 1], got {args.decay_to}")
    displacement, shift = space.periodic(BOX)
    template = lennard_jones_template(displacement, 1.0, all_pairs=args.all_pairs)
    nbr_fn = neighbor_fn(displacement, args.all_pairs)
    kT = kT_of(TEMPERATURE)
    started = time.perf_counter()
    earlier, latest = resumable(args) if args.resume else fresh_folder(args)
    melted = os.path.join(args.out, "start_positions.npy")
    if latest:
        reference = np.load(melted)
    else:
        reference = melt(template, shift, nbr_fn, {k: jnp.asarray(v) for k, v in START.items()},
                         args.dt, args.seed)
        np.save(melted, reference)
        print(f"melted in {time.perf_counter() - started:.0f} s", flush=True)

    segment = make_segment(template, shift, args.dt, check_steps(args.dt, args.segment_ps),
                           neighbors=not args.all_pairs)
    spec = {"segment": segment, "functionals": {"D": dynamics.diffusion()},
            "targets": {"D": {"gamma": 1e6}}, "vmap_batch": 10,
            "segment_batch": args.segment_batch}
    timings = process_printouts(args.dt, 5.0 + args.segments, 5.0, 1.0)
    labels = {"sigma": "sigma", "epsilon": "epsilon"}
    optimizer = optax.multi_transform(
        {k: optax.adam(step_sizes(args.step_scale * lr, args.updates, args.decay_after,
                                  args.decay_to), b1=args.b1)
         for k, lr in (("sigma", 2e-4), ("epsilon", 1e-2))}, labels)
    records = list(earlier)

    results = {"start": START, "D_target": D_TARGET, "updates": records,
               "settings": vars(args)}

    def save(**more):   # after every update, so that a run cut short keeps its updates
        results.update(more)
        path = os.path.join(args.out, "results.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)

    def on_update(record):
        r = record["statepoints"][0]
        records.append({"update": record["update"], "D": r["predictions"]["D"],
                        "sigma": float(record["params_before"]["sigma"]),
                        "epsilon": float(record["params_before"]["epsilon"]),
                        "n_eff": r["n_eff"], "recomputed": r["recomputed"],
                        "seconds": before + time.perf_counter() - started})
        print(f"update {record['update']}: D {r['predictions']['D']:.4e} nm^2/ps "
              f"({100 * (r['predictions']['D'] / D_TARGET - 1):+.1f} %), sigma "
              f"{records[-1]['sigma']:.5f}, epsilon {records[-1]['epsilon']:.5f}, N_eff "
              f"{r['n_eff']:.1f}{' (new trajectory)' if r['recomputed'] else ''}", flush=True)
        save(finished=False)
        keep_last_checkpoint(args)

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
    if latest:
        trainer.restore(latest)   # parameters, optimizer, trajectory and update count
        del records[trainer.epoch:]   # updates after the last checkpoint run again
        print(f"resumed from {latest}: {trainer.epoch} of {args.updates} updates done",
              flush=True)
    else:
        trainer.initialize_trajstates()
    before = records[-1]["seconds"] if records else 0.0
    started = time.perf_counter()
    trainer.train(args.updates - trainer.epoch, checkpoint_freq=1)
    train_s = before + time.perf_counter() - started
    keep_last_checkpoint(args)

    final = {k: float(v) for k, v in trainer.params.items()}
    save(finished=False, final=final, seconds_per_update=train_s / max(1, args.updates))
    started = time.perf_counter()
    D, overflow = fresh_check(template, shift, nbr_fn, segment, final, args)
    if overflow:
        raise RuntimeError(f"{overflow} check segments overflowed their neighbor list; "
                           "raise capacity_multiplier in neighbor_fn.")
    D_check, se = float(np.mean(D)), float(np.std(D, ddof=1) / np.sqrt(len(D)))
    se_blocks = 0.0   # of 10 blocks of consecutive start states (correlated neighbours)
    if len(D) >= 20:
        blocks = D[: len(D) // 10 * 10].reshape(10, -1).mean(1)
        se_blocks = float(np.std(blocks, ddof=1) / np.sqrt(len(blocks)))
    save(finished=True, final=final, D_check=D_check, D_check_se=se,
         D_check_se_blocks=se_blocks, D_check_error=D_check / D_TARGET - 1,
         seconds_per_update=train_s / max(1, args.updates), check_start_states=len(D),
         check_seconds=time.perf_counter() - started)
    err = max(se, se_blocks)
    print(f"final sigma {final['sigma']:.5f} nm, epsilon {final['epsilon']:.5f} kJ/mol; fresh "
          f"check D {D_check:.4e} +- {err:.1e} nm^2/ps ({100 * (D_check / D_TARGET - 1):+.1f} "
          f"+- {100 * err / D_TARGET:.1f} % from the target, {len(D)} start states), "
          f"{train_s / max(1, args.updates):.1f} s per update", flush=True)
    plot([results], os.path.join(args.out, "argon_diffusion.png"))


def checkpoints(args) -> list:
    return sorted(glob.glob(os.path.join(args.out, "checkpoints", "epoch_*.npz")))


def keep_last_checkpoint(args) -> None:
    """Remove all checkpoints but the newest: it is all a resume needs."""
    for old in checkpoints(args)[:-1]:
        os.remove(old)


def fresh_folder(args):
    """A new run: refuse a folder that holds one, so that nothing is lost."""
    if os.path.exists(os.path.join(args.out, "results.json")) or checkpoints(args):
        raise SystemExit(f"{args.out} holds a run already: continue it with --resume, or give "
                         f"another --out.")
    return [], None


def resumable(args):
    """The records and the last checkpoint of the run in ``--out``, after
    checking that it was started with the same settings."""
    path = os.path.join(args.out, "results.json")
    if not os.path.exists(path):
        raise SystemExit(f"--resume: {args.out} holds no run to continue (no results.json); "
                         f"start one without --resume.")
    if not checkpoints(args):
        raise SystemExit(f"--resume: the run in {args.out} stopped before its first checkpoint "
                         f"(checkpoints/epoch_*.npz): nothing to continue; remove the folder and "
                         f"start again.")
    with open(path) as f:
        earlier = json.load(f)
    mine = {k: v for k, v in vars(args).items() if k not in ("resume", "out", "plot_from")}
    theirs = {k: earlier["settings"].get(k) for k in mine}
    if mine != theirs:
        differ = {k: (theirs[k], v) for k, v in mine.items() if theirs[k] != v}
        raise SystemExit(f"--resume: the run in {args.out} has other settings ((its, given): "
                         f"{differ}); resume with its settings.")
    return earlier["updates"], checkpoints(args)[-1]


def step_sizes(lr: float, updates: int, decay_after: int, decay_to: float):
    """``lr`` for ``decay_after`` updates, then a cosine decay to
    ``decay_to x lr`` at the last update (a constant for ``decay_after``
    < 0 or at least ``updates``)."""
    if decay_after < 0 or decay_after >= updates - 1:
        return lr
    return optax.join_schedules(
        [optax.constant_schedule(lr),
         optax.cosine_decay_schedule(lr, updates - 1 - decay_after, alpha=decay_to)],
        [decay_after])


def fresh_check(template, shift, nbr_fn, segment, params, args):
    """D of each of ``--check-segments`` start states sampled at ``params``
    alone: the lattice melted again (seed + 1000), 5 ps more of Langevin
    dynamics, then a start state every 0.5 ps with new Maxwell-Boltzmann
    momenta, and the Green-Kubo D of its NVE segment. Returns the D values
    (nm^2/ps) and how many segments overflowed their neighbor list."""
    params = {k: jnp.asarray(v) for k, v in params.items()}
    kT, seed = kT_of(TEMPERATURE), args.seed + 1000
    R0 = melt(template, shift, nbr_fn, params, args.dt, seed)
    starts = jnp.asarray(sample_langevin(
        template(params), nbr_fn, shift, jnp.asarray(R0), kT=kT, dt=args.dt,
        n_frames=args.check_segments, steps_per_frame=round(0.5 / args.dt), mass=MASS,
        n_equilibration=round(5.0 / args.dt), seed=seed + 1))
    P = jnp.sqrt(MASS * kT) * jax.random.normal(jax.random.PRNGKey(seed), starts.shape)
    nbrs0 = None if args.all_pairs else nbr_fn.allocate(starts[0])
    D_of = dynamics.diffusion()

    def one(rp):
        nbrs = None if nbrs0 is None else nbrs0.update(rp[0])
        series, overflow = segment(params, rp[0], rp[1], MASS, nbrs, {})
        return D_of(series, segment.dt), overflow

    batch = args.segment_batch if args.all_pairs and args.segment_batch > 1 else None
    D, overflow = jax.jit(lambda R, P: jax.lax.map(one, (R, P), batch_size=batch))(starts, P)
    return np.asarray(D), int(np.sum(overflow))


def plot(runs, path):
    """D per update of each run (the trainer's estimate) and its fresh check
    (with two standard errors), against the target."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plot (draw it with --plot-from "
              "results.json where it is)")
        return
    fig = Figure(figsize=(6, 3.4), constrained_layout=True)
    ax = fig.subplots()
    ax.axhline(D_TARGET * 1e3, color="k", ls="--", lw=1, label="target (experiment)")
    for i, run in enumerate(runs):
        s, updates = run["settings"], run["updates"]
        label = (f"seed {s['seed']}, steps x{s.get('step_scale', 1):g}, b1 {s.get('b1', 0.9):g}, "
                 f"decay after {s.get('decay_after', -1)}")
        ax.plot([u["update"] for u in updates], [u["D"] * 1e3 for u in updates], "o-",
                ms=3, color=f"C{i}", label=label)
        if run.get("D_check") is not None:
            err = 2e3 * max(run.get("D_check_se", 0), run.get("D_check_se_blocks", 0))
            ax.errorbar([len(updates) + 0.5 + 0.4 * i], [run["D_check"] * 1e3], yerr=[err],
                        fmt="s", color=f"C{i}", capsize=3)
    ax.set_xlabel("update (squares: fresh check of the final parameters)")
    ax.set_ylabel("D (1e-3 nm$^2$/ps)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
