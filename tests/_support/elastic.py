"""Elastic resume (tests/trainers/test_elastic_resume.py): a force-matching
run and a committee, each with EMA and a plateau scheduler, checkpointed on
one layout and continued on another.

    python elastic.py --mode killable --out DIR        (4 devices, 'jax')
        trains both, one epoch each in turn, a checkpoint after every epoch,
        until it is killed;
    mpirun -np 3 python elastic.py --mode resume --out DIR --from FOLDER
        restores the newest checkpoint of each from FOLDER, trains MORE
        epochs more and writes DIR/<kind>_<rank>.json (:func:`result`);
        with --distributed N (tests/_support/mp.py's launch), the same in N
        jax.distributed processes.
"""
import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BATCH = 12   # global batch: divisible by 4 and 2 devices and 3 ranks
MORE = 2     # epochs trained after the resume


def optimizer():
    import optax
    from chemtrain.learn.optimizers import ema, reduce_on_plateau
    return ema(reduce_on_plateau(optax.adam(1e-3), patience=0), decay=0.9)


def trainer(kind, folder, parallelism="single", mesh=None):
    """The force-matching run (``kind='fm'``) or the committee
    (``'committee'``, bootstrapped) with its data set."""
    from chemtrain.trainers import EnsembleOfModels, ForceMatching, RunOptions
    import ensemble_problem as ep
    from problems import mlp_problem
    common = dict(batch=BATCH, parallelism=parallelism, mesh=mesh, gammas=ep.GAMMAS,
                  checkpoint_path=folder, options=RunOptions(progress=False))
    data, params, template, nbrs = mlp_problem()
    if kind == "fm":
        tr = ForceMatching(params, optimizer(), template, nbrs, seed=3, **common)
    else:
        tr = EnsembleOfModels(ep.members(), optimizer(), template, nbrs, bootstrap=True,
                              seed=ep.SEED, **common)
    tr.set_datasets(data, train_ratio=0.75, val_ratio=0.25)   # 36: 3 steps per epoch
    return tr


def newest(folder):
    """The checkpoint of the most epochs in ``folder`` (a killed run's
    partial write is a hidden temporary file, not matched)."""
    found = sorted(glob.glob(os.path.join(folder, "epoch_*.npz")))
    if not found:
        raise FileNotFoundError(f"no checkpoint in {folder}")
    return found[-1]


def result(tr):
    """What must equal the uninterrupted run: parameters, optimizer state
    and the loss histories (host lists)."""
    import jax
    import numpy as np
    host = tr.strategy.to_host
    leaves = lambda t: [np.asarray(x).tolist() for x in jax.tree.leaves(host(t))]  # noqa: E731
    return {"epoch": tr.epoch, "params": leaves(tr.params), "opt_state": leaves(tr.opt_state),
            "train_losses": list(tr.train_losses), "val_losses": list(tr.val_losses),
            "n_shards": tr.strategy.n_shards}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("killable", "resume"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--from", dest="source")
    import mp
    mp.add_launch_args(p)
    args = p.parse_args()
    import jax
    mp.session_compile_cache()
    jax.config.update("jax_enable_x64", True)
    mp.init_jax_distributed(args)
    if args.mode == "killable":
        runs = [trainer(kind, os.path.join(args.out, kind), "jax") for kind in ("fm", "committee")]
        assert all(tr.strategy.n_shards == 4 for tr in runs)
        while True:
            for tr in runs:
                tr.train(1, checkpoint_freq=1)
            print("epochs done:", runs[0].epoch, flush=True)
    if args.distributed:   # jax.distributed: 'jax' over the processes' devices
        parallelism, rank = "jax", jax.process_index()
    else:
        from mpi4py import MPI
        parallelism, rank = "mpi", MPI.COMM_WORLD.rank
    for kind in ("fm", "committee"):
        tr = trainer(kind, os.path.join(args.out, f"{kind}_run"), parallelism)
        tr.restore(newest(os.path.join(args.source, kind)))
        tr.train(MORE)
        with open(os.path.join(args.out, f"{kind}_{rank}.json"), "w") as f:
            json.dump(result(tr), f)


if __name__ == "__main__":
    main()
