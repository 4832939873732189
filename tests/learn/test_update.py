"""chemtrain.learn.update and chemtrain.learn.difftre_batches: the batch's
mean gradient and loss, the decision whether an update may be applied, the
step-size policy's range checks, the state-point batches of an epoch and
the random keys of trajectories (functions of indices only)."""
import jax
import numpy as np
import pytest

from chemtrain.learn.difftre_batches import as_key, statepoint_batches, statepoint_key
from chemtrain.learn.update import StepSizeSearch, batch_loss, failure, mean_gradient


def _summed(loss, grad, overflow=(0, 0)):
    return {"loss": np.asarray(loss, float), "grad": {"w": np.asarray(grad, float)},
            "nbr_overflow": np.asarray(overflow)}


def test_mean_over_the_batch():
    s = _summed([1.0, 3.0], [4.0, -2.0])
    assert batch_loss(s) == 2.0
    np.testing.assert_array_equal(mean_gradient(s)["w"], [2.0, -1.0])


def test_failure_names_the_state_points():
    assert failure(_summed([1.0, 3.0], [1.0]), [4, 5], "update 0") is None
    msg = failure(_summed([1.0, 3.0], [1.0], overflow=(0, 1)), [4, 5], "update 0")
    assert "overflowed on stored snapshots of state point(s) [5] in update 0" in msg
    msg = failure(_summed([np.nan, 3.0], [1.0]), [4, 5], "update 0")
    assert "gradient finite: True" in msg and "non-finite at state point(s) [4]" in msg
    assert "gradient finite: False" in failure(_summed([1.0, 3.0], [np.inf]), [4, 5], "u")


def test_step_size_search_ranges():
    np.testing.assert_allclose(StepSizeSearch(3, 0.5).scales, [1.0, 0.5, 0.25])
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="candidates must be a whole number"):
            StepSizeSearch(bad)
    for bad in (0.0, 1.5, "half"):
        with pytest.raises(ValueError, match=r"allowed_reduction must be a number in \(0, 1\]"):
            StepSizeSearch(10, bad)


def test_batches_use_every_state_point_once():
    assert statepoint_batches(5, 2) == [[0, 1], [2, 3, 4]]
    assert statepoint_batches(3, -1) == [[0, 1, 2]]
    assert statepoint_batches(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="larger than the number of state points"):
        statepoint_batches(2, 3)
    with pytest.raises(ValueError, match="positive integer or -1"):
        statepoint_batches(2, 0)


def test_keys_depend_on_indices_only():
    base = as_key(7)
    np.testing.assert_array_equal(base, jax.random.PRNGKey(7))
    a, b = statepoint_key(base, 2, 5, 1), statepoint_key(base, 2, 5, 1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, statepoint_key(base, 2, 5, 0))
    assert not np.array_equal(a, statepoint_key(base, 2, 6, 1))
    np.testing.assert_array_equal(as_key(jax.random.key(7)), base)
    with pytest.raises(TypeError, match="integer seed or a JAX random key"):
        as_key("seven")


def test_one_finiteness_check_for_host_and_traced_values():
    from chemtrain.learn.diagnose import all_finite
    from chemtrain.learn.update import global_norm
    import jax.numpy as jnp
    # host values in their own precision: 1e39 is finite in float64 (inf in float32)
    assert bool(all_finite({"a": np.array([1e39]), "b": 2.0, "n": np.arange(3)}))
    assert not bool(all_finite((np.array([1.0, np.nan]),)))
    assert bool(all_finite({})) and bool(all_finite(jnp.ones(3)))
    assert not bool(jax.jit(all_finite)({"a": jnp.array([1.0, jnp.inf])}))   # traced
    assert global_norm({"a": np.array([3.0]), "b": np.array([[4.0]])}) == 5.0
