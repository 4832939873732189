"""One MPI rank of tests/trainers/test_ensemble.py: the committee of
ensemble_problem.py trained under parallelism='mpi'; every rank writes each
member's parameters (leaf path -> values) to DIR/result_<rank>.json.

    mpirun -np 2 python tests/_support/mp_ensemble.py --out DIR --epochs 2
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    import jax
    import mp
    mp.session_compile_cache()
    jax.config.update("jax_enable_x64", True)
    from mpi4py import MPI
    import ensemble_problem as ep
    rank = MPI.COMM_WORLD.rank
    tr = ep.committee(ep.setup(), os.path.join(args.out, "run"), parallelism="mpi")
    tr.train(args.epochs)
    members = [{jax.tree_util.keystr(path): leaf.tolist() for path, leaf
                in jax.tree_util.tree_flatten_with_path(tr.member(k))[0]} for k in range(ep.K)]
    with open(os.path.join(args.out, f"result_{rank}.json"), "w") as f:
        json.dump({"members": members, "n_shards": tr.strategy.n_shards}, f)


if __name__ == "__main__":
    main()
