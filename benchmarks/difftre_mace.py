"""DiffTRe on a MACE potential: peak memory and time of one update.

    .venv/bin/python benchmarks/difftre_mace.py [--snapshots 100] [--batches 5,20,0] [--big 2000]
        [--md-repeats 3]

The probe system of issue 20: 216 water-like beads at 33.4 nm^-3 (one
species, oxygen), an 8-channel MACE (L_max 1, correlation 2, r_max 4.5 A)
plus a repulsive prior (``sum_templates``), a Sparse neighbor list, Langevin
dynamics with dt 5 fs at 300 K, float32, an RDF target. Every measurement
runs in a fresh process, so its peak resident memory (``ru_maxrss``) is its
own:

- the peak memory of one DiffTRe gradient over ``--snapshots`` snapshots for
  each ``vmap_batch`` of ``--batches`` (0: all at once), with the two-pass
  gradient the trainers use (:mod:`chemtrain.learn.difftre_grad`) and with
  ``jax.value_and_grad`` of the loss (what they used before);
- with ``--big N``: the two-pass gradient over N snapshots (vmap_batch 20,
  snapshots 2 MD steps apart: only their number matters for memory);
- the wall time of a reweight-only update (the gradient over the stored
  snapshots) against a recompute update (the trajectory that produced them,
  10 MD steps per snapshot, plus the gradient), warm; and the split of the
  reweight-only update into its forward pass (energies, weights, loss) and
  the chunked vector-Jacobian products;
- ``--md-repeats`` times (each in a fresh process): MD steps per second of
  the trajectory generator (``make_trajectory``) against a bare jax-md
  ``lax.scan`` of the same steps on the same MACE energy and neighbor list.

Prints one line per measurement and a JSON summary at the end.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time

N, DENSITY, R_MAX_NM = 216, 33.4, 0.45


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build(snapshots: int, stride: int = 10):
    """(trajectory, gradient builders, trajectory functions) of the probe."""
    import chemtrain  # noqa: F401  (before jax_md)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax_md import simulate, space

    from chemtrain import quantity
    from chemtrain.finetune.model import random_config
    from chemtrain.models import mace as cm
    from chemtrain.models import repulsive_template, sum_templates
    from chemtrain.neighbors import neighbor_list
    from chemtrain.simulate import make_trajectory, process_printouts
    from chemtrain.units import kT

    box = (N / DENSITY) ** (1 / 3)
    displacement, shift = space.periodic(box)
    cfg = random_config((8,), avg_num_neighbors=12.0, scale=0.05, num_channels=8, max_L=1,
                        max_ell=1, correlation=2, r_max=10 * R_MAX_NM)
    template = sum_templates({"prior": repulsive_template(displacement, R_MAX_NM, 0.4),
                              "mace": cm.energy_fn_template(cfg, displacement)})
    params = {"prior": {"sigma": jnp.float32(0.3), "epsilon": jnp.float32(1.0)},
              "mace": cm.init_params(cfg, jax.random.PRNGKey(0), jnp.float32)}
    neighbor_fn = neighbor_list(displacement, box, R_MAX_NM, dr_threshold=0.02)
    per = 6
    grid = np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1).reshape(-1, 3)
    R0 = jnp.asarray((grid + 0.5) * box / per, jnp.float32)
    dt_ps = 0.005
    timings = process_printouts(dt_ps, dt_ps * stride * snapshots, 0.0, dt_ps * stride)
    init, run = make_trajectory(
        functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=dt_ps, kT=kT(300.0),
                          gamma=10.0), template, neighbor_fn, timings)
    kw = {"kT": jnp.float32(kT(300.0)), "mass": jnp.float32(18.0),
          "species": jnp.full((N,), 8, jnp.int32)}
    key = jax.random.PRNGKey(1)
    traj = run(params, init(params, key, R0, **kw), jax.random.fold_in(key, 1), **kw)
    rdf = quantity.rdf(displacement, quantity.rdf_discretization(R_MAX_NM, 50, 0.1), box=box)
    quantities = {"rdf": rdf}
    targets = {"rdf": {"gamma": 1.0}}
    return dict(params=params, template=template, quantities=quantities, targets=targets,
                traj=traj, kw=kw, run=run, key=key, shift=shift, neighbor_fn=neighbor_fn,
                R0=R0, dt=dt_ps, stride=stride)


def gradient_fn(system, method: str, vmap_batch):
    import jax
    from chemtrain.learn import reweighting as dt
    from chemtrain.learn.difftre_grad import make_value_and_grad
    args = (system["template"], system["quantities"], system["targets"])
    opts = dict(vmap_batch=vmap_batch, fixed=("rdf",))
    if method == "two-pass":
        return jax.jit(make_value_and_grad(*args, **opts))
    return jax.jit(jax.value_and_grad(dt.make_statepoint_loss(*args, **opts), has_aux=True))


def measure(method: str, vmap_batch, snapshots: int, timing: bool, stride: int = 10) -> dict:
    import jax
    import jax.numpy as jnp
    from chemtrain.learn import reweighting as dt
    system = build(snapshots, stride)
    traj, kw = system["traj"], system["kw"]
    chains = [(traj.snapshots, traj.nbrs)]
    _, fixed, _ = jax.jit(dt.make_snapshot_evaluator(None, system["quantities"], vmap_batch))(
        system["params"], chains, kw)
    target = {"rdf": jnp.ones_like(fixed["rdf"][0])}
    grad = gradient_fn(system, method, vmap_batch)
    args = (system["params"], chains, traj.U_ref, target, kw, fixed)
    before = rss_mb()
    jax.block_until_ready(grad(*args))
    out = {"method": method, "vmap_batch": vmap_batch, "snapshots": snapshots,
           "rss_before_mb": round(before, 1), "peak_rss_mb": round(rss_mb(), 1)}
    if timing:
        started = time.perf_counter()
        jax.block_until_ready(grad(*args))
        out["reweight_s"] = round(time.perf_counter() - started, 3)
        # the split of the reweight-only update: its forward pass (energies,
        # quantities, weights, loss) and the rest (the chunked VJPs)
        forward = jax.jit(dt.make_snapshot_evaluator(system["template"], {}, vmap_batch))
        jax.block_until_ready(forward(system["params"], chains, kw))
        started = time.perf_counter()
        jax.block_until_ready(forward(system["params"], chains, kw))
        out["forward_s"] = round(time.perf_counter() - started, 3)
        out["vjp_s"] = round(out["reweight_s"] - out["forward_s"], 3)
        run = jax.jit(system["run"])
        jax.block_until_ready(run(system["params"], traj, system["key"], **kw))
        started = time.perf_counter()
        jax.block_until_ready(run(system["params"], traj, system["key"], **kw))
        out["trajectory_s"] = round(time.perf_counter() - started, 3)
        out["recompute_s"] = round(out["trajectory_s"] + out["reweight_s"], 3)
        out["reweight_over_recompute"] = round(out["reweight_s"] / out["recompute_s"], 3)
    return out


def measure_md(snapshots: int, stride: int = 10) -> dict:
    """Steps per second of the trajectory generator (``make_trajectory``'s
    ``run_fn``: failure checks, snapshots, their energies) against a bare
    jax-md ``lax.scan`` of the same steps on the same MACE energy and list."""
    import jax
    from jax_md import simulate
    system = build(snapshots, stride)
    kw, key, steps = system["kw"], system["key"], snapshots * stride
    run = jax.jit(system["run"])
    jax.block_until_ready(run(system["params"], system["traj"], key, **kw))
    started = time.perf_counter()
    jax.block_until_ready(run(system["params"], system["traj"], key, **kw))
    generator_s = time.perf_counter() - started

    energy_fn = system["template"](system["params"])
    init, apply = simulate.nvt_langevin(energy_fn, system["shift"], dt=system["dt"], kT=kw["kT"],
                                        gamma=10.0)
    nbrs = system["neighbor_fn"].allocate(system["R0"])
    state = init(key, system["R0"], mass=kw["mass"], neighbor=nbrs, species=kw["species"])

    @jax.jit
    def bare(state, nbrs):
        def step(carry, _):
            state, nbrs = carry
            state = apply(state, neighbor=nbrs, species=kw["species"])
            return (state, nbrs.update(state.position)), None
        return jax.lax.scan(step, (state, nbrs), None, length=steps)[0]
    state, nbrs = jax.block_until_ready(bare(state, nbrs))   # compile, and equilibrate
    assert not bool(nbrs.did_buffer_overflow)
    started = time.perf_counter()
    jax.block_until_ready(bare(state, nbrs))
    bare_s = time.perf_counter() - started
    return {"method": "md", "steps": steps, "generator_steps_per_s": round(steps / generator_s, 1),
            "bare_scan_steps_per_s": round(steps / bare_s, 1),
            "generator_over_bare": round(bare_s / generator_s, 3)}


def child(method, vmap_batch, snapshots, timing=False, stride=10) -> dict:
    cmd = [sys.executable, __file__, "--child", method, str(vmap_batch or 0), str(snapshots),
           "1" if timing else "0", str(stride)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        return {"method": method, "vmap_batch": vmap_batch, "snapshots": snapshots,
                "error": done.stderr.strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshots", type=int, default=100)
    p.add_argument("--batches", default="5,20,0", help="vmap_batch values; 0 = all at once")
    p.add_argument("--big", type=int, default=0, help="also N snapshots, two-pass, vmap_batch 20")
    p.add_argument("--md-repeats", type=int, default=3,
                   help="runs of the MD comparison (each in a fresh process)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        method, b, n, timing, stride = args.child
        print(json.dumps(measure_md(int(n), int(stride)) if method == "md" else
                         measure(method, int(b) or None, int(n), timing == "1", int(stride))))
        return
    results = []
    for _ in range(args.md_repeats):   # the two alternate inside each run; repeats show the noise
        r = child("md", None, args.snapshots)
        print(json.dumps(r), flush=True)
        results.append(r)
    for b in [int(x) or None for x in args.batches.split(",")]:
        for method in ("two-pass", "direct"):
            r = child(method, b, args.snapshots, timing=(method == "two-pass" and b == 20))
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.big:
        r = child("two-pass", 20, args.big, stride=2)   # memory only: 2 MD steps apart
        print(json.dumps(r), flush=True)
        results.append(r)
    print(json.dumps({"benchmark": "difftre_mace", "host_cpus": os.cpu_count(),
                      "results": results}))


if __name__ == "__main__":
    main()
