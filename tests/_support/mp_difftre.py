"""One MPI rank of the DifftreParallel tests (tests/trainers/test_difftre_mpi.py).

    mpirun -np N python tests/mp_difftre.py --case CASE --out DIR

Every rank writes what it saw to DIR/<name>_<rank>.json (ranks share one
stdout pipe, whose lines can interleave). Cases:
  main       equivalence (4 state points, sim_batch_size 2 and -1, 3 epochs;
             the first also saves after epoch 1 and resumes), folding (5 state
             points, sim_batch_size 2, SGD), files (read-only folder, error
             state) and bad input (sim_batch_size below the world size,
             parallelism='jax', different state points per rank)
  three      on 3 ranks: sim_batch_size -1 (state points split 2/1/1), and
             sim_batch_size 2 below the world size
  devices    two visible JAX devices per rank
  fail       state point 1 (rank 1) overflows its neighbor list with no retries
             left (every rank must raise); then rank 1 raises in the middle of
             update 2 (the job must end)
"""
import argparse
import json
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(__file__))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--readonly", default="/sys")
    args = p.parse_args()

    import jax
    import mp
    mp.session_compile_cache()
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    import optax
    from mpi4py import MPI

    from chemtrain.learn import ReuseRule
    from difftre_systems import bonded_pair, overflowing_lj, update_recorder

    rank = MPI.COMM_WORLD.rank
    out = args.out

    def write(name, value):
        with open(os.path.join(out, f"{name}_{rank}.json"), "w") as f:
            json.dump(value, f)

    def outcome(name, fn):
        """Run ``fn``; write its error class and message (or 'ok')."""
        try:
            fn()
            write(name, {"ok": True})
        except Exception as e:  # noqa: BLE001 - the test reads class and message
            write(name, {"ok": False, "type": type(e).__name__, "message": str(e)})

    def state(trainer):
        data = sorted(trainer.trajstates)
        crc = 0
        for i in data:
            for t in trainer.trajstates[i]:
                for leaf in jax.tree.leaves(t):
                    crc = zlib.crc32(np.ascontiguousarray(np.asarray(leaf)).tobytes(), crc)
        return {"params": {k: float(v) for k, v in trainer.params.items()},
                "epoch": trainer.epoch, "update_count": trainer.update_count,
                "trajstates": data, "trajstates_crc": crc,
                "recomputed": [[r["recomputed"] for r in e["statepoints"]]
                               for e in trainer.history],
                "used": [[[r["statepoint"], r["update"]] for r in e["statepoints"]]
                         for e in trainer.history],
                "comm_s": [e["comm_s"] for e in trainer.history],
                "wait_s": [e["wait_s"] for e in trainer.history]}

    def folder(name):
        return os.path.join(out, name)

    if args.case == "main":
        for sbs in (2, -1):
            tr = bonded_pair(4, sim_batch_size=sbs, parallelism="mpi",
                             checkpoint_path=folder(f"eq{sbs}"))
            tr.initialize_trajstates()
            if sbs == 2:
                tr.train(1)
                tr.save_checkpoint(folder("k.npz"))
                tr.save_trajstates(folder("t.npz"))
                tr.train(2)
            else:
                tr.train(3)
            write(f"eq{sbs}", state(tr))
        # resume: restore after epoch 1, load the trajectory states, 2 more epochs
        tr = bonded_pair(4, sim_batch_size=2, parallelism="mpi", checkpoint_path=folder("resumed"))
        tr.restore(folder("k.npz"), trajstates=False)
        tr.load_trajstates(folder("t.npz"))
        tr.train(2)
        write("resumed", state(tr))
        # folding: 5 state points in batches [0, 1] and [2, 3, 4], plain SGD
        records, on_update = update_recorder()
        # (only the overlap rule: the test recomputes the last gradient from the
        # stored trajectories)
        tr = bonded_pair(5, sim_batch_size=2, optimizer=optax.sgd(1e-3), parallelism="mpi",
                         reuse=ReuseRule(pool=1, max_reuse_se=None, max_reuses=None),
                         checkpoint_path=folder("fold"), on_update=on_update)
        tr.initialize_trajstates()
        tr.train(2)
        write("fold", dict(state(tr), updates=records))
        # files: the root cannot write; an error state is refused by restore
        tr = bonded_pair(4, sim_batch_size=2, parallelism="mpi",
                         checkpoint_path=folder("ro"))
        tr.initialize_trajstates()
        outcome("readonly_checkpoint", lambda: tr.save_checkpoint(
            os.path.join(args.readonly, "chemtrain_k.npz")))
        outcome("readonly_trajstates", lambda: tr.save_trajstates(
            os.path.join(args.readonly, "chemtrain_t.npz")))
        bad = {"rdf": {"target": np.ones((4, 50)), "gamma": 1.0},
               "energy": {"target": np.array([1.0, 1.0, np.nan, 1.0]), "gamma": 0.1}}
        tr = bonded_pair(4, sim_batch_size=2, targets=bad, parallelism="mpi",
                         checkpoint_path=folder("err"), name="pair")
        tr.initialize_trajstates()
        outcome("nan_target", lambda: tr.train(1))
        outcome("restore_error_state", lambda: bonded_pair(
            4, sim_batch_size=2, parallelism="mpi", checkpoint_path=folder("err2")).restore(
                folder("err/pair_error_state.npz")))
        # bad input
        outcome("batch_below_ranks", lambda: bonded_pair(4, sim_batch_size=1, parallelism="mpi"))
        outcome("jax", lambda: bonded_pair(4, sim_batch_size=2, parallelism="jax"))
        outcome("different_statepoints", lambda: bonded_pair(
            4 if rank == 0 else 3, sim_batch_size=2, parallelism="mpi"))
    elif args.case == "three":
        tr = bonded_pair(4, sim_batch_size=-1, parallelism="auto",
                         checkpoint_path=folder("eq-1"))
        tr.initialize_trajstates()
        tr.train(3)
        write("eq-1", state(tr))
        outcome("batch_below_ranks", lambda: bonded_pair(4, sim_batch_size=2))
        outcome("all_below_ranks", lambda: bonded_pair(2, sim_batch_size=-1))
        # elastic resume: 7 state points, checkpointed after epoch 1 on 3 ranks
        records, on_update = update_recorder()
        tr = bonded_pair(7, sim_batch_size=3, parallelism="mpi", on_update=on_update,
                         checkpoint_path=folder("seven"))
        tr.initialize_trajstates()
        tr.train(1)
        tr.save_checkpoint(folder("seven.npz"))
        tr.train(2)
        write("seven", dict(state(tr), updates=records))
    elif args.case == "seven_on_two":   # --out: the folder of case "three"
        records, on_update = update_recorder()
        tr = bonded_pair(7, sim_batch_size=3, parallelism="mpi", on_update=on_update,
                         checkpoint_path=folder("seven_on_two"))
        tr.restore(folder("seven.npz"))
        tr.train(2)
        write("seven_on_two", dict(state(tr), updates=records))
    elif args.case == "devices":
        outcome("devices", lambda: bonded_pair(4, sim_batch_size=2, parallelism="mpi"))
        outcome("devices_auto", lambda: bonded_pair(4, sim_batch_size=2))
    elif args.case == "fail":
        tr = overflowing_lj(parallelism="mpi", checkpoint_path=folder("overflow"))
        outcome("overflow", tr.initialize_trajstates)
        tr = bonded_pair(4, sim_batch_size=2, parallelism="mpi", checkpoint_path=folder("fail"))
        tr.initialize_trajstates()
        import dataclasses
        result = tr.objective.result

        def failing(sp, params, trajs, derived, inputs):  # injected fault: rank 1, update 2
            if rank == 1 and tr.update_count == 2:
                with open(os.path.join(out, f"fail_time_{rank}.txt"), "w") as f:
                    f.write(repr(time.time()))
                raise RuntimeError(f"injected failure on rank {rank} in update 2")
            return result(sp, params, trajs, derived, inputs)
        # an objective is a value: this one fails where DiffTRe's would not
        tr.objective = dataclasses.replace(tr.objective, result=failing)
        tr.train(3)
        print("DONE", flush=True)  # never reached
    else:
        raise SystemExit(f"unknown case {args.case!r}")


if __name__ == "__main__":
    main()
