"""HDF5ParallelDataLoader against in-memory data, same problem, one device.

    .venv/bin/python benchmarks/hdf5_loader.py [--frames 256] [--batch 16] [--epochs 3]

Trains the same MLP pair potential on the same jax-md Lennard-Jones frames
from memory and from an HDF5 file (alternating epochs, compile excluded) and
prints the step-time ratio (target at most 1.05). Then reads every batch of an
epoch through the loader without training and prints the read throughput.
"""
import argparse
import logging
import os
import tempfile
import time

import h5py
import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import numpy as np
import optax
from jax_md import partition, space

from chemtrain.data import HDF5ParallelDataLoader
from chemtrain.models import init_pair_mlp, pair_mlp_template
from chemtrain.simulate import lj_fluid_dataset
from chemtrain.trainers import ForceMatching, RunOptions


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("chemtrain").setLevel(logging.WARNING)
    data, box, _, _ = lj_fluid_dataset(n_particles=64, n_frames=args.frames)
    path = os.path.join(tempfile.mkdtemp(), "data.h5")
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v, chunks=(min(64, len(v)), *v.shape[1:]))
    disp, _ = space.periodic(box)
    nbrs = partition.neighbor_list(disp, box, 0.9, dr_threshold=0.05, capacity_multiplier=1.5,
                                   format=partition.NeighborListFormat.Sparse
                                   ).allocate(data["R"][0], extra_capacity=16)
    params = init_pair_mlp(jax.random.PRNGKey(0), hidden=(32, 32), n_basis=16)

    def make():
        return ForceMatching(params, optax.adam(1e-3), pair_mlp_template(disp, 0.9, r_min=0.25),
                             nbrs, batch=args.batch, parallelism="single", gammas={"U": 1e-2,
                                                                                   "F": 1.0},
                             checkpoint_path=tempfile.mkdtemp(), options=RunOptions(progress=False))
    mem, h5 = make(), make()
    mem.set_dataset(data, "training")
    h5.set_loader(HDF5ParallelDataLoader(path), "training")
    mem.train(1)
    h5.train(1)
    steps = args.frames // args.batch
    t_mem, t_h5 = [], []
    for _ in range(args.epochs):
        for tr, out in ((mem, t_mem), (h5, t_h5)):
            t = time.perf_counter()
            tr.train(1)
            out.append((time.perf_counter() - t) / steps)
    m, h = float(np.median(t_mem)), float(np.median(t_h5))
    print(f"{args.frames} frames of 64 atoms, batch {args.batch}, {jax.devices()[0].platform}, "
          f"median of {args.epochs} epochs")
    print(f"in memory: {m * 1e3:.2f} ms/step; HDF5 loader: {h * 1e3:.2f} ms/step; "
          f"ratio HDF5 / in memory: {h / m:.3f} (target <= 1.05)")
    big = os.path.join(os.path.dirname(path), "big.h5")
    with h5py.File(big, "w") as f:  # the frames 16 times over, for a longer read
        for k, v in data.items():
            f.create_dataset(k, data=np.concatenate([v] * 16), chunks=(64, *v.shape[1:]))
    for batch_size in (args.batch, 256):
        loader = HDF5ParallelDataLoader(big)
        loader.configure(batch_size, training=True, seed=0, strategy=h5.strategy)
        nbytes, t = 0, time.perf_counter()
        for batch in loader.local_batches(h5.strategy, epoch=0):
            nbytes += sum(v.nbytes for k, v in batch.items() if k != "_valid")
        dt = time.perf_counter() - t
        print(f"read throughput, shuffled rows, batch {batch_size}: {nbytes / dt / 1e6:.1f} MB/s "
              f"({nbytes / 1e6:.1f} MB in {dt:.3f} s)")


if __name__ == "__main__":
    main()
