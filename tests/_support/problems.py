"""Small force-matching problems shared by the tests (float64)."""
from __future__ import annotations

import functools

import chemtrain  # noqa: F401  (before jax_md: chemtrain defers jax_md.rigid_body's costly import)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import partition, space

from chemtrain.models import init_pair_mlp, lennard_jones_template, pair_mlp_template

R_CUT = 0.9


@functools.lru_cache(maxsize=None)
def lj_fluid(n_particles=32, n_frames=48, seed=0):
    """Frames of a jax-md Langevin run of an LJ fluid, labelled with LJ."""
    from chemtrain.simulate import lj_fluid_dataset
    data, box, _, params = lj_fluid_dataset(n_particles=n_particles, n_frames=n_frames,
                                            steps_per_frame=10, seed=seed, dtype=jnp.float64)
    return data, box, {k: float(v) for k, v in params.items()}


def neighbor_list(box, R0, fmt=partition.NeighborListFormat.Sparse, r_cut=R_CUT):
    disp, _ = space.periodic(box)
    fn = partition.neighbor_list(disp, box, r_cut, dr_threshold=0.05, capacity_multiplier=1.5,
                                 format=fmt)
    return disp, fn.allocate(jnp.asarray(R0), extra_capacity=8)


def mlp_model(box, R0, seed=1):
    """(init_params, template, nbrs_init) of a small pair MLP."""
    disp, nbrs = neighbor_list(box, R0)
    params = init_pair_mlp(jax.random.PRNGKey(seed), hidden=(8, 8), n_basis=8, dtype=jnp.float64)
    return params, pair_mlp_template(disp, R_CUT, n_basis=8, r_min=0.2), nbrs


def mlp_problem(n_frames=48):
    """(dataset, init_params, template, nbrs_init) for a pair MLP on LJ data."""
    data, box, _ = lj_fluid(n_frames=n_frames)
    return (data, *mlp_model(box, data["R"][0]))


# The fixed training problem that every parallel mode is compared on.
FIXED = dict(batch=4, gammas={"U": 1e-3, "F": 1.0}, train_ratio=20 / 48, val_ratio=0.25,
             epochs=2)  # 20 training structures / batch 4 = 5 steps per epoch: 10 steps


def lj_template_for(box, R0):
    """(init_params, template, nbrs_init) of a Lennard-Jones model."""
    disp, nbrs = neighbor_list(box, R0)
    return ({"sigma": jnp.asarray(0.31), "epsilon": jnp.asarray(1.3)},
            lennard_jones_template(disp, R_CUT), nbrs)


def write_h5(path, data, **attrs):
    """Write a dataset dict as root datasets of an HDF5 file."""
    import h5py
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
        f.attrs.update(attrs)
    return str(path)


def lj_problem():
    data, box, true = lj_fluid()
    disp, nbrs = neighbor_list(box, data["R"][0])
    return data, true, lennard_jones_template(disp, R_CUT), nbrs


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def tree_rel_err(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max(rel_err(x, y) for x, y in zip(la, lb))


def adam():
    return optax.adam(1e-3)
