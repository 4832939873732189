#!/usr/bin/env python
"""Upstream chemtrain 0.2.0's ``RelativeEntropy`` on the two-bead bond problem of
``benchmarks/reweighting_known_answers.py --problem re-bond`` (same reference
frames, simulation, optimizer and reference batch), for a side-by-side figure.

Run with upstream's own venv (``../shared/bench/upstream_setup.sh``), from
outside the project root so that this project's ``chemtrain`` is not imported:

    cd /tmp && $HOME/upstream-venv/bin/python /path/to/benchmarks/upstream/relentropy_bond.py \
        --updates 400 --reweight-ratio 0.9 --seed 0

Prints one JSON line: kb and b0 after 100, 200, ... updates, the final values
and how many updates recomputed the trajectory.
"""
import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from functools import partial

import numpy as onp
import jax
import jax.numpy as jnp
import optax
import jax_md_mod  # noqa: F401  (must precede jax_md: patches jax.random.KeyArray)
from jax_md import energy, partition, simulate, space

from chemtrain import ensemble, trainers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reweighting_problems import BOND, exact_bond_frames  # noqa: E402  (numpy only)

ap = argparse.ArgumentParser()
ap.add_argument("--updates", type=int, default=400)
ap.add_argument("--reweight-ratio", type=float, default=0.9)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()
jax.config.update("jax_enable_x64", True)

box, kT, mass = BOND["box"], BOND["kT"], BOND["mass"]
R_ref, _ = exact_bond_frames(BOND["frames"], args.seed)
displacement_fn, shift_fn = space.periodic(box)


def energy_fn_template(params):
    return energy.simple_spring_bond(displacement_fn, jnp.asarray([[0, 1]]),
                                     length=jnp.exp(params["log_b0"]),
                                     epsilon=jnp.exp(params["log_kb"]), alpha=2.0)


init_params = {"log_b0": jnp.log(BOND["start"][0]), "log_kb": jnp.log(BOND["start"][1])}
dt = BOND["dt"]
timings = ensemble.sampling.process_printouts(dt, BOND["total"], BOND["equilibration"],
                                              BOND["print_every"])
simulator_template = partial(simulate.nvt_langevin, shift_fn=shift_fn, dt=dt, kT=kT,
                             gamma=BOND["gamma"])
# no cell list: for two particles a cell list sized at the first frame overflows when both
# beads later share a cell, and upstream stops on any overflow
neighbor_fn = partition.neighbor_list(displacement_fn, box, 0.3, disable_cell_list=True)
sim_init, _ = simulator_template(energy_fn_template(init_params))
R0 = jnp.asarray(R_ref[0])
state0 = sim_init(jax.random.PRNGKey(args.seed), R0, mass=mass)
ref = ensemble.sampling.SimulatorState(sim_state=state0, nbrs=neighbor_fn.allocate(R0))
optimizer = optax.adam(optax.exponential_decay(BOND["lr"], BOND["decay_steps"], BOND["decay"]))
rows, recomputes = [], 0
with contextlib.redirect_stdout(io.StringIO()):
    tr = trainers.RelativeEntropy(init_params, optimizer, reweight_ratio=args.reweight_ratio,
                                  checkpoint_path=tempfile.mkdtemp())
    tr.add_statepoint(R_ref, energy_fn_template, simulator_template, neighbor_fn, timings,
                      {"kT": kT}, ref, reference_batch_size=BOND["reference_batch"], vmap_batch=100)
    # chemtrain 0.2.0's RelativeEntropy._update prints a `residual` that only its step-size
    # search defines (UnboundLocalError without one), and add_statepoint's allowed_reduction
    # path reads a misspelt attribute (self.weights_fn). A search that always takes the full
    # step (alpha 1, residual 0) is the plain update upstream intends without one.
    tr._adaptive_step_size[0] = lambda params, grad, proposal, traj_state: (1.0, 0.0)
    t0 = time.perf_counter()
    for _ in range(args.updates):
        before = tr.trajectory_states[0].aux["energy"]
        tr.train(1)
        recomputes += int(tr.trajectory_states[0].aux["energy"] is not before and not bool(
            jnp.all(tr.trajectory_states[0].aux["energy"] == before)))
        rows.append((float(jnp.exp(tr.params["log_kb"])), float(jnp.exp(tr.params["log_b0"]))))
kb = onp.array([r[0] for r in rows])
q = max(1, len(kb) // 4)
print(json.dumps({"tool": "chemtrain-0.2.0 RelativeEntropy", "seed": args.seed,
                  "reweight_ratio": args.reweight_ratio, "updates": args.updates,
                  "kb": {n: round(float(kb[n - 1])) for n in range(100, args.updates + 1, 100)},
                  "kb_final": float(kb[-1]), "b0_final": rows[-1][1],
                  "kb_last_quarter_range": float((kb[-q:].max() - kb[-q:].min()) / kb[-1]),
                  "recomputes": recomputes, "s": round(time.perf_counter() - t0, 1)}))
