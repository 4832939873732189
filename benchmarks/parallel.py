"""Per-step time of ForceMatching under each parallel method, same model and
global batch; the share of an MPI step spent in the gradient allreduce; and
one packed allreduce against one allreduce per leaf.

    .venv/bin/python benchmarks/parallel.py [--batch 16] [--epochs 3] [--hidden 64]

Starts the workers itself: one process (single), one process with 2 CPU
devices (jax), `mpirun -np 2` (mpi) and 2 jax.distributed processes. On this
2-core machine every method shares the same two cores, so the figures show
overheads, not speed-ups.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
BIN = os.path.dirname(sys.executable)


def env(devices):
    e = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
    e["PATH"] = BIN + os.pathsep + e["PATH"]
    return e


def worker(args):
    import jax
    if args.process_id >= 0:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                                   process_id=args.process_id)
    import logging

    import numpy as np
    import optax
    from jax_md import partition, space

    from chemtrain.models import init_pair_mlp, pair_mlp_template
    from chemtrain.trainers import ForceMatching, RunOptions
    logging.getLogger("chemtrain").setLevel(logging.WARNING)
    with np.load(args.data) as z:
        box = float(z["box"])
        data = {k: z[k] for k in ("R", "U", "F")}
    disp, _ = space.periodic(box)
    nbrs = partition.neighbor_list(disp, box, 0.9, dr_threshold=0.05, capacity_multiplier=1.5,
                                   format=partition.NeighborListFormat.Sparse
                                   ).allocate(data["R"][0], extra_capacity=16)
    params = init_pair_mlp(jax.random.PRNGKey(0), hidden=(args.hidden, args.hidden), n_basis=16)
    tr = ForceMatching(params, optax.adam(1e-3), pair_mlp_template(disp, 0.9, r_min=0.25), nbrs,
                       batch=args.batch, parallelism=args.mode, gammas={"U": 1e-2, "F": 1.0},
                       checkpoint_path=tempfile.mkdtemp(), options=RunOptions(progress=False))
    tr.set_dataset(data, "training")
    tr.train(1)  # compile
    tr.train(args.epochs)
    steps = len(data["R"]) // args.batch
    step_s = float(np.median([h["time_s"] for h in tr.history[1:]])) / steps
    result = {"mode": args.mode, "shards": tr.strategy.n_shards, "step_ms": step_s * 1e3,
              "n_params": int(sum(np.size(x) for x in jax.tree.leaves(params)))}
    if args.mode == "mpi":
        result.update(allreduce_timing(tr, params))
    if tr.strategy.is_root:
        print("RESULT " + json.dumps(result), flush=True)


def allreduce_timing(tr, params, repeats=200):
    """Time the packed gradient allreduce and one allreduce per leaf, in jit."""
    import jax
    import numpy as np
    from mpi4py import MPI
    s = tr.strategy
    grads = jax.device_put(jax.tree.map(lambda x: np.ones_like(x), params))
    packed = jax.jit(s.mean_gradient)
    per_leaf = jax.jit(lambda g: jax.tree.map(
        lambda x: s._mpi4jax.allreduce(x, op=MPI.SUM, comm=s._jax_comm) / s.n_shards, g))
    out = {}
    for name, fn in (("packed", packed), ("per_leaf", per_leaf)):
        jax.block_until_ready(fn(grads))
        s.comm.Barrier()  # MPI-only benchmark: start the timing together
        t = time.perf_counter()
        for _ in range(repeats):
            r = fn(grads)
        jax.block_until_ready(r)
        out[f"allreduce_{name}_ms"] = s.host_max((time.perf_counter() - t) / repeats) * 1e3
    out["n_leaves"] = len(jax.tree.leaves(params))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmds, devices):
    procs = [subprocess.Popen(c, env=env(devices), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in cmds]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1200)
        if p.returncode:
            raise RuntimeError(f"worker failed: {' '.join(cmds[0])}\n{err[-3000:]}")
        results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return results[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--frames", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--mode")
    p.add_argument("--data")
    p.add_argument("--process-id", type=int, default=-1)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.mode:
        return worker(args)
    import numpy as np
    from chemtrain.simulate import lj_fluid_dataset
    data, box, _, _ = lj_fluid_dataset(n_particles=64, n_frames=args.frames)
    path = os.path.join(tempfile.mkdtemp(), "data.npz")
    np.savez(path, box=box, **data)
    common = [sys.executable, HERE, "--data", path, "--batch", str(args.batch),
              "--epochs", str(args.epochs), "--hidden", str(args.hidden)]
    port = free_port()
    res = {
        "single": run([common + ["--mode", "single"]], 1),
        "jax (2 devices)": run([common + ["--mode", "jax"]], 2),
        "mpi (2 ranks)": run([[os.path.join(BIN, "mpirun"), "-np", "2"] + common + ["--mode", "mpi"]], 1),
        "jax.distributed (2 processes)": run(
            [common + ["--mode", "jax", "--process-id", str(i), "--port", str(port)] for i in range(2)], 1),
    }
    print(f"global batch {args.batch}, 64-atom LJ frames, pair MLP with "
          f"{res['single']['n_params']} parameters, median of {args.epochs} epochs")
    for name, r in res.items():
        print(f"  {name:32s} {r['step_ms']:8.2f} ms/step  ({r['shards']} shard(s)) "
              f"ratio to single {r['step_ms'] / res['single']['step_ms']:.2f}")
    m = res["mpi (2 ranks)"]
    print(f"MPI gradient allreduce (packed, {m['n_leaves']} leaves in one buffer): "
          f"{m['allreduce_packed_ms']:.3f} ms = {100 * m['allreduce_packed_ms'] / m['step_ms']:.2f} % of an MPI step")
    print(f"one allreduce per leaf: {m['allreduce_per_leaf_ms']:.3f} ms; "
          f"ratio per-leaf / packed: {m['allreduce_per_leaf_ms'] / m['allreduce_packed_ms']:.2f}")


if __name__ == "__main__":
    main()
