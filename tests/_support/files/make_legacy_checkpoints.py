"""Write the checkpoints in this folder: one of ForceMatching and one of
DifftreParallel (with trajectory states), each after one epoch of a tiny
run. They were written by chemtrain at commit 7ca1dec (trainers that copied
their state attribute by attribute) and are kept to show that later
versions restore them; rerun only to make files of a new format.

    .venv/bin/python tests/_support/files/make_legacy_checkpoints.py
"""
import os
import sys

import jax

jax.config.update("jax_enable_x64", True)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # tests/_support

import problems  # noqa: E402
from difftre_systems import bonded_pair  # noqa: E402
from chemtrain.trainers import ForceMatching, RunOptions  # noqa: E402
from legacy import FM_SETUP, difftre_setup  # noqa: E402


def main():
    data, params, template, nbrs = problems.mlp_problem(n_frames=FM_SETUP["n_frames"])
    tr = ForceMatching(params, problems.adam(), template, nbrs, batch=FM_SETUP["batch"],
                       parallelism="single", checkpoint_path=os.path.join(HERE, "tmp"),
                       seed=FM_SETUP["seed"], options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=FM_SETUP["train_ratio"], val_ratio=FM_SETUP["val_ratio"])
    tr.train(1)
    tr.save_checkpoint(os.path.join(HERE, "force_matching_v1.npz"))

    dt = bonded_pair(**difftre_setup())
    dt.initialize_trajstates()
    dt.train(1)
    dt.save_checkpoint(os.path.join(HERE, "difftre_v1.npz"))


if __name__ == "__main__":
    main()
