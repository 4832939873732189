"""Bad input gets a clear error; failed steps keep the last good state.
(Checkpoints from elsewhere are tested in test_checkpoint.py.)"""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from builders import build
from chemtrain.checkpoint import CheckpointError
from chemtrain.trainers import ForceMatching, TrainingError, RunOptions
from problems import adam, mlp_problem


def test_batch_not_divisible_by_devices(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    with pytest.raises(ValueError, match=r"batch=6 is not divisible by the number of shards \(4"):
        build(tmp_path, batch=6, parallelism="jax", mesh=mesh)


def test_batch_per_device_is_deprecated(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.warns(DeprecationWarning, match="batch=6"):
        tr, _ = build(tmp_path, batch=None, batch_per_device=3, parallelism="jax", mesh=mesh)
    assert tr.batch == 6


def test_disable_shmap_points_to_jax(tmp_path):
    with pytest.raises(ValueError, match="parallelism='jax'"):
        build(tmp_path, disable_shmap=True)


def test_unknown_parallelism(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown parallelism 'pmap'.*'auto', 'single', 'jax', 'mpi'"):
        build(tmp_path, parallelism="pmap")


def test_mesh_must_be_1d_with_data_axis(tmp_path):
    two_d = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="1-D with the single axis name 'data'"):
        build(tmp_path, parallelism="jax", mesh=two_d)
    other = Mesh(np.array(jax.devices()[:2]), ("batch",))
    with pytest.raises(ValueError, match=r"got axes \('batch',\)"):
        build(tmp_path, parallelism="jax", mesh=other)


def test_unequal_lengths(tmp_path):
    tr, data = build(tmp_path)
    bad = dict(data, U=data["U"][:-1])
    with pytest.raises(ValueError, match=r"same length.*'U': 47"):
        tr.set_datasets(bad)


@pytest.mark.parametrize("key", ["R", "F", "U"])
def test_missing_key(tmp_path, key):
    tr, data = build(tmp_path)
    bad = {k: v for k, v in data.items() if k != key}
    with pytest.raises(ValueError, match=f"lacks the key\\(s\\) \\['{key}'\\]"):
        tr.set_datasets(bad)


def test_missing_target_is_fine_when_not_trained(tmp_path):
    """Data without energies train a forces-only loss: one finite epoch,
    reported for F alone."""
    tr, data = build(tmp_path, gammas={"F": 1.0})
    tr.set_datasets({k: v for k, v in data.items() if k != "U"}, train_ratio=0.5)
    tr.train(1)
    (record,) = tr.history
    assert tr.epoch == 1 and record["train_parts"].keys() == {"F"}
    assert np.isfinite(record["train_loss"]) and record["train_loss"] > 0
    assert set(tr.evaluate("validation")) == {"F", "loss", "n_structures"}


@pytest.mark.parametrize("key", ["R", "U", "F"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_inputs(tmp_path, key, value):
    tr, data = build(tmp_path)
    bad = {k: np.array(v) for k, v in data.items()}
    bad[key].reshape(bad[key].shape[0], -1)[5, 0] = value
    with pytest.raises(ValueError, match=rf"\['{key}'\] holds 1 NaN or inf value\(s\), in structure\(s\) \[5\]"):
        tr.set_datasets(bad)


def test_training_set_smaller_than_batch(tmp_path):
    tr, data = build(tmp_path, batch=40)
    with pytest.raises(ValueError, match="fewer than batch=40"):
        tr.set_datasets(data, train_ratio=0.5)


def test_unknown_stage(tmp_path):
    tr, data = build(tmp_path)
    with pytest.raises(ValueError, match="stage must be one of"):
        tr.set_dataset(data, "train")
    with pytest.raises(ValueError, match="No validation data"):
        tr.evaluate("validation")


def test_neighbor_overflow_stops_with_last_good_state(tmp_path):
    data, params, template, nbrs = mlp_problem()
    # a neighbor list with room for 10 edges overflows on every fluid frame
    small = nbrs.set(idx=nbrs.idx[:, :10], max_occupancy=10)
    tr = ForceMatching(params, adam(), template, small, batch=4,
                       parallelism="single", checkpoint_path=str(tmp_path),
                       options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=0.5)
    with pytest.raises(TrainingError, match="neighbor list overflowed"):
        tr.train(1)
    assert tr.step == 0 and tr.epoch == 0
    for a, b in zip(jax.tree.leaves(tr.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    error_file = tmp_path / "error_state.npz"
    assert error_file.exists()
    with pytest.raises(CheckpointError, match="for diagnosis, not for resuming"):
        tr.restore(str(error_file))


def test_non_finite_loss_mid_epoch_keeps_applied_steps(tmp_path):
    """A loss that turns NaN after some good steps stops training; the steps
    before it stay applied and are counted."""
    data, params, template, nbrs = mlp_problem()

    def poisoned(p):
        energy = template(p)
        # NaN energy whenever the first bias has moved far from its start
        bad = jnp.abs(p["layers"][0]["b"][0] - params["layers"][0]["b"][0]) > 5e-3
        return lambda R, neighbor, **kw: jnp.where(bad, jnp.nan, energy(R, neighbor, **kw))

    tr = ForceMatching(params, optax.sgd(1e-3), poisoned, nbrs, batch=4, parallelism="single",
                       checkpoint_path=str(tmp_path), options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0)
    with pytest.raises(TrainingError, match="The loss is nan") as info:
        tr.train(5)
    import re
    index, epoch = map(int, re.search(r"in step (\d+) of epoch (\d+)", str(info.value)).groups())
    steps_per_epoch = 48 // 4
    # the failed step and the one after it (same parameters, also NaN) were not applied
    assert tr.step == epoch * steps_per_epoch + index > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tr.params))
    assert not np.array_equal(tr.params["layers"][0]["b"], params["layers"][0]["b"])
    assert (tmp_path / "error_state.npz").exists()


def test_jax_md_energy_with_nan_parameter_gradient_is_named(tmp_path):
    """jax-md's own neighbor-list LJ gives NaN parameter gradients on a list
    with padding: the step is not applied, and the error says why."""
    from jax_md import energy
    from problems import lj_fluid, neighbor_list
    data, box, _ = lj_fluid(n_frames=8)
    disp, nbrs = neighbor_list(box, data["R"][0], r_cut=0.5)   # a list with padding

    def template(p):
        return energy.lennard_jones_neighbor_list(disp, box, sigma=p["sigma"],
                                                  epsilon=p["epsilon"], r_cutoff=0.5)[1]
    params = {"sigma": jnp.asarray(0.33), "epsilon": jnp.asarray(1.0)}
    tr = ForceMatching(params, optax.sgd(1e-6), template, nbrs, batch=4, parallelism="single",
                       checkpoint_path=str(tmp_path), options=RunOptions(progress=False))
    tr.set_datasets(data, train_ratio=1.0, val_ratio=0.0)
    with pytest.raises(TrainingError, match=r"gradient finite: False.*Likely cause: The energy's "
                                            r"gradient .* NaN on a neighbor list with padding.*"
                                            r"lennard_jones_template"):
        tr.train(1)
    assert tr.step == 0 and float(tr.params["sigma"]) == 0.33


def test_import_is_light():
    code = ("import sys, chemtrain, chemtrain.trainers, chemtrain.parallel\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized(), 'backend initialised'\n"
            "assert 'mpi4py' not in sys.modules and 'mpi4jax' not in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
