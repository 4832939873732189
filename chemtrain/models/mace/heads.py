"""Heads of a MACE model: adding one (multi-head fine-tuning) and keeping
one (mace-torch's ``mace_select_head``).

A model of ``H`` heads (:attr:`chemtrain.models.mace.MaceConfig.heads`)
shares every layer; each head has its own E0s, scale, shift and readout
output. The readouts hold all heads in mace-torch's layout (see
:func:`chemtrain.models.mace.param_shapes`): a linear readout's weight has
one column per head; a nonlinear readout's hidden layer has one block of
``K`` features (``K`` = the width of ``mlp_irreps``) per head, and its
``linear_2`` maps block ``k`` to column ``k`` over the fan-in ``H * K``
(e3nn divides by its square root), so moving a block between models of
different head counts rescales it by the square root of the ratio of
fan-ins.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp

from chemtrain.models.mace.model import MaceConfig, irreps

__all__ = ["add_head", "select_head", "default_head", "finetuned_head", "PT_HEAD"]

#: mace-torch's name of the foundation model's head in a replay fine-tuning
PT_HEAD = "pt_head"


def default_head(cfg: MaceConfig, head=None) -> int:
    """The head a calculator evaluates, as mace-torch's ``MACECalculator`` picks it.

    ``head`` given: that head (name or index). Otherwise the only head of a
    model of one, or the head named ``"Default"`` (any case) of a model of
    several: after a replay fine-tuning (heads ``pt_head`` and ``Default``)
    the fine-tuned head, not the foundation's.

    Args:
      cfg: the model configuration.
      head: a head name or index, or None.

    Returns:
      The index into ``cfg.heads``.

    Raises:
      ValueError: an unknown head, or ``head=None`` for a model of several
        heads none of which is named ``"Default"`` (the message names them).
    """
    if head is not None:
        return cfg.head_index(head)
    if cfg.num_heads == 1:
        return 0
    named = [i for i, h in enumerate(cfg.heads) if h.lower() == "default"]
    if not named:
        raise ValueError(f"The MACE model has several heads {list(cfg.heads)} and none is named "
                         f"'Default': say which to evaluate with head=NAME.")
    return named[0]


def finetuned_head(cfg: MaceConfig, head=None) -> int:
    """The head a fine-tuning starts from, as mace-torch's ``--foundation_head``
    picks it: ``head`` when given, else the first head that is not
    :data:`PT_HEAD` (so a model of an earlier replay fine-tuning is
    fine-tuned further from its fine-tuned head, not the foundation's).

    Args:
      cfg: the model configuration.
      head: a head name or index, or None.

    Returns:
      The index into ``cfg.heads``.

    Raises:
      ValueError: an unknown head (the message names the heads there are).
    """
    if head is None:
        head = next((h for h in cfg.heads if h != PT_HEAD), cfg.heads[0])
    return cfg.head_index(head)


def add_head(cfg: MaceConfig, params, name: str, *, e0s=None, copy_from=0):
    """A model with one more head, whose readout starts as a copy of another head's.

    This is how mace-torch's multi-head fine-tuning starts from a foundation
    model: every head's readout output starts as the foundation model's, with
    its scale and shift. The new head is appended (index ``cfg.num_heads``),
    so the existing heads keep their indices. mace-torch orders its heads with
    the foundation model's head, named ``"pt_head"``, first (index 0) and the
    fine-tuning heads after it; for that layout name the foundation model's
    head ``"pt_head"`` first (``dataclasses.replace(cfg, heads=("pt_head",))``)
    and add the new heads with ``copy_from=0``.

    Args:
      cfg: the model configuration.
      params: its parameter pytree (numpy or JAX arrays; the result has the
        same kind and dtype).
      name: the new head's name, not one of ``cfg.heads``.
      e0s: the new head's E0s in eV, a dict from atomic number to energy;
        elements of the model that it leaves out keep the copied head's E0s.
        None: all of the copied head's E0s.
      copy_from: the head (name or index) whose readout output, scale, shift
        and (where ``e0s`` does not say otherwise) E0s the new head starts with.

    Returns:
      The pair ``(cfg, params)`` of the model with ``num_heads + 1`` heads.
      On the existing heads it gives the energies of the original model; the
      new head gives those of ``copy_from`` up to the E0s.

    Raises:
      ValueError: if ``name`` is not a non-empty string or is already a head
        (the message names the heads there are), ``copy_from`` is not a head,
        ``e0s`` holds atomic numbers the model does not know or values that
        are not finite numbers, ``params`` does not fit ``cfg``, or
        ``cfg.mlp_irreps`` is not of one kind (e.g. ``'16x0e'``) while the
        model has a nonlinear readout.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"A head name must be a non-empty string, got {name!r}.")
    if name in cfg.heads:
        raise ValueError(f"The MACE model already has a head {name!r}; its heads are "
                         f"{list(cfg.heads)}. Choose another name.")
    c = cfg.head_index(copy_from)
    _check_params(cfg, params)
    H = cfg.num_heads
    table = cfg.atomic_energies_per_head()
    row = table[c].copy()
    for z, e in _e0s(cfg, e0s).items():
        row[cfg.atomic_numbers.index(z)] = e
    scale, shift = cfg.scale_shift_per_head()
    new = dataclasses.replace(
        cfg, heads=tuple(cfg.heads) + (name,),
        atomic_energies=tuple(tuple(float(x) for x in r) for r in np.vstack([table, row])),
        scale=tuple(float(x) for x in np.append(scale, scale[c])),
        shift=tuple(float(x) for x in np.append(shift, shift[c])))
    K = _block(cfg, new)
    factor = math.sqrt((H + 1) / H)   # linear_2's fan-in grows from H K to (H + 1) K

    def readout(p):
        if "linear" in p:
            return {"linear": [_cat(w, w[:, c:c + 1], axis=1) for w in p["linear"]]}
        linear_2 = []
        for w in p["linear_2"]:
            out = _zeros_like(w, ((H + 1) * K, H + 1))
            out = _set(out, (slice(0, H * K), slice(0, H)), w * factor)
            out = _set(out, (slice(H * K, None), slice(H, H + 1)),
                       w[c * K:(c + 1) * K, c:c + 1] * factor)
            linear_2.append(out)
        return {"linear_1": [_cat(w, w[:, c * K:(c + 1) * K], axis=1) for w in p["linear_1"]],
                "linear_2": linear_2}

    return new, {**params, "readouts": [readout(p) for p in params["readouts"]]}


def select_head(cfg: MaceConfig, params, name):
    """The single-head model of one head (mace-torch's ``mace_select_head``).

    Args:
      cfg: the model configuration.
      params: its parameter pytree (numpy or JAX arrays; the result has the
        same kind and dtype).
      name: the head to keep, a name (or an index) of ``cfg.heads``.

    Returns:
      The pair ``(cfg, params)`` of a model with the one head ``name`` (its
      E0s, scale and shift as a single head's: a flat tuple and numbers),
      which gives the energies of that head of the original model. A model
      of one head is returned as it is.

    Raises:
      ValueError: if ``name`` is not a head of ``cfg`` (the message names the
        heads there are), or ``params`` does not fit ``cfg``.
    """
    h = cfg.head_index(name)
    _check_params(cfg, params)
    H = cfg.num_heads
    if H == 1:
        return cfg, params
    scale, shift = cfg.scale_shift_per_head()
    new = dataclasses.replace(
        cfg, heads=(cfg.heads[h],),
        atomic_energies=tuple(float(x) for x in cfg.atomic_energies_per_head()[h]),
        scale=float(scale[h]), shift=float(shift[h]))
    K = _block(cfg, new)
    factor = 1.0 / math.sqrt(H)       # linear_2's fan-in shrinks from H K to K

    def readout(p):
        if "linear" in p:
            return {"linear": [w[:, h:h + 1] for w in p["linear"]]}
        return {"linear_1": [w[:, h * K:(h + 1) * K] for w in p["linear_1"]],
                "linear_2": [w[h * K:(h + 1) * K, h:h + 1] * factor for w in p["linear_2"]]}

    return new, {**params, "readouts": [readout(p) for p in params["readouts"]]}


# --------------------------------------------------------------------------

def _check_params(cfg: MaceConfig, params) -> None:
    from chemtrain.models.mace.export import _check_shapes
    _check_shapes(cfg, params)


def _block(cfg: MaceConfig, new: MaceConfig) -> int:
    """Hidden features per head of the nonlinear readouts (0 without one);
    refuses mlp_irreps of several kinds when the head count changes."""
    if not any(layer.readout == "nonlinear" for layer in cfg.layers):
        return 0
    blocks = irreps(cfg.mlp_irreps)
    if len(blocks) != 1:
        raise ValueError(f"Cannot change the heads of a model whose 'mlp_irreps' "
                         f"{cfg.mlp_irreps!r} are of several kinds; mace-torch's heads need one "
                         f"kind, such as '16x0e'.")
    return blocks[0].mul


def _e0s(cfg: MaceConfig, e0s) -> dict:
    if e0s is None:
        return {}
    if not isinstance(e0s, dict):
        raise ValueError(f"e0s must be a dict from atomic number to E0 in eV, got "
                         f"{type(e0s).__name__}.")
    out = {}
    for z, e in e0s.items():
        if isinstance(z, bool) or not isinstance(z, (int, np.integer)) or int(z) not in cfg.atomic_numbers:
            raise ValueError(f"e0s holds {z!r}, not an atomic number of the model; it knows "
                             f"{list(cfg.atomic_numbers)}.")
        if isinstance(e, bool) or not isinstance(e, (int, float, np.number)) or not np.isfinite(e):
            raise ValueError(f"e0s[{int(z)}] must be a finite number (eV), got {e!r}.")
        out[int(z)] = float(e)
    return out


def _is_jax(w) -> bool:
    return isinstance(w, jax.Array)


def _cat(a, b, axis):
    return jnp.concatenate([a, b], axis) if _is_jax(a) else np.concatenate([a, b], axis)


def _zeros_like(w, shape):
    return jnp.zeros(shape, w.dtype) if _is_jax(w) else np.zeros(shape, w.dtype)


def _set(a, index, value):
    if _is_jax(a):
        return a.at[index].set(value)
    a[index] = value
    return a
