"""DiffTRe on MACE plus a repulsive prior (issue 20): the trainer's gradient
with respect to MACE parameters against central finite differences of the
reweighted loss, float64, 16 atoms. The gradient passes through the
Boltzmann weights (RDF target) and an energy-dependent quantity (the
potential energy). And mpirun -np 2 on two state points equals one
process."""
import json
import os

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax

import mp
from chemtrain.learn import difftre_update as du
from mace_difftre import mace_trainer


def test_mace_gradient_matches_finite_differences(tmp_path):
    with jax.enable_x64(True):
        trainer, params = mace_trainer(str(tmp_path))
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


def test_two_ranks_equal_one_process(tmp_path):
    """mpirun -np 2, two state points (one per rank), 2 epochs of Adam."""
    with jax.enable_x64(True):
        single, start = mace_trainer(str(tmp_path / "single"), kTs=(2.5, 3.0),
                                     sim_batch_size=-1, optimizer=optax.adam(1e-3))
        single.initialize_trajstates()
        single.train(2)
        want = np.asarray(jax.flatten_util.ravel_pytree(single.params)[0])
        assert np.max(np.abs(want - jax.flatten_util.ravel_pytree(start)[0])) > 1e-4
    out = tmp_path / "mpi"
    out.mkdir()
    rc, log, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_mace_difftre.py"), str(out)],
                           timeout=600)
    assert rc == 0, log[-4000:]
    for rank in range(2):
        got = np.array(json.loads((out / f"params_{rank}.json").read_text()))
        assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))
