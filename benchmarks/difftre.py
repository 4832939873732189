"""DiffTRe speed: our trajectory generator against plain jax-md, and a
reweight-only update against a recompute update.

    .venv/bin/python benchmarks/difftre.py [--particles 128] [--snapshots 100] [--repeats 3]

System: the argon-like Lennard-Jones fluid of the tests (21 nm^-3, kT at
120 K, cutoff 0.9 nm, Langevin dt 0.01 ps), float32 unless --x64.

1. MD steps per second of ``chemtrain.simulate.make_trajectory``'s run
   (neighbor list updated and checked every step, last valid state kept,
   snapshots and their energies stored) divided by a plain jax-md
   ``lax.scan`` loop that does the same integration, neighbor-list updates,
   snapshots and snapshot energies without any checks (target: >= 0.95).
   Both are compiled before timing; they are timed alternately
   ``--repeats`` times each and the best of each is kept.
2. One ``DifftreParallel`` state point learning sigma from an RDF: the wall
   time of updates that only reweight (reweight_ratio=0, no reuse bounds)
   and of updates that recompute the trajectory first (reweight_ratio=1),
   compile excluded. With ``--pool K`` the recompute updates reweight from a
   pool of the last K trajectories (filled before timing), so each
   recompute also prepares the pool's fixed quantities (the RDF).
"""
import argparse
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax


def build(n, dtype):
    from jax_md import partition, simulate, space
    from chemtrain.models.pair import lennard_jones_template
    from chemtrain.units import kT
    box = (n / 21.0) ** (1 / 3)
    displacement, shift = space.periodic(box)
    neighbor_fn = partition.neighbor_list(displacement, box, 0.9, dr_threshold=0.05,
                                          capacity_multiplier=1.5,
                                          format=partition.NeighborListFormat.Sparse)
    per = int(np.ceil(n ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(per)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    R0 = jnp.asarray((grid + 0.5) * box / per, dtype)
    simulator = functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.01, kT=kT(120.0),
                                  gamma=5.0)
    return dict(box=box, displacement=displacement, neighbor_fn=neighbor_fn, R0=R0,
                simulator=simulator, kT=kT(120.0),
                template=lennard_jones_template(displacement, 0.9))


def plain_loop(system, timings, params):
    """What a user would write with jax-md alone: one scan, no checks."""
    energy_fn = system["template"](params)
    init, apply = system["simulator"](energy_fn)

    @jax.jit
    def run(state, nbrs):
        def step(carry, _):
            s, nb = carry
            s = apply(s, neighbor=nb, kT=system["kT"])
            return (s, nb.update(s.position)), None

        def printout(carry, _):
            carry, _ = jax.lax.scan(step, carry, None, length=timings.steps_per_printout)
            return carry, (carry[0], energy_fn(carry[0].position, neighbor=carry[1]))

        carry, _ = jax.lax.scan(step, (state, nbrs), None, length=timings.n_equilibration_steps)
        return jax.lax.scan(printout, carry, None, length=timings.n_snapshots)
    return init, run


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def md_ratio(system, timings, repeats):
    from chemtrain.simulate import make_trajectory, run_with_restart
    params = {"sigma": jnp.asarray(0.34, system["R0"].dtype),
              "epsilon": jnp.asarray(0.99, system["R0"].dtype)}
    kw = {"kT": system["kT"], "mass": 39.95}
    init_fn, run_fn = make_trajectory(system["simulator"], system["template"],
                                      system["neighbor_fn"], timings)
    key = jax.random.PRNGKey(0)
    # equilibrate (and size the neighbor list) once; both loops start from here
    ts = run_with_restart(run_fn, system["neighbor_fn"], params,
                          init_fn(params, key, system["R0"], **kw), key, **kw)
    init, plain = plain_loop(system, timings, params)
    state = init(key, ts.sim_state.position, mass=39.95, neighbor=ts.nbrs)
    jax.block_until_ready((run_fn(params, ts, key, **kw).U_ref, plain(state, ts.nbrs)))  # compile
    ours, plain_t = float("inf"), float("inf")
    for _ in range(repeats):  # alternate, so a change of machine load hits both alike
        ours = min(ours, best_of(lambda: run_fn(params, ts, key, **kw).U_ref, 1))
        plain_t = min(plain_t, best_of(lambda: plain(state, ts.nbrs)[1][1], 1))
    steps = timings.n_equilibration_steps + timings.n_production_steps
    return steps / ours, steps / plain_t


def update_times(system, timings, updates, pool=1):
    from chemtrain import quantity
    from chemtrain.learn import ReuseRule
    from chemtrain.trainers.difftre import DifftreParallel
    from chemtrain.trainers import RunOptions
    rdf = quantity.rdf_discretization(0.85, 130, 0.2)
    dtype = system["R0"].dtype
    out = {}
    for ratio, label in ((0.0, "reweight-only"), (1.0, "recompute")):
        trainer = DifftreParallel(
            jax.random.PRNGKey(0), {"sigma": jnp.asarray(0.32, dtype),
                                    "epsilon": jnp.asarray(0.99, dtype)},
            optax.rmsprop(0.01), system["template"], system["simulator"], system["neighbor_fn"],
            timings, {"kT": np.array([system["kT"]]), "mass": np.array([39.95])},
            {"rdf": quantity.rdf(system["displacement"], rdf, box=system["box"])},
            {"rdf": {"target": np.ones((1, 130)), "gamma": 1.0}},
            reference_states=np.asarray(system["R0"])[None], reweight_ratio=ratio,
            # reweight-only means no recompute at all: the reuse bounds of
            # issue 31 (max_reuse_se, max_reuses) would recompute here too
            reuse=ReuseRule(pool=pool if ratio else 1, max_reuse_se=None, max_reuses=None),
            checkpoint_path="/tmp/difftre_benchmark", options=RunOptions(progress=False))
        trainer.initialize_trajstates()
        first = pool + 1 if ratio else 1
        trainer.train(first)  # compile (and fill the pool)
        trainer.train(updates)
        times = [e["time_s"] for e in trainer.history[first:]]
        kinds = {e["statepoints"][0]["recomputed"] for e in trainer.history[first:]}
        out[label] = (float(np.median(times)), kinds)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--particles", type=int, default=128)
    parser.add_argument("--snapshots", type=int, default=100)
    parser.add_argument("--steps-per-snapshot", type=int, default=10)
    parser.add_argument("--equilibration-steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--x64", action="store_true")
    parser.add_argument("--pool", type=int, default=1,
                        help="trajectories the recompute updates reweight from")
    parser.add_argument("--updates-only", action="store_true", help="skip the MD ratio")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.x64:
        jax.config.update("jax_enable_x64", True)
    from chemtrain.simulate import process_printouts
    dt = 0.01
    timings = process_printouts(dt, dt * (args.equilibration_steps + args.snapshots
                                          * args.steps_per_snapshot),
                                dt * args.equilibration_steps, dt * args.steps_per_snapshot)
    system = build(args.particles, jnp.float64 if args.x64 else jnp.float32)
    print(f"{args.particles} LJ particles, {timings.n_equilibration_steps} + "
          f"{timings.n_production_steps} steps, {timings.n_snapshots} snapshots, "
          f"{'float64' if args.x64 else 'float32'}, {jax.devices()[0].platform}")
    if not args.updates_only:
        ours, plain = md_ratio(system, timings, args.repeats)
        print(f"MD steps/s: chemtrain trajectory {ours:.0f}, plain jax-md scan {plain:.0f}, "
              f"ratio {ours / plain:.3f} (target >= 0.95)")
    times = update_times(system, timings, args.updates, args.pool)
    (t_re, k_re), (t_rc, k_rc) = times["reweight-only"], times["recompute"]
    print(f"update time (median of {args.updates}): reweight-only {t_re:.3f} s "
          f"(recomputed: {sorted(k_re)}), recompute with a pool of {args.pool} {t_rc:.3f} s "
          f"(recomputed: {sorted(k_rc)}), "
          f"ratio {t_rc / t_re:.1f}")


if __name__ == "__main__":
    main()
