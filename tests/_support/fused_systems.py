"""Fused training on the bonded molecules of examples/relative_entropy:
force matching on labels of an imperfect bond (r_0 0.37 nm, b 2.0) and
relative entropy on the exact reference (r_0 0.35, b 2.5), one parameter
set. Shared by tests/trainers/test_interleave.py and its mpirun script."""
import os
import sys

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "relative_entropy"))
import cg_bond_and_lj as ex  # noqa: E402

from chemtrain.trainers import ForceMatching, InterleaveTrainers, RunOptions  # noqa: E402
from chemtrain.trainers.options import split_options  # noqa: E402


def labelled_frames(re_trainer, n=32, params=None):
    """Frames of the reference with energies and forces of an imperfect bond."""
    sp = re_trainer.statepoints[0]
    params = params or {"r_0": jnp.asarray(0.37), "b": jnp.asarray(2.0)}
    R = jnp.asarray(ex.exact_bond_frames(n, 11))
    nbrs = sp.neighbor_fn.allocate(R[0], extra_capacity=4)   # room for every frame
    energy = sp.fns.energy_fn_template(params)
    U, F = jax.vmap(jax.value_and_grad(lambda r: -energy(r, neighbor=nbrs.update(r))))(R)
    return {"R": np.asarray(R), "U": -np.asarray(U), "F": np.asarray(F)}, nbrs


def fused(folder, kTs=(2.56,), **options):
    """(InterleaveTrainers, force matching, relative entropy) in ``folder``."""
    re_trainer, _ = ex.bond_trainer(0, updates=4, kTs=kTs, frames=40, production=2.0,
                                    progress=False, checkpoint_path=os.path.join(folder, "re"),
                                    sim_batch_size=-1)
    data, nbrs = labelled_frames(re_trainer)
    fm = ForceMatching({"r_0": jnp.asarray(0.30), "b": jnp.asarray(1.5)}, optax.adam(0.01),
                       re_trainer.statepoints[0].fns.energy_fn_template, nbrs, batch=8,
                       checkpoint_path=os.path.join(folder, "fm"),
                       options=RunOptions(progress=False))
    fm.set_dataset(data, "training")
    together = InterleaveTrainers(os.path.join(folder, "fused"),
                                  **split_options(dict(options, progress=False)))
    together.add_trainer(fm, num_updates=1, name="FM")
    together.add_trainer(re_trainer, num_updates=2, name="RE")
    return together, fm, re_trainer
