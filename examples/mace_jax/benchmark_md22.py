"""Epoch times of chemtrain's MACE training on the MD22 nanotube, per parallel method.

    python examples/mace_jax/benchmark_md22.py [--runs single:1,jax:2,jax:4,mpi:2,mpi:4]
        [--epochs 4] [--discard 2] [--train 16] [--batch 4] [--data PATH] [--hdf5]
        [--float64] [--json benchmark_md22.json]

Every run trains the same model (a small MACE of MACE-MP's architecture, random
weights from a fixed seed) on the same structures with the same global batch,
precision and neighbor-list capacity, without validation or checkpoints, in a
fresh process: ``single:1`` one device; ``jax:N`` one process with N devices
(on a CPU, N host devices through XLA_FLAGS; on a GPU machine, the first N
GPUs); ``mpi:N`` N ranks under mpirun, one device each. The first
``--discard`` epochs include compilation and are left out; the rest give the
epoch time (median), structures per second, and for MPI every rank's time
(an epoch ends when the slowest rank is done: the slowest is reported).
The JSON also records the machine (CPU or GPU model, device count, load) and
package versions.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from chemtrain.finetune import data as ftdata, model as ftmodel  # (reader, model builder)

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN = os.path.join(HERE, "nanotube_standin.npz")
NM = ftdata.LENGTH


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", default="single:1,jax:2,mpi:2",
                   help="comma-separated METHOD:COUNT, METHOD in single, jax, mpi")
    p.add_argument("--data", default=STANDIN, help="MD22 .npz (the stand-in by default)")
    p.add_argument("--hdf5", action="store_true",
                   help="convert --data to HDF5 once and train from the file (HDF5ParallelDataLoader)")
    p.add_argument("--train", type=int, default=16, help="structures per epoch")
    p.add_argument("--batch", type=int, default=4, help="global batch (divisible by every COUNT)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--discard", type=int, default=2, help="first epochs left out (compilation)")
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--max-ell", type=int, default=1)
    p.add_argument("--correlation", type=int, default=2)
    p.add_argument("--r-max", type=float, default=4.0, help="Angstrom")
    p.add_argument("--capacity-multiplier", type=float, default=1.1,
                   help="neighbor-list capacity over the largest pair count in the data")
    p.add_argument("--pad-atoms", type=int, default=0, help="padded (masked) atoms added per structure")
    p.add_argument("--float64", action="store_true")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json", default="benchmark_md22.json", help="output file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: METHOD,result path
    args = p.parse_args(argv)
    if args.discard >= args.epochs:
        p.error(f"--discard {args.discard} leaves no epoch of --epochs {args.epochs} to time.")
    if args.hdf5 and args.pad_atoms:
        p.error("--pad-atoms pads the in-memory data only; leave out --hdf5 (or pad with chemtrain-convert --n-atoms).")
    return args


# -- one run (a worker process) -------------------------------------------------
def build(args):
    """Data, model and neighbor list: identical in every run."""
    import jax
    import jax.numpy as jnp
    from jax_md import partition, space
    from chemtrain.models import mace
    dtype = np.float64 if args.float64 else np.float32
    data = {k: ftdata.read(args.data)[k] for k in ("R", "U", "F", "species")}
    data = {k: v[:args.train] for k, v in data.items()}
    n_real = data["R"].shape[1]
    if args.pad_atoms:
        pad = ((0, 0), (0, args.pad_atoms))
        data = {"R": np.pad(data["R"], pad + ((0, 0),)), "F": np.pad(data["F"], pad + ((0, 0),)),
                "U": data["U"], "species": np.pad(data["species"], pad),
                "mask": np.arange(n_real + args.pad_atoms)[None].repeat(args.train, 0) < n_real}
        # padded atoms far from everything and from each other: they cost atoms, not edges
        data["R"][:, n_real:, 0] = 10.0 + np.arange(args.pad_atoms)
    data = {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in data.items()}
    R = data["R"][:, :n_real]
    d = np.linalg.norm(R[:, :, None] - R[:, None], axis=-1)
    pairs = ((d < args.r_max * NM) & (d > 0)).sum((1, 2))
    displacement, _ = space.free()
    neighbor_fn = partition.neighbor_list(displacement, 1000.0, args.r_max * NM, dr_threshold=0.0,
                                          capacity_multiplier=args.capacity_multiplier,
                                          format=partition.Sparse, disable_cell_list=True)
    nbrs = neighbor_fn.allocate(jnp.asarray(data["R"][int(np.argmax(pairs))]))
    cfg = ftmodel.random_config([1, 6], float(pairs.mean()) / n_real, 1.0,
                                num_channels=args.channels, max_ell=args.max_ell,
                                correlation=args.correlation, r_max=args.r_max)
    params = mace.init_params(cfg, jax.random.PRNGKey(0), dtype)
    info = {"n_atoms": n_real, "padded_atoms": args.pad_atoms, "pairs_max": int(pairs.max()),
            "neighbor_capacity": int(nbrs.idx.shape[1]),
            "n_params": int(sum(p.size for p in jax.tree.leaves(params)))}
    return data, cfg, params, displacement, nbrs, info


def worker(args) -> None:
    method, result_path = args.worker.split(",", 1)
    import jax
    if args.float64:
        jax.config.update("jax_enable_x64", True)
    import optax
    from chemtrain.models import mace
    from chemtrain.trainers import ForceMatching, RunOptions
    data, cfg, params, displacement, nbrs, info = build(args)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = ForceMatching(params, optax.adam(1e-3), mace.energy_fn_template(cfg, displacement),
                                nbrs, batch=args.batch, parallelism=method, checkpoint_path=tmp,
                                gammas={"U": 1e-6, "F": 1.0}, options=RunOptions(progress=False))
        if args.hdf5:
            rows = np.arange(args.train)
            from chemtrain.data import HDF5ParallelDataLoader
            trainer.set_loader(HDF5ParallelDataLoader(args.hdf5_path, rows=rows,
                                                      dtype=data["R"].dtype), "training")
        else:
            trainer.set_dataset(data, "training")
        own = []  # this process's wall time per epoch
        for _ in range(args.epochs):
            t = time.perf_counter()
            trainer.train(1)
            own.append(time.perf_counter() - t)
        per_process = [list(map(float, x)) for x in trainer.strategy.host_allgather(np.array(own))]
        # what a validation pass over the same structures and a checkpoint cost
        trainer.set_dataset(data, "validation")
        extras = {}
        for name, fn in (("validation_pass_first_s", lambda: trainer.evaluate("validation")),
                         ("validation_pass_s", lambda: trainer.evaluate("validation")),
                         ("checkpoint_write_s",
                          lambda: trainer.save_checkpoint(os.path.join(tmp, "c.npz")))):
            t = time.perf_counter()
            fn()
            extras[name] = trainer.strategy.host_max(time.perf_counter() - t)
        extras["checkpoint_bytes"] = os.path.getsize(os.path.join(tmp, "c.npz")) if trainer.strategy.is_root else 0
    if not trainer.strategy.is_root:
        return
    epochs = [h["time_s"] for h in trainer.history]  # the slowest process's, per epoch
    kept = epochs[args.discard:]
    median = statistics.median(kept)
    result = {
        "method": method, "n_shards": trainer.strategy.n_shards,
        "processes": trainer.strategy.process_count, "strategy": trainer.strategy.describe(),
        "epoch_s_all": epochs, "epoch_s_kept": kept, "epoch_s_median": median,
        "first_epoch_minus_median_s": epochs[0] - median,
        "steps_per_epoch": args.train // args.batch,
        "structures_per_s": (args.train // args.batch) * args.batch / median,
        "per_process_epoch_s": per_process,
        "slowest_process_epoch_s_median": max(statistics.median(p[args.discard:]) for p in per_process),
        "devices": [str(d.device_kind) for d in jax.devices()],
        **extras, **info,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


# -- the driver -----------------------------------------------------------------
def machine() -> dict:
    import importlib.metadata as md
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = ""
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    versions = {}
    for pkg in ("jax", "jaxlib", "jax-md", "cuequivariance-jax", "optax", "numpy", "h5py",
                "mpi4py", "mpi4jax", "mpich", "chemtrain"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpus": gpus.splitlines(),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_average": list(os.getloadavg()), "versions": versions}


def launch(args, method, count, result_path, argv):
    """Start one worker run; return (returncode, output)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    gpu = bool(machine_gpus())
    if not gpu:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count if method == 'jax' else 1}"
    elif method == "jax":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(count)))
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", f"{method},{result_path}"]
    if method == "mpi":
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        cmd = [mpirun if os.path.exists(mpirun) else "mpirun", "-np", str(count), *cmd]
        if gpu:  # one GPU per rank
            cmd = cmd[:3] + ["bash", "-c", 'CUDA_VISIBLE_DEVICES=${PMI_RANK:-$OMPI_COMM_WORLD_RANK} '
                             'exec "$@"', "--"] + cmd[3:]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    return out.returncode, out.stdout + out.stderr


def machine_gpus():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        args.hdf5_path = args.data + ".h5"
        worker(args)
        return 0
    runs = []
    for spec in args.runs.split(","):
        method, _, count = spec.strip().partition(":")
        if method not in ("single", "jax", "mpi") or not count.isdigit():
            raise SystemExit(f"--runs: expected METHOD:COUNT with METHOD single, jax or mpi, got {spec!r}.")
        if method == "single" and count != "1":
            raise SystemExit(f"--runs: single means one device, got {spec!r}.")
        if args.batch % int(count):
            raise SystemExit(f"--batch {args.batch} is not divisible by {count} ({spec}); the global "
                             f"batch stays the same in every run.")
        runs.append((method, int(count)))
    with tempfile.TemporaryDirectory() as tmp:
        if args.hdf5:  # one file for every run, converted once
            from chemtrain.data.convert import convert
            subset = os.path.join(tmp, "subset.npz")
            raw = np.load(args.data)
            np.savez(subset, **{k: raw[k][:args.train] if k in ("R", "E", "F") else raw[k]
                                for k in ("R", "E", "F", "z")})
            convert(subset, subset + ".h5", n_atoms=None, progress=False)
            argv = [a for a in argv if a != "--hdf5"] + ["--hdf5", "--data", subset]
        report = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
                  "machine": machine(), "runs": []}
        for method, count in runs:
            result = os.path.join(tmp, f"{method}{count}.json")
            t = time.perf_counter()
            code, out = launch(args, method, count, result, argv)
            if code != 0 or not os.path.exists(result):
                print(out[-4000:], file=sys.stderr)
                raise SystemExit(f"run {method}:{count} failed with exit code {code} (output above).")
            with open(result) as f:
                r = json.load(f)
            r["wall_s"] = time.perf_counter() - t
            report["runs"].append(r)
            print(f"{method}:{count}  epoch {r['epoch_s_median']:.2f} s (slowest process "
                  f"{r['slowest_process_epoch_s_median']:.2f} s), {r['structures_per_s']:.2f} "
                  f"structures/s, first epoch +{r['first_epoch_minus_median_s']:.1f} s", flush=True)
    report["machine"]["load_average_end"] = list(os.getloadavg())
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
