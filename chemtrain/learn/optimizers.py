"""Optimizer pieces for fine-tuning, as optax transformations whose state
lives in the optimizer state (so checkpoints and ``--restart_latest`` keep
them without further code):

- :func:`ema`: an exponential moving average of the parameters, for
  evaluation and export (mace-torch's ``--ema``);
- :func:`reduce_on_plateau`: a factor on the updates that shrinks when an
  epoch's monitored loss stops improving (mace-torch's default scheduler,
  torch's ``ReduceLROnPlateau``), fed once per epoch by :func:`observe`;
- :func:`averaged` and :func:`update_scale` read them back.

Learning-rate schedules themselves are optax schedules (``optax.adam(
optax.cosine_decay_schedule(...))``); freezing named blocks is
:func:`chemtrain.models.freeze`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


class EmaState(NamedTuple):
    """State of :func:`ema`: the wrapped optimizer's state, the number of
    averaged steps and the averaged parameters."""
    inner: Any
    count: Any
    params: Any


class PlateauState(NamedTuple):
    """State of :func:`reduce_on_plateau`: the current factor on the updates,
    the best monitored value so far, the epochs since it improved, and the
    settings (kept as arrays so that :func:`observe` needs nothing else)."""
    scale: Any
    best: Any
    bad_epochs: Any
    factor: Any
    patience: Any
    threshold: Any
    min_scale: Any


def ema(optimizer: optax.GradientTransformation, decay: float = 0.99,
        warmup: bool = True) -> optax.GradientTransformation:
    """``optimizer`` plus an exponential moving average of the parameters.

    After every step the average ``a`` of the new parameters ``p`` becomes
    ``a - (1 - d) (a - p)``. With ``warmup`` (mace-torch's, torch-ema's
    ``use_num_updates``) the decay of the ``n``-th step is
    ``d = min(decay, (1 + n) / (10 + n))``, so early averages are not
    dominated by the starting parameters; without it ``d = decay``. The
    updates are the wrapped optimizer's, unchanged: training follows the
    raw parameters, and :func:`averaged` gives the average for evaluation
    and export (:class:`~chemtrain.trainers.ForceMatching` uses it for
    validation, predictions and the best model).

    Args:
      optimizer: the optax transformation that trains the parameters.
      decay: in [0, 1); mace-torch's ``--ema_decay`` default is 0.99.
      warmup: start with smaller decays, as mace-torch does.

    Returns:
      An ``optax.GradientTransformation`` whose ``update`` needs ``params``.
    """
    if not (isinstance(decay, (int, float, np.number)) and 0.0 <= float(decay) < 1.0):
        raise ValueError(f"ema: decay must be a number in [0, 1) (the weight of the old "
                         f"average per step, e.g. 0.99), got {decay!r}.")
    decay = float(decay)

    def init(params):
        return EmaState(optimizer.init(params), jnp.zeros([], jnp.int32),
                        jax.tree.map(lambda p: jnp.array(p, copy=True), params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("ema: update needs the parameters (optimizer.update(grads, state, "
                             "params)), as they are averaged.")
        updates, inner = optimizer.update(updates, state.inner, params)
        new = optax.apply_updates(params, updates)
        n = state.count + 1

        def step(a, p):   # the decay in each leaf's precision (float64 leaves: 1 - 0.99999 exact)
            d = jnp.asarray(decay, a.dtype)
            if warmup:
                m = n.astype(a.dtype)
                d = jnp.minimum(d, (1 + m) / (10 + m))
            return a - (1 - d) * (a - p)
        return updates, EmaState(inner, n, jax.tree.map(step, state.params, new))

    return optax.GradientTransformation(init, update)


def reduce_on_plateau(optimizer: optax.GradientTransformation, factor: float = 0.8,
                      patience: int = 50, threshold: float = 1e-4,
                      min_scale: float = 0.0) -> optax.GradientTransformation:
    """``optimizer`` whose updates are scaled by a factor that drops to
    ``factor`` times itself when the monitored loss has not improved for
    more than ``patience`` epochs (torch's ``ReduceLROnPlateau``, mode 'min',
    relative threshold, no cooldown: mace-torch's default scheduler).

    The factor starts at 1 and changes only in :func:`observe`, which a
    trainer calls once per epoch with the epoch's monitored loss (the
    validation loss, else the training loss); an improvement is a value
    below ``best * (1 - threshold)``.

    Args:
      optimizer: the optax transformation whose updates are scaled.
      factor: in (0, 1); mace-torch's ``--lr_factor`` default is 0.8.
      patience: epochs without improvement tolerated (``--scheduler_patience``).
      threshold: relative improvement that counts.
      min_scale: the factor never goes below this.
    """
    if not (0.0 < float(factor) < 1.0):
        raise ValueError(f"reduce_on_plateau: factor must be in (0, 1) (the learning rate is "
                         f"multiplied by it on a plateau), got {factor!r}.")
    if int(patience) != patience or patience < 0:
        raise ValueError(f"reduce_on_plateau: patience must be a whole number of epochs >= 0, "
                         f"got {patience!r}.")
    if not (0.0 <= float(threshold) < 1.0) or not (0.0 <= float(min_scale) <= 1.0):
        raise ValueError(f"reduce_on_plateau: threshold must be in [0, 1) and min_scale in "
                         f"[0, 1], got {threshold!r} and {min_scale!r}.")
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731

    def init(params):
        return (optimizer.init(params),
                # the best so far starts at float32's largest number, not inf: the
                # trainers refuse optimizer states that are not finite
                PlateauState(f32(1.0), f32(np.finfo(np.float32).max), jnp.zeros([], jnp.int32), f32(factor),
                             jnp.asarray(int(patience), jnp.int32), f32(threshold),
                             f32(min_scale)))

    def update(updates, state, params=None):
        inner, plateau = state
        updates, inner = optimizer.update(updates, inner, params)
        updates = jax.tree.map(lambda u: u * plateau.scale.astype(u.dtype), updates)
        return updates, (inner, plateau)

    return optax.GradientTransformation(init, update)


def reset_plateau(opt_state):
    """``opt_state`` with every :func:`reduce_on_plateau` state back at its
    start (factor 1, no best, no bad epochs; its settings kept): for a new
    stage of training whose losses are on another scale. Host values in,
    host values out."""
    def reset(node):
        if isinstance(node, EmaState):
            return node._replace(inner=reset_plateau(node.inner))
        if not isinstance(node, PlateauState):
            return node
        fill = lambda old, v: np.full(np.shape(old), v, np.asarray(old).dtype)  # noqa: E731
        return node._replace(scale=fill(node.scale, 1.0),
                             best=fill(node.best, np.finfo(np.float32).max),
                             bad_epochs=fill(node.bad_epochs, 0))
    return jax.tree.map(reset, opt_state, is_leaf=_is_node)


def _is_node(x):
    return isinstance(x, (EmaState, PlateauState))


def _nodes(opt_state, kind):
    """Every ``kind`` state inside ``opt_state``, also inside an EmaState."""
    out = []
    for x in jax.tree.leaves(opt_state, is_leaf=_is_node):
        if isinstance(x, kind):
            out.append(x)
        if isinstance(x, EmaState):
            out.extend(_nodes(x.inner, kind))
    return out


def averaged(opt_state):
    """The parameters averaged by an :func:`ema` inside an optimizer state.

    Args:
      opt_state: the state of an optax transformation (possibly wrapped).

    Returns:
      The averaged parameters, or None when the optimizer keeps no average.
    """
    found = _nodes(opt_state, EmaState)
    if len(found) > 1:
        raise ValueError("The optimizer state holds more than one ema(): wrap the optimizer "
                         "in ema() once.")
    return found[0].params if found else None


def has_plateau(opt_state) -> bool:
    """Whether an optimizer state holds a :func:`reduce_on_plateau` state.

    Args:
      opt_state: the state of an optax transformation.
    """
    return bool(_nodes(opt_state, PlateauState))


def update_scale(opt_state) -> float:
    """The current factor of a :func:`reduce_on_plateau` on the updates.

    Args:
      opt_state: the state of an optax transformation.

    Returns:
      The factor (its mean over a committee's members), 1.0 without a plateau.
    """
    found = _nodes(opt_state, PlateauState)
    return float(np.mean(np.asarray(found[0].scale))) if found else 1.0


def observe(opt_state, value: float):
    """The optimizer state after an epoch whose monitored loss is ``value``.

    Every :func:`reduce_on_plateau` state inside counts the epoch (a new
    best, or one more epoch without improvement, then a smaller factor). A
    pure function of host or device values; other parts are returned as
    they are.

    Args:
      opt_state: the state of an optax transformation.
      value: the epoch's monitored loss (validation, else training).

    Returns:
      The new state (plateau parts as numpy arrays).
    """
    value = np.float32(value)

    def step(node):
        if isinstance(node, EmaState):
            return node._replace(inner=observe(node.inner, value))
        if not isinstance(node, PlateauState):
            return node
        # elementwise, so that a committee's stacked states (one per member) work too
        a = {k: np.asarray(v) for k, v in node._asdict().items()}
        better = np.isfinite(value) & (value < a["best"] * (1.0 - a["threshold"]))
        best = np.where(better, value, a["best"])
        bad = np.where(better, 0, a["bad_epochs"] + 1)
        drop = bad > a["patience"]
        scale = np.where(drop, np.maximum(a["scale"] * a["factor"], a["min_scale"]), a["scale"])
        bad = np.where(drop, 0, bad)
        return node._replace(scale=scale.astype(a["scale"].dtype), best=best.astype(a["best"].dtype),
                             bad_epochs=bad.astype(a["bad_epochs"].dtype))

    return jax.tree.map(step, opt_state, is_leaf=_is_node)


def after_epoch(opt_state, monitored: float, to_host=lambda x: x, to_device=lambda x: x):
    """What the optimizer pieces take at the end of an epoch: every
    :func:`reduce_on_plateau` inside is fed the epoch's ``monitored`` loss
    (:func:`observe`, on the host copy ``to_host`` gives; ``to_device``
    places the result back). Returns ``(opt_state, record)``: ``record``
    holds the epoch's ``lr_scale`` when there is a plateau, else nothing
    (and ``opt_state`` is returned as it is)."""
    if not has_plateau(opt_state):
        return opt_state, {}
    host = observe(to_host(opt_state), monitored)
    return to_device(host), {"lr_scale": update_scale(host)}
