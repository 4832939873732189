"""DiffTRe on MACE plus a repulsive prior (issue 20): the trainer's gradient
with respect to MACE parameters against central finite differences of the
reweighted loss, float64, 16 atoms. The gradient passes through the
Boltzmann weights (RDF target) and an energy-dependent quantity (the
potential energy). And mpirun -np 2 on two state points equals one
process."""
import dataclasses
import json
import os

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mp
from chemtrain.learn.difftre_objective import loss_and_grad
from mace_difftre import mace_model, mace_trainer, rdf


@pytest.mark.parametrize("family", ["mace", "nequip"])
def test_mace_gradient_matches_finite_differences(tmp_path, family):
    """MACE, and NequIP (issue 49): DiffTRe takes either template."""
    with jax.enable_x64(True):
        trainer, params = mace_trainer(str(tmp_path), family=family)
        trainer.initialize_trajstates()
        sp, trajs = trainer.statepoints[0], trainer.trajstates[0]
        # move away from the generating parameters: the weights must matter
        leaves, treedef = jax.tree.flatten(params)
        noise = jax.tree.unflatten(treedef, [0.05 * jax.random.normal(jax.random.PRNGKey(i),
                                                                      jnp.shape(x))
                                             for i, x in enumerate(leaves)])
        theta = jax.tree.map(jnp.add, params, noise)
        (_, aux), grad = loss_and_grad(sp, theta, trajs)
        n = sp.n_snapshots
        assert float(aux["n_eff"]) < 0.999 * n

        def loss(p):
            return float(loss_and_grad(sp, p, trajs)[0][0])
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


def test_model_inputs_the_simulation_lacks_are_named(tmp_path):
    """MACE's own input check runs on each state point when it is declared:
    an element the model does not know, or no species at all, is refused
    before any simulation, naming the state point and where species go."""
    import pytest
    from chemtrain.models.mace import UnknownElementError
    with jax.enable_x64(True):
        with pytest.raises(UnknownElementError, match=r"State point 0: .*1 \(H\).*built for "
                                                      r"\[8\].*state_kwargs, one row"):
            mace_trainer(str(tmp_path / "h"), species=1)
        with pytest.raises(ValueError, match=r"State point 0: The MACE model needs per-atom "
                                             r"atomic numbers.*come in state_kwargs"):
            mace_trainer(str(tmp_path / "none"), species=None)


def test_float32_gradient_equals_float64_on_the_same_snapshots(tmp_path):
    """The trainer in float32 (jax_enable_x64 off): its DiffTRe gradient on
    its own trajectory equals the float64 gradient on the same snapshots
    within 1e-3 relative, and an update keeps float32 parameters."""
    def floats(tree, dtype):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(
            jnp.result_type(x), jnp.floating) else x, tree)
    with jax.enable_x64(False):
        tr32, p32 = mace_trainer(str(tmp_path / "f32"), dtype=jnp.float32,
                                 optimizer=optax.adam(1e-3))
        tr32.initialize_trajstates()
        trajs = tr32.trajstates[0]
        theta = jax.tree.map(lambda x: x * 1.02, p32)    # off the trajectory's parameters
        (_, aux32), g32 = loss_and_grad(tr32.statepoints[0], theta, trajs)
        assert float(aux32["n_eff"]) < 0.999 * tr32.statepoints[0].n_snapshots
        g32 = np.asarray(jax.flatten_util.ravel_pytree(g32)[0])
        tr32.train(1)
        assert {x.dtype for x in jax.tree.leaves(tr32.params)} == {jnp.dtype("float32")}
        assert np.all(np.isfinite(jax.flatten_util.ravel_pytree(tr32.params)[0]))
    with jax.enable_x64(True):
        tr64, _ = mace_trainer(str(tmp_path / "f64"))
        _, g64 = loss_and_grad(tr64.statepoints[0], floats(theta, jnp.float64),
                                  floats(trajs, jnp.float64))
        g64 = np.asarray(jax.flatten_util.ravel_pytree(g64)[0])
    assert g32.dtype == np.float32 and g64.dtype == np.float64
    assert np.linalg.norm(g32 - g64) <= 1e-3 * np.linalg.norm(g64), (
        np.linalg.norm(g32 - g64) / np.linalg.norm(g64))


def test_batched_energies_give_the_vmapped_gradient(tmp_path):
    """With no potential-dependent quantity (an RDF target), the energies
    and the two-pass gradient evaluate each chunk of snapshots through the
    template's batched energies (MACE on one disjoint graph; the prior
    vmapped): loss, N_eff and gradient equal those of the direct gradient of
    a template without batched energies (a vmap of one snapshot's energy),
    with a padded last chunk."""
    from chemtrain.learn import reweighting as dt
    from chemtrain.learn.difftre_grad import make_value_and_grad
    from chemtrain.learn.difftre_objective import chains_of, energies_of
    with jax.enable_x64(True):
        trainer, params = mace_trainer(str(tmp_path))
        trainer.initialize_trajstates()
        sp, trajs = trainer.statepoints[0], trainer.trajstates[0]
        template, _ = mace_model()
        assert template.batched is not None
        quantities = {"rdf": rdf()}
        targets = {"rdf": {"gamma": 1.0}}
        chains, U_ref = chains_of(trajs), energies_of(trajs)
        kwargs = sp.state_kwargs
        _, fixed, _ = dt.make_snapshot_evaluator(None, quantities)(params, chains, kwargs)
        leaves, treedef = jax.tree.flatten(params)
        theta = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(jax.random.PRNGKey(i),
                                                                          jnp.shape(x))
                                             for i, x in enumerate(leaves)])
        values = {"rdf": jnp.ones_like(fixed["rdf"][0])}
        args = (theta, chains, U_ref, values, kwargs, fixed)
        kw = dict(vmap_batch=7, fixed=("rdf",))
        vmapped = dataclasses.replace(template, batched=None)   # one snapshot at a time
        (a, aux_a), ga = jax.jit(jax.value_and_grad(
            dt.make_statepoint_loss(vmapped, quantities, targets, **kw), has_aux=True))(*args)
        (b, aux_b), gb = jax.jit(make_value_and_grad(template, quantities, targets, **kw))(*args)
        assert sp.n_snapshots % 7 and float(aux_a["n_eff"]) < 0.999 * sp.n_snapshots
        assert float(a) == pytest.approx(float(b), rel=1e-12)
        assert float(aux_a["n_eff"]) == pytest.approx(float(aux_b["n_eff"]), rel=1e-12)
        ga, gb = (np.asarray(jax.flatten_util.ravel_pytree(g)[0]) for g in (ga, gb))
        assert np.max(np.abs(ga)) > 0
        np.testing.assert_allclose(gb, ga, rtol=0, atol=1e-9 * np.max(np.abs(ga)))
