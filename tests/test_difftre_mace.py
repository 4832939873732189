"""DiffTRe on MACE plus a repulsive prior (issue 20): the trainer's gradient
with respect to MACE parameters against central finite differences of the
reweighted loss, float64, 16 atoms. The gradient passes through the
Boltzmann weights (RDF target) and an energy-dependent quantity (the
potential energy)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_md import simulate, space

from chemtrain import quantity
from chemtrain.finetune.model import random_config
from chemtrain.learn import difftre_update as du
from chemtrain.models import mace as cm
from chemtrain.models import repulsive_template, sum_templates
from chemtrain.neighbors import neighbor_list
from chemtrain.simulate import process_printouts
from chemtrain.trainers import DifftreParallel

BOX, R_MAX = 1.0, 0.4   # nm


def spread_positions(n, min_distance, seed=0):
    """``n`` random positions in the periodic box, none closer than
    ``min_distance`` (rejection sampling)."""
    rng, out = np.random.default_rng(seed), []
    while len(out) < n:
        r = rng.random(3) * BOX
        d = np.array(out) - r if out else np.zeros((0, 3))
        d -= BOX * np.round(d / BOX)
        if not len(out) or np.min(np.linalg.norm(d, axis=1)) >= min_distance:
            out.append(r)
    return np.array(out)


def test_mace_gradient_matches_finite_differences(tmp_path):
    with jax.enable_x64(True):
        displacement, shift = space.periodic(BOX)
        cfg = random_config((8,), avg_num_neighbors=6.0, scale=0.05, num_channels=4, max_L=0,
                            max_ell=1, correlation=2, r_max=10 * R_MAX, num_interactions=1,
                            radial_MLP=(8,))
        template = sum_templates({"prior": repulsive_template(displacement, R_MAX, 0.35),
                                  "mace": cm.energy_fn_template(cfg, displacement)})
        params = {"prior": {"sigma": jnp.asarray(0.3), "epsilon": jnp.asarray(1.0)},
                  "mace": cm.init_params(cfg, jax.random.PRNGKey(0), jnp.float64)}
        R0 = spread_positions(16, 0.28)
        rdf_bins = quantity.rdf_discretization(R_MAX, 20, 0.1)
        n_kT = 2.5
        trainer = DifftreParallel(
            0, params, optax.sgd(1e-3), template,
            functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.002, kT=n_kT,
                              gamma=5.0),
            neighbor_list(displacement, BOX, R_MAX, dr_threshold=0.02, capacity_multiplier=2.0),
            process_printouts(0.002, 0.6, 0.2, 0.02),
            {"kT": np.array([n_kT]), "mass": np.array([18.0]),
             "species": np.full((1, 16), 8)},
            {"rdf": quantity.rdf(displacement, rdf_bins, box=BOX),
             "energy": quantity.potential_energy()},
            {"rdf": {"target": np.ones((1, 20)), "gamma": 1.0},
             "energy": {"target": np.array([-5.0]), "gamma": 0.01}},
            reference_states=R0[None], progress=False, checkpoint_path=str(tmp_path))
        trainer.initialize_trajstates()
        sp, trajs = trainer.statepoints[0], trainer.trajstates[0]
        # move away from the generating parameters: the weights must matter
        leaves, treedef = jax.tree.flatten(params)
        noise = jax.tree.unflatten(treedef, [0.05 * jax.random.normal(jax.random.PRNGKey(i),
                                                                      jnp.shape(x))
                                             for i, x in enumerate(leaves)])
        theta = jax.tree.map(jnp.add, params, noise)
        (_, aux), grad = du.loss_and_grad(sp, theta, trajs)
        n = sp.n_snapshots
        assert float(aux["n_eff"]) < 0.999 * n

        def loss(p):
            return float(du.loss_and_grad(sp, p, trajs)[0][0])
        flat, unravel = jax.flatten_util.ravel_pytree(theta)
        g = jax.flatten_util.ravel_pytree(grad)[0]
        mace_part = jax.flatten_util.ravel_pytree(theta["mace"])[0].size
        # the largest MACE gradient entries (the prior comes first in the flat vector)
        offset = jax.flatten_util.ravel_pytree(theta["prior"])[0].size
        picks = offset + np.argsort(-np.abs(np.asarray(g[offset:offset + mace_part])))[:4]
        assert abs(float(g[picks[-1]])) > 1e-6   # four parameters that matter
        for i in picks:
            h = 1e-5 * max(1.0, abs(float(flat[i])))
            e = jnp.zeros_like(flat).at[i].set(h)
            fd = (loss(unravel(flat + e)) - loss(unravel(flat - e))) / (2 * h)
            assert abs(fd - float(g[i])) <= 1e-3 * abs(float(g[i])), (int(i), fd, float(g[i]))
