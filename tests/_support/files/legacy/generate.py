"""Run with the code of main before the reweighting redesign (a worktree of
6bbc7dd): writes checkpoints and trajectory files plus the parameters the
old code reaches when it continues from them."""
import os, sys
root = os.getcwd()
sys.path[:0] = [root, os.path.join(root, "tests", "_support"),
                os.path.join(root, "examples", "relative_entropy")]
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
import chemtrain
assert os.path.dirname(chemtrain.__file__).startswith(root), chemtrain.__file__
from difftre_systems import bonded_pair
import cg_bond_and_lj as ex

out, tmp = sys.argv[1], sys.argv[2]
tr = bonded_pair(2, sim_batch_size=1, checkpoint_path=os.path.join(tmp, "d"))
tr.initialize_trajstates(num_runs=2)
tr.train(2)
tr.save_checkpoint(os.path.join(out, "difftre_checkpoint.npz"))
tr.save_trajstates(os.path.join(out, "difftre_trajstates.npz"))
tr.train(2)
np.savez(os.path.join(out, "difftre_continued.npz"), **{k: np.asarray(v) for k, v in tr.params.items()})

tr, _ = ex.bond_trainer(0, frames=200, production=1.0, progress=False,
                        checkpoint_path=os.path.join(tmp, "r"))
tr.train(2)
tr.save_checkpoint(os.path.join(out, "relentropy_checkpoint.npz"))
tr.train(2)
np.savez(os.path.join(out, "relentropy_continued.npz"), **{k: np.asarray(v) for k, v in tr.params.items()})
print("written", sorted(os.listdir(out)))
