"""One process of a multi-process HDF5 test run (mpirun or jax.distributed).

    python tests/hdf5_run.py --train T.h5 --val V.h5 --out DIR --parallelism mpi|jax
        [--distributed N --process-id I --port P] [--open-file] [--rss-model]

Trains the fixed problem of tests/problems.py from HDF5 files, logging every
row index read from each dataset (through a wrapper around the h5py dataset
access) to DIR/reads_<process>.json; the root writes DIR/final.npz.
--rss-model trains one epoch of a Lennard-Jones model instead and prints the
peak resident memory.
"""
import argparse
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(__file__))

import mp  # noqa: E402


class LoggedDataset:
    def __init__(self, ds, log, where):
        self.ds, self.log, self.where = ds, log, where

    def __getitem__(self, sel):
        rows = range(sel.start, sel.stop) if isinstance(sel, slice) else sel
        self.log.append((*self.where, [int(i) for i in rows]))
        return self.ds[sel]


class LoggedFile:
    def __init__(self, f, log):
        self.f, self.log = f, log

    def __getitem__(self, key):
        return LoggedDataset(self.f[key], self.log, (os.path.basename(self.f.filename), key))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--parallelism", default="auto")
    mp.add_launch_args(p)
    p.add_argument("--open-file", action="store_true")
    p.add_argument("--rss-model", action="store_true")
    args = p.parse_args()
    import jax
    mp.session_compile_cache()
    mp.init_jax_distributed(args)
    jax.config.update("jax_enable_x64", True)
    import h5py
    import numpy as np
    import optax

    from chemtrain.data import HDF5ParallelDataLoader
    from chemtrain.trainers import ForceMatching, RunOptions
    from problems import FIXED, lj_template_for, mlp_model

    with h5py.File(args.train, "r") as f:
        box, R0 = float(f.attrs["box"]), f["R"][0]
    if args.rss_model:
        params, template, nbrs = lj_template_for(box, R0)
        batch, gammas = 64, {"U": 1e-3, "F": 1.0}
    else:
        params, template, nbrs = mlp_model(box, R0)
        batch, gammas = FIXED["batch"], FIXED["gammas"]
    tr = ForceMatching(params, optax.chain(optax.adam(1e-3)), template, nbrs, batch=batch,
                       parallelism=args.parallelism, gammas=gammas,
                       checkpoint_path=os.path.join(args.out, "ckpt"),
                       options=RunOptions(progress=False))
    proc = tr.strategy.process_index
    reads = []

    class Logged(HDF5ParallelDataLoader):
        def _open(self):
            return LoggedFile(h5py.File(self.path, "r"), reads)

        def read_rows(self, f, idx):
            reads.append((os.path.basename(self.path), "batch", []))  # a batch starts
            return super().read_rows(f, idx)

    source = h5py.File(args.train, "r") if args.open_file else args.train
    tr.set_loader(Logged(source), "training")
    if args.val:
        tr.set_loader(Logged(args.val), "validation")
    tr.train(1 if args.rss_model else FIXED["epochs"])
    if args.rss_model:
        with open(os.path.join(args.out, f"rss_{proc}.txt"), "w") as f:
            f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
        return
    with open(os.path.join(args.out, f"reads_{proc}.json"), "w") as f:
        json.dump(reads, f)
    if tr.strategy.is_root:
        final = {jax.tree_util.keystr(k): v for k, v in
                 jax.tree_util.tree_flatten_with_path(tr.strategy.to_host(tr.params))[0]}
        np.savez(os.path.join(args.out, "final.npz"), **final)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"train": tr.train_losses, "val": tr.val_losses, "step": tr.step}, f)
    print("DONE", proc, flush=True)


if __name__ == "__main__":
    main()
