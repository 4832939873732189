"""One MPI rank of tests/trainers/test_interleave.py: fused force matching (batch 8
split over the ranks) and relative entropy (two state points, one per
rank) for 2 fused epochs, a checkpoint after each (DIR/run/fused/); writes
DIR/fused_<rank>.json. With ``--disagree
num_updates|order`` rank 1 builds other turns, and each rank writes the
error it got to DIR/disagree_<rank>.json."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--disagree", choices=("num_updates", "order"), default=None)
    args = p.parse_args()
    import jax
    import mp
    mp.session_compile_cache()
    jax.config.update("jax_enable_x64", True)
    from mpi4py import MPI
    from fused_systems import fused
    rank = MPI.COMM_WORLD.rank
    if args.disagree:
        from chemtrain.trainers import InterleaveTrainers, RunOptions
        _, fm, re_trainer = fused(os.path.join(args.out, "run"), kTs=(2.56, 3.0))
        together = InterleaveTrainers(os.path.join(args.out, "turns"),
                                      options=RunOptions(progress=False))
        turns = [(fm, 1, "FM"), (re_trainer, 2, "RE")]   # rank 0: as fused() adds them
        if rank == 1 and args.disagree == "num_updates":
            turns = [(fm, 2, "FM"), (re_trainer, 2, "RE")]
        elif rank == 1:
            turns = turns[::-1]
        for trainer, n, name in turns:
            together.add_trainer(trainer, num_updates=n, name=name)
        try:
            together.train(1)
            got = {"error": None, "message": ""}
        except Exception as e:  # noqa: BLE001 - the test reads which
            got = {"error": type(e).__name__, "message": str(e)}
        with open(os.path.join(args.out, f"disagree_{rank}.json"), "w") as f:
            json.dump(got, f)
        return
    together, _, _ = fused(os.path.join(args.out, "run"), kTs=(2.56, 3.0))
    together.train(2, checkpoint_freq=1)   # epoch 1's folder: the test resumes it
    with open(os.path.join(args.out, f"fused_{rank}.json"), "w") as f:
        json.dump({k: float(v) for k, v in together.params.items()}, f)


if __name__ == "__main__":
    main()
