"""EMA and reduce-on-plateau as optax transformations, checked against
averages and factors computed by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from chemtrain.learn import optimizers


def test_ema_equals_a_hand_computed_average_over_3_steps():
    p = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
    grads = [{"w": jnp.array([0.5, 1.0]), "b": jnp.array(2.0)},
             {"w": jnp.array([-1.0, 0.25]), "b": jnp.array(-4.0)},
             {"w": jnp.array([2.0, 0.0]), "b": jnp.array(1.0)}]
    opt = optimizers.ema(optax.sgd(0.1), decay=0.9)
    state = opt.init(p)
    for g in grads:
        u, state = opt.update(g, state, p)
        p = optax.apply_updates(p, u)
    # by hand: sgd steps, then a <- a - (1 - d_n)(a - p_n), d_n = min(0.9, (1+n)/(10+n))
    w = [np.array([1.0, -2.0]), np.array([0.95, -2.1]), np.array([1.05, -2.125]),
         np.array([0.85, -2.125])]
    b = [0.5, 0.3, 0.7, 0.6]
    aw, ab = w[0], b[0]
    for n in (1, 2, 3):
        d = min(0.9, (1 + n) / (10 + n))
        aw, ab = aw - (1 - d) * (aw - w[n]), ab - (1 - d) * (ab - b[n])
    avg = optimizers.averaged(state)
    np.testing.assert_allclose(np.asarray(p["w"]), w[3], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(avg["w"]), aw, rtol=1e-6)
    np.testing.assert_allclose(float(avg["b"]), ab, rtol=1e-6)
    assert not np.allclose(np.asarray(avg["w"]), w[3])   # an average, not the last parameters
    # without warm-up: d = 0.9 every step
    opt = optimizers.ema(optax.sgd(0.1), decay=0.9, warmup=False)
    p, state = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}, None
    state = opt.init(p)
    for g in grads:
        u, state = opt.update(g, state, p)
        p = optax.apply_updates(p, u)
    ab = 0.5
    for n in (1, 2, 3):
        ab = ab - 0.1 * (ab - b[n])
    np.testing.assert_allclose(float(optimizers.averaged(state)["b"]), ab, rtol=1e-6)


def test_no_average_without_ema_and_bad_decays_are_refused():
    assert optimizers.averaged(optax.adam(1e-3).init({"w": jnp.ones(2)})) is None
    for bad in (1.0, -0.1, "0.9", float("nan")):
        with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\)"):
            optimizers.ema(optax.sgd(0.1), decay=bad)
    with pytest.raises(ValueError, match="needs the parameters"):
        opt = optimizers.ema(optax.sgd(0.1))
        opt.update({"w": jnp.ones(2)}, opt.init({"w": jnp.ones(2)}))


def test_reduce_on_plateau_follows_torch_rules():
    """Torch's ReduceLROnPlateau (mode min, rel threshold 1e-4, patience 2,
    factor 0.5): the factor drops after the third epoch without improvement,
    and the bad-epoch count restarts."""
    opt = optimizers.reduce_on_plateau(optax.sgd(1.0), factor=0.5, patience=2)
    p = {"w": jnp.array([1.0])}
    state = opt.init(p)
    values = [1.0, 0.5, 0.49999, 0.6, 0.7, 0.4, 0.41, 0.42, 0.43, 0.44, 0.45, 0.46]
    # hand: best 1.0, 0.5; 0.49999 is not 1e-4 better (bad 1); 0.6 (bad 2); 0.7 (bad 3 > 2:
    # scale 0.5, bad 0); 0.4 best; 0.41, 0.42 (bad 2); 0.43 (bad 3: 0.25); 0.44, 0.45 (bad 2);
    # 0.46 (bad 3: 0.125)
    want = [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125]
    got = []
    for v in values:
        state = optimizers.observe(state, v)
        got.append(optimizers.update_scale(state))
    assert got == want
    u, _ = opt.update({"w": jnp.array([2.0])}, state, p)
    assert float(u["w"][0]) == pytest.approx(-2.0 * 0.125)
    assert optimizers.has_plateau(state) and not optimizers.has_plateau(optax.sgd(1.0).init(p))
    with pytest.raises(ValueError, match=r"factor must be in \(0, 1\)"):
        optimizers.reduce_on_plateau(optax.sgd(1.0), factor=1.5)
    with pytest.raises(ValueError, match="patience must be a whole number"):
        optimizers.reduce_on_plateau(optax.sgd(1.0), patience=2.5)


def test_plateau_inside_ema_and_freeze_is_found_and_fed():
    from chemtrain.models import freeze
    p = {"a": jnp.ones(2), "b": jnp.ones(3)}
    opt = optimizers.ema(freeze(optimizers.reduce_on_plateau(optax.sgd(1.0), factor=0.5,
                                                             patience=0), p, ["a"]))
    state = optimizers.observe(optimizers.observe(opt.init(p), 1.0), 2.0)
    assert optimizers.has_plateau(state) and optimizers.update_scale(state) == 0.5
    u, _ = opt.update({"a": jnp.ones(2), "b": jnp.ones(3)}, state, p)
    np.testing.assert_array_equal(np.asarray(u["b"]), [-0.5] * 3)
    np.testing.assert_array_equal(np.asarray(u["a"]), [0.0] * 2)


def test_plateau_of_stacked_members_is_per_member():
    """A committee's vectorised state holds one plateau state per member."""
    from chemtrain.learn.ensemble import vectorized
    opt = vectorized(optimizers.reduce_on_plateau(optax.sgd(1.0), factor=0.5, patience=0))
    state = opt.init({"w": jnp.ones((3, 2))})
    state = optimizers.observe(optimizers.observe(state, 1.0), 2.0)
    scale = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optimizers.PlateauState))
    node = [x for x in scale if isinstance(x, optimizers.PlateauState)][0]
    np.testing.assert_array_equal(np.asarray(node.scale), [0.5, 0.5, 0.5])


def test_reset_plateau_starts_afresh_and_keeps_the_settings():
    opt = optimizers.ema(optimizers.reduce_on_plateau(optax.sgd(1.0), factor=0.5, patience=0))
    state = opt.init({"w": jnp.ones(2)})
    for v in (1.0, 2.0, 3.0):
        state = optimizers.observe(state, v)
    assert optimizers.update_scale(state) == 0.25
    state = optimizers.reset_plateau(jax.tree.map(np.asarray, state))
    assert optimizers.update_scale(state) == 1.0
    state = optimizers.observe(state, 100.0)      # any finite loss is a first best again
    assert optimizers.update_scale(state) == 1.0
    state = optimizers.observe(state, 200.0)
    assert optimizers.update_scale(state) == 0.5  # factor and patience kept
