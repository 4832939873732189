"""One process of a failure scenario under mpirun or jax.distributed.

    python tests/mp_failures.py --case CASE --data D.npz --out DIR [--h5 A.h5 --h5-other B.h5]

Cases (process 1 is the one that misbehaves):
  between        process 1 raises in user code between two train() calls
  missing_h5     process 1 opens an HDF5 file that does not exist
  differing_h5   the processes open HDF5 files with different rows
  root_error     the root's dataset holds an element the model refuses
  restore        process 1 names another checkpoint than the root; then all
                 name a missing one
  early_exit     process 1 trains one epoch and its script ends (after
                 EARLY_EXIT_LINGER_S seconds); process 0 trains on (it would
                 wait forever in its next collective)
  single_race    every process runs its own parallelism='single' run into one
                 checkpoint folder (two runs started together)
Every process that catches an error writes DIR/error_<process>.txt with its
class and message (processes share one stdout pipe).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import mp  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--parallelism", default="mpi")
    p.add_argument("--h5", default=None)
    p.add_argument("--h5-other", default=None)
    mp.add_launch_args(p)
    args = p.parse_args()

    import jax
    mp.session_compile_cache()
    mp.init_jax_distributed(args)
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    import optax

    from chemtrain.data import HDF5ParallelDataLoader
    from chemtrain.models import EnergyTemplate
    from chemtrain.models.mace import UnknownElementError
    from chemtrain.trainers import ForceMatching, RunOptions
    from problems import mlp_model

    with np.load(args.data) as z:
        box, R0 = float(z["box"]), z["R0"]
        data = {k: z[k][:24] for k in ("R", "U", "F")}
    params, template, nbrs = mlp_model(box, R0)

    def refuse(d):
        if "species" in d:
            raise UnknownElementError("atomic number 99 is not known to the model (test)")

    tr = ForceMatching(params, optax.sgd(1e-4), EnergyTemplate(template, validate_dataset=refuse),
                       nbrs, batch=4, parallelism=args.parallelism,
                       checkpoint_path=os.path.join(args.out, "ckpt"),
                       options=RunOptions(progress=False))
    proc = tr.strategy.process_index

    def failing_now():  # the bound on ending every process counts from here
        with open(os.path.join(args.out, f"fail_time_{proc}.txt"), "w") as f:
            f.write(repr(time.time()))

    def record(e):
        with open(os.path.join(args.out, f"error_{proc}.txt"), "a") as f:
            f.write(f"{type(e).__name__}: {e}\n")

    if args.case == "between":
        tr.set_datasets(data)
        tr.train(1)
        if proc == 1:
            failing_now()
            raise RuntimeError("user code failed between train() calls on process 1")
        tr.train(1)
    elif args.case in ("missing_h5", "differing_h5"):
        path = args.h5
        if proc == 1:
            path = (os.path.join(args.out, "no_such_file.h5") if args.case == "missing_h5"
                    else args.h5_other)
        failing_now()
        try:
            tr.set_loader(HDF5ParallelDataLoader(path))
        except ValueError as e:
            record(e)
            raise
        tr.train(1)
    elif args.case == "root_error":
        bad = dict(data, species=np.full(data["R"].shape[:2], 99)) if proc == 0 else None
        try:
            tr.set_datasets(bad)
        except Exception as e:  # noqa: BLE001 - the class is what the test checks
            record(e)
    elif args.case == "restore":
        tr.save_checkpoint(os.path.join(args.out, "a.npz"))
        for name in ("a.npz" if proc == 0 else "b.npz", "missing.npz"):
            try:
                tr.restore(os.path.join(args.out, name))
            except Exception as e:  # noqa: BLE001
                record(e)
    elif args.case == "early_exit":
        tr.set_datasets(data)
        tr.train(1)
        if proc == 1:
            # let process 0 enter its next train() and send this process its
            # first message first: with a message pending, finalizing MPI failed
            time.sleep(float(os.environ.get("EARLY_EXIT_LINGER_S", "0")))
            failing_now()
            print("PROCESS-1-ENDS", flush=True)
            return
        tr.train(3)
    elif args.case == "single_race":
        tr.set_datasets(data)
        try:
            tr.train(2, checkpoint_freq=1)
        except Exception as e:  # noqa: BLE001
            record(e)
    else:
        raise SystemExit(f"unknown case {args.case}")
    print("FINISHED-NORMALLY", proc, flush=True)


if __name__ == "__main__":
    main()
