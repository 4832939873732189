"""The committee problem of tests/trainers/test_ensemble.py and its mpirun
script: K pair-MLP members (float64) on 16 frames of a Lennard-Jones fluid."""
import jax
import jax.numpy as jnp
import optax

from chemtrain.models import init_pair_mlp
from problems import lj_fluid, mlp_model

K, BATCH, EPOCHS, SEED = 3, 4, 2, 5
GAMMAS = {"U": 1e-3, "F": 1.0}


def members(k=K):
    """K initial parameter sets of one pair MLP (different keys)."""
    return [init_pair_mlp(jax.random.PRNGKey(10 + i), hidden=(8, 8), n_basis=8,
                          dtype=jnp.float64) for i in range(k)]


def setup():
    """(training set, test set, template, nbrs_init)."""
    data, box, _ = lj_fluid(n_frames=24)
    _, template, nbrs = mlp_model(box, data["R"][0])
    return ({k: v[:16] for k, v in data.items()}, {k: v[16:] for k, v in data.items()},
            template, nbrs)


def committee(problem, folder, bootstrap=False, **kw):
    """An EnsembleOfModels of :func:`members` with the training and
    validation sets set."""
    from chemtrain.trainers import EnsembleOfModels
    from chemtrain.trainers.options import split_options
    train, test, template, nbrs = problem
    tr = EnsembleOfModels(members(), optax.adam(1e-3), template, nbrs, batch=BATCH,
                          gammas=GAMMAS, bootstrap=bootstrap, seed=SEED, checkpoint_path=folder,
                          **split_options(dict(kw, progress=False), keep=("checkpoint_path", "log_file")))
    tr.set_dataset(train, "training")
    tr.set_dataset(test, "validation")
    return tr
