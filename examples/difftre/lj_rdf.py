"""Learn Lennard-Jones sigma and epsilon of an argon-like fluid from RDF and
pressure targets at three temperatures with DiffTRe.

    python examples/difftre/lj_rdf.py [--epochs 30] [--out difftre_lj] [--temperatures 120,140,160]

128 particles at 21 nm^-3 (sigma 0.34 nm, epsilon 0.99 kJ/mol, mass 39.95,
cutoff 0.9 nm), Langevin dynamics with dt = 0.01 ps. The targets, a radial
distribution function and a virial pressure per temperature, come from
simulations with the true parameters (300 snapshots each), standing in for
experimental data. Training starts 10 % below sigma and 20 % above epsilon,
works on log parameters with an RMSprop step whose size decays, and uses all
state points in every update (``sim_batch_size=-1``). Trajectories of 100
snapshots are reused by reweighting until their effective sample size falls
below 90 %.

Writes under ``--out``: ``metrics.jsonl`` (one line per epoch: loss,
predictions, N_eff and whether each state point was recomputed),
``predictions.png`` (RDF curves and pressure bars against the targets per
temperature), ``parameters.png`` (sigma and epsilon per epoch) and a
checkpoint with the trajectory states. A few minutes on two CPU cores.

Under MPI, one rank per device, the state points are spread over the ranks
(rank 0 makes the targets and sends them to the others):

    mpirun -np 2 python examples/difftre/lj_rdf.py --epochs 30
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import partition, simulate, space

from chemtrain import quantity
from chemtrain.learn.reweighting import make_snapshot_evaluator
from chemtrain.parallel import make_strategy, on_root
from chemtrain.models.pair import lennard_jones_template
from chemtrain.simulate import make_trajectory, process_printouts, run_with_restart
from chemtrain.trainers.difftre import DifftreParallel
from chemtrain.trainers import RunOptions
from chemtrain.units import kT

N, DENSITY, SIGMA, EPSILON, MASS, R_CUT, DT = 128, 21.0, 0.34, 0.99, 39.95, 0.9, 0.01


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--temperatures", default="120,140,160", help="kelvin, comma-separated")
    p.add_argument("--out", default="difftre_lj")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def system():
    box = (N / DENSITY) ** (1 / 3)
    displacement, shift = space.periodic(box)
    neighbor_fn = partition.neighbor_list(displacement, box, R_CUT, dr_threshold=0.05,
                                          capacity_multiplier=1.5,
                                          format=partition.NeighborListFormat.Sparse)
    per = int(np.ceil(N ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1).reshape(-1, 3)[:N]
    rdf_bins = quantity.rdf_discretization(0.85, 130, 0.2)
    return dict(box=box, displacement=displacement, neighbor_fn=neighbor_fn,
                lattice=(grid + 0.5) * box / per, rdf_bins=rdf_bins,
                simulator=functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=DT,
                                            kT=kT(120.0), gamma=5.0),
                quantities={"rdf": quantity.rdf(displacement, rdf_bins, box=box),
                            "pressure": quantity.pressure(box=box)})


def log_template(displacement):
    """LJ on log parameters, so steps are relative and both stay positive."""
    base = lennard_jones_template(displacement, R_CUT)
    return lambda p: base({"sigma": jnp.exp(p["log_sigma"]), "epsilon": jnp.exp(p["log_epsilon"])})


def reference_data(s, kTs, seed):
    """Targets and starting configurations from the true potential: RDF and
    pressure averaged over 300 snapshots 0.2 ps apart, per temperature."""
    template = lennard_jones_template(s["displacement"], R_CUT)
    true = {"sigma": jnp.asarray(SIGMA), "epsilon": jnp.asarray(EPSILON)}
    init, run = make_trajectory(s["simulator"], template, s["neighbor_fn"],
                                process_printouts(DT, 65.0, 5.0, 0.2))
    evaluate = jax.jit(make_snapshot_evaluator(template, s["quantities"]))
    rdfs, pressures, starts = [], [], []
    for i, k in enumerate(kTs):
        kw = {"kT": k, "mass": MASS}
        key = jax.random.PRNGKey(1000 * seed + i)
        traj = run_with_restart(run, s["neighbor_fn"], true, init(true, key, s["lattice"], **kw),
                                jax.random.fold_in(key, 1), **kw)
        _, q, _ = evaluate(true, [(traj.snapshots, traj.nbrs)], kw)
        rdfs.append(np.asarray(q["rdf"]).mean(0))
        pressures.append(float(np.asarray(q["pressure"]).mean()))
        starts.append(np.asarray(traj.sim_state.position))
    return np.stack(rdfs), np.array(pressures), np.stack(starts)


def plot_parameters(history_params, path):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 3), constrained_layout=True)
    axes = fig.subplots(1, 2)
    for ax, (name, true) in zip(axes, (("sigma", SIGMA), ("epsilon", EPSILON))):
        ax.plot([p[name] for p in history_params], "C0o-", ms=3, label="learned")
        ax.axhline(true, color="k", ls="--", label="true")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"{name} ({'nm' if name == 'sigma' else 'kJ/mol'})")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    jax.config.update("jax_enable_x64", True)
    os.makedirs(args.out, exist_ok=True)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    kTs = np.array([kT(t) for t in temperatures])
    s = system()
    strategy = make_strategy("auto", allow_jax=False, trainer="DifftreParallel")
    say = print if strategy.is_root else (lambda *a, **k: None)

    start = time.perf_counter()
    # on the root only, sent to every rank: all must train on the same targets
    targets = on_root(strategy, lambda: reference_data(s, kTs, args.seed), only_root=True)
    rdfs, pressures, starts = strategy.broadcast_from_root(targets)
    say(f"targets from the true potential ({time.perf_counter() - start:.0f} s): pressure "
          + ", ".join(f"{p:.1f}" for p in pressures) + " kJ/mol/nm^3 at "
          + ", ".join(f"{t:g} K" for t in temperatures))

    init_params = {"log_sigma": jnp.log(0.9 * SIGMA), "log_epsilon": jnp.log(1.2 * EPSILON)}
    trainer = DifftreParallel(
        jax.random.PRNGKey(args.seed), init_params,
        optax.rmsprop(optax.exponential_decay(0.02, args.epochs, 0.25), decay=0.9),
        log_template(s["displacement"]), s["simulator"], s["neighbor_fn"],
        process_printouts(DT, 11.0, 1.0, 0.1),          # 100 snapshots per trajectory
        {"kT": kTs, "mass": np.full(len(kTs), MASS)}, s["quantities"],
        {"rdf": {"target": rdfs, "gamma": 1.0}, "pressure": {"target": pressures, "gamma": 1e-4}},
        reference_states=starts, sim_batch_size=-1, reweight_ratio=0.9,
        checkpoint_path=args.out, options=RunOptions(
            log_file=os.path.join(args.out, "metrics.jsonl"), progress=False,
            plot_x={"rdf": np.asarray(s["rdf_bins"].bin_centers)}))
    trainer.initialize_trajstates()

    params = []
    for _ in range(args.epochs):  # one epoch at a time to record sigma and epsilon
        trainer.train(1)
        params.append({"sigma": float(jnp.exp(trainer.params["log_sigma"])),
                       "epsilon": float(jnp.exp(trainer.params["log_epsilon"]))})
    trainer.save_checkpoint(os.path.join(args.out, "final.npz"))
    trainer.plot(os.path.join(args.out, "predictions.png"))
    if not strategy.is_root:
        return
    plot_parameters(params, os.path.join(args.out, "parameters.png"))

    last = trainer.history[-1]["statepoints"]
    n_recomputed = sum(r["recomputed"] for e in trainer.history for r in e["statepoints"])
    n_total = sum(len(e["statepoints"]) for e in trainer.history)
    print(f"sigma {params[-1]['sigma']:.4f} nm (true {SIGMA}), epsilon "
          f"{params[-1]['epsilon']:.4f} kJ/mol (true {EPSILON}); {n_recomputed} of {n_total} "
          f"state-point updates recomputed their trajectory; "
          f"{time.perf_counter() - start:.0f} s in all")
    for t, r in zip(temperatures, last):
        print(f"  {t:g} K: pressure {r['predictions']['pressure']:.1f} (target "
              f"{r['targets']['pressure']:.1f}), RDF MSE {r['parts']['rdf']:.2e}, "
              f"N_eff {r['n_eff']:.0f}/{r['n_snapshots']}")
    with open(os.path.join(args.out, "parameters.json"), "w") as f:
        json.dump(params, f)
    print(f"plots: {args.out}/predictions.png, {args.out}/parameters.png")


if __name__ == "__main__":
    main()
