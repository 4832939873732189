"""One MPI rank of tests/test_interleave.py: fused force matching (batch 8
split over the ranks) and relative entropy (two state points, one per
rank) for 2 fused epochs; writes DIR/fused_<rank>.json."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import jax
    import mp
    mp.private_compile_cache()
    jax.config.update("jax_enable_x64", True)
    from mpi4py import MPI
    from fused_systems import fused
    together, _, _ = fused(os.path.join(args.out, "run"), kTs=(2.56, 3.0))
    together.train(2)
    with open(os.path.join(args.out, f"fused_{MPI.COMM_WORLD.rank}.json"), "w") as f:
        json.dump({k: float(v) for k, v in together.params.items()}, f)


if __name__ == "__main__":
    main()
