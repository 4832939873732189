"""One MPI rank of tests/learn/test_difftre_grad.py: DiffTRe on the small MACE of
mace_difftre.py, two state points (one per rank), 2 epochs; writes
DIR/params_<rank>.json (the flattened parameters)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    out = sys.argv[1]
    import jax
    import mp
    mp.session_compile_cache()
    jax.config.update("jax_enable_x64", True)
    import jax.flatten_util
    import numpy as np
    import optax
    from mpi4py import MPI
    from mace_difftre import mace_trainer
    trainer, _ = mace_trainer(os.path.join(out, "run"), kTs=(2.5, 3.0), sim_batch_size=-1,
                              optimizer=optax.adam(1e-3))
    trainer.initialize_trajstates()
    trainer.train(2)
    flat = np.asarray(jax.flatten_util.ravel_pytree(trainer.params)[0])
    with open(os.path.join(out, f"params_{MPI.COMM_WORLD.rank}.json"), "w") as f:
        json.dump(flat.tolist(), f)


if __name__ == "__main__":
    main()
