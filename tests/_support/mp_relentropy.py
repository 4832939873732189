"""One MPI rank of tests/trainers/test_relative_entropy_mpi.py.

    mpirun -np N python tests/_support/mp_relentropy.py --out DIR --single CKPT

Trains the example's bonded molecules (examples/relative_entropy) at three
temperatures, all state points in every update (split 2/1 over two ranks),
for 2 epochs with checkpoints, resumes epoch 1 in a new trainer, and
continues ``CKPT``, the checkpoint of epoch 1 of one process, for an epoch. Every rank writes what it
saw to DIR/<name>_<rank>.json.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples",
                                "relative_entropy"))


def small(folder, **options):
    """The trainer of the MPI test (also built by the test in one process)."""
    import cg_bond_and_lj as ex
    return ex.bond_trainer(0, updates=4, kTs=(2.56, 3.0, 3.5), frames=50, production=2.0,
                           progress=False, checkpoint_path=folder, sim_batch_size=-1,
                           **options)[0]


def summary(tr):
    return {"params": {k: float(v) for k, v in tr.params.items()}, "s_rel": tr.s_rel,
            "losses": [e["loss"] for e in tr.history]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--single", required=True)
    args = p.parse_args()
    import jax
    import mp
    mp.session_compile_cache()
    jax.config.update("jax_enable_x64", True)
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank

    def write(name, value):
        with open(os.path.join(args.out, f"{name}_{rank}.json"), "w") as f:
            json.dump(value, f)

    tr = small(os.path.join(args.out, "a"))
    tr.train(2, checkpoint_freq=1)
    write("full", summary(tr))
    resumed = small(os.path.join(args.out, "b"))
    resumed.restore(tr.store.epoch_path(1))
    resumed.train(1)
    write("resumed", summary(resumed))
    elastic = small(os.path.join(args.out, "c"))   # a checkpoint of one process, on 2 ranks
    elastic.restore(args.single)
    elastic.train(1)
    write("from_single", summary(elastic))


if __name__ == "__main__":
    main()
