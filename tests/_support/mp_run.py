"""One process of a multi-process test run (mpirun or jax.distributed).

    python tests/mp_run.py --data D.npz --out DIR [--parallelism mpi|jax|auto]
        [--distributed N --process-id I --port P | --distributed-mpi]
        [--rank-init] [--fail-rank R] [--report-only] [--batch B]

Trains the fixed problem of tests/problems.py (FIXED) and writes the root's
final state to DIR/final.npz and every process's state after construction to
DIR/init_<process>.npz. Under 'mpi' only rank 0 opens the dataset arrays.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import mp  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--parallelism", default="auto")
    mp.add_launch_args(p)
    p.add_argument("--distributed-mpi", action="store_true")
    p.add_argument("--rank-init", action="store_true")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--check-no-mpi", action="store_true")
    p.add_argument("--diverge", action="store_true", help="perturb one leaf on process 1")
    args = p.parse_args()

    import jax
    mp.session_compile_cache()
    mp.init_jax_distributed(args)
    if args.distributed_mpi:
        jax.distributed.initialize(cluster_detection_method="mpi4py")
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    import optax

    from chemtrain.parallel import resolve
    from chemtrain.trainers import ForceMatching, RunOptions
    from problems import FIXED, mlp_model

    rank = int(os.environ.get("PMI_RANK", args.process_id))
    if args.report_only:  # one file per process: ranks share one stdout pipe
        name = resolve(args.parallelism)
        with open(os.path.join(args.out, f"resolved_{rank}.txt"), "w") as f:
            f.write(name)
        print("RESOLVED", name, flush=True)
        return
    with np.load(args.data) as z:  # lazy: only the arrays read here are loaded
        box, R0 = float(z["box"]), z["R0"]
        root_loads = args.parallelism != "mpi" or rank == 0
        data = {k: z[k] for k in ("R", "U", "F")} if root_loads else None
    params, template, nbrs = mlp_model(box, R0, seed=1 + (rank if args.rank_init else 0))

    def anchor(offset):
        # an optimizer whose state depends on the process: tests the state broadcast
        return optax.GradientTransformation(
            lambda p: {"anchor": jax.tree.map(lambda x: x + offset, p)},
            lambda u, s, p=None: (u, s))

    opt = optax.chain(optax.adam(1e-3), anchor(float(rank) if args.rank_init else 0.0))
    tr = ForceMatching(params, opt, template, nbrs, batch=args.batch or FIXED["batch"],
                       parallelism=args.parallelism, gammas=FIXED["gammas"],
                       checkpoint_path=os.path.join(args.out, "ckpt"),
                       options=RunOptions(progress=False, consistency_check_every=5))
    proc = tr.strategy.process_index
    host = {"params": tr.strategy.to_host(tr.params), "opt_state": tr.strategy.to_host(tr.opt_state)}
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(host)[0]}
    np.savez(os.path.join(args.out, f"init_{proc}.npz"), **flat)
    with open(os.path.join(args.out, f"strategy_{proc}.txt"), "w") as f:
        f.write(f"{tr.strategy.name} {tr.strategy.n_shards}")
    tr.set_datasets(data, train_ratio=FIXED["train_ratio"], val_ratio=FIXED["val_ratio"])
    if args.diverge and proc == 1:
        tr.params["layers"][1]["w"] = tr.params["layers"][1]["w"] + 1e-12
    if proc == args.fail_rank:
        loader = tr.data["training"]
        original = loader.local_batches

        def failing(strategy, epoch=0):
            for i, b in enumerate(original(strategy, epoch)):
                if i == 2:
                    import time
                    with open(os.path.join(args.out, f"fail_time_{proc}.txt"), "w") as f:
                        f.write(repr(time.time()))
                    raise OSError(f"simulated read failure on process {proc}")
                yield b
        loader.local_batches = failing
    tr.train(FIXED["epochs"])
    if tr.strategy.is_root:
        final = {jax.tree_util.keystr(k): v for k, v in
                 jax.tree_util.tree_flatten_with_path(tr.strategy.to_host(tr.params))[0]}
        np.savez(os.path.join(args.out, "final.npz"), **final)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"train": tr.train_losses, "val": tr.val_losses, "step": tr.step}, f)
    if args.check_no_mpi:
        loaded = [m for m in ("mpi4py", "mpi4jax") if m in sys.modules]
        assert not loaded, f"imported {loaded}"
    print("DONE", proc, flush=True)


if __name__ == "__main__":
    main()
