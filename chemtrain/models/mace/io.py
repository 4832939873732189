"""Saving and loading converted MACE models as plain data (no torch).

:func:`load` trusts nothing in the file: the configuration is checked field
by field (types, ranges, one E0 per element, sorted atomic numbers, layers
that chain) and the parameters against the shapes and dtype the
configuration implies, so that a malformed file raises
:class:`chemtrain.checkpoint.CheckpointError` naming the file instead of
giving wrong energies.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from chemtrain import checkpoint
from chemtrain.checkpoint import CheckpointError
from chemtrain.models.mace import model as M
from chemtrain.models.mace.model import MaceConfig
from chemtrain.models.mace.params import param_shapes, zeros_like_shapes
from chemtrain.models.mace.torch_io import UnsupportedModelError, UntrustedFileError, load_mace_torch

KIND = "chemtrain-mace"

__all__ = ["save", "load", "load_mace_torch", "UnsupportedModelError", "UntrustedFileError",
           "config_from_json"]


def save(path: str, cfg: MaceConfig, params) -> None:
    """Write a converted MACE model to one ``.npz`` file.

    The configuration is stored as JSON and the parameters as arrays, written
    atomically with :func:`chemtrain.checkpoint.save`; read it back with
    :func:`load`, which needs neither torch nor mace-torch and runs no code.

    Args:
      path: the file to write (replaced if it exists).
      cfg: the model configuration.
      params: the parameter pytree of ``cfg`` (numpy or JAX arrays).

    Raises:
      TypeError: (from :func:`chemtrain.checkpoint.save`) if a parameter leaf
        is not numeric data.
    """
    checkpoint.save(path, {"params": params}, {"kind": KIND, "config": cfg.to_json()})


def load(path: str):
    """Read a model written by :func:`save`.

    Nothing in the file is trusted: the configuration is checked field by field
    (:func:`config_from_json`) and the parameters against the structure, shapes
    and dtype it implies.

    Args:
      path: the ``.npz`` file.

    Returns:
      The pair ``(config, params)`` of the :class:`MaceConfig` and the
      parameter pytree (numpy arrays, all float32 or all float64).

    Raises:
      chemtrain.checkpoint.CheckpointNotFoundError: when there is no file (a
        ``FileNotFoundError`` and a ``CheckpointError``).
      chemtrain.checkpoint.CheckpointError: naming the file, for any damage or
        inconsistency: not a chemtrain checkpoint, not a MACE model, no
        configuration or parameters, an invalid configuration, parameters of
        mixed or non-float dtypes, parameters that do not fit the
        configuration, or parameters holding NaN or inf.
    """
    meta, leaves = checkpoint.load(path)
    if meta.get("kind") != KIND:
        raise CheckpointError(f"{path!r} is a chemtrain file but not a MACE model "
                              f"(kind {meta.get('kind')!r}, expected {KIND!r}).")
    if "config" not in meta or "params" not in leaves:
        raise CheckpointError(f"{path!r} is a damaged MACE model file: it lacks the "
                              f"{'configuration' if 'config' not in meta else 'parameters'}.")
    try:
        cfg = config_from_json(meta["config"])
    except ValueError as e:
        raise CheckpointError(f"{path!r} holds an invalid MACE configuration: {e}") from e
    return cfg, _params(path, cfg, leaves["params"], meta["trees"]["params"])


def _params(path, cfg, leaves, paths):
    dtypes = sorted({str(v.dtype) for v in leaves})
    if len(dtypes) != 1 or dtypes[0] not in ("float32", "float64"):
        raise CheckpointError(f"{path!r}: MACE parameters must all be float32 or all float64, "
                              f"got dtypes {dtypes}.")
    try:
        template = zeros_like_shapes(cfg, np.dtype(dtypes[0]))
        params = checkpoint.unflatten_like(template, leaves, paths, "MACE params")
    except CheckpointError as e:
        raise CheckpointError(f"{path!r}: the parameters do not fit the configuration stored "
                              f"with them: {e}") from e
    bad = [p for p, v in zip(paths, leaves) if not np.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{path!r}: the MACE parameter(s) {', '.join(bad[:3])} hold NaN "
                              f"or inf.")
    return params


# -- the configuration, checked field by field ----------------------------------

class _Expect(ValueError):
    """What a field must be ("an integer >= 1, got 0")."""


def _int(x, lo=None):
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"an integer, got {x!r}")
    if lo is not None and x < lo:
        raise _Expect(f"an integer >= {lo}, got {x}")
    return x


def _real(x, positive=False):
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise TypeError(f"a finite number, got {x!r}")
    if positive and x <= 0:
        raise _Expect(f"a number > 0, got {x}")
    return float(x)


def _seq(item, length=None, min_length=0):
    def check(x):
        if not isinstance(x, list):
            raise TypeError(f"a list, got {type(x).__name__}")
        if (length is not None and len(x) != length) or len(x) < min_length:
            want = f"{length}" if length is not None else f"at least {min_length}"
            raise _Expect(f"a list of {want} entries, got {len(x)}")
        out = []
        for i, v in enumerate(x):
            try:
                out.append(item(v))
            except (_Expect, TypeError) as e:
                raise type(e)(f"{e} (entry {i})") from None
            except ValueError as e:
                raise ValueError(f"entry {i}: {e}") from None
        return tuple(out)
    return check


def _irreps(x):
    if not isinstance(x, str):
        raise TypeError(f"an irreps string such as '8x0e+8x1o', got {x!r}")
    try:
        M.irreps(x)
    except Exception as e:  # noqa: BLE001 - e3nn raises several kinds
        raise _Expect(f"an irreps string such as '8x0e+8x1o', got {x!r} ({e})") from None
    return x


def _choice(*options):
    def check(x):
        if x not in options or isinstance(x, bool):
            raise _Expect(f"one of {list(options)}, got {x!r}")
        return x
    return check


def _bool(x):
    if not isinstance(x, bool):
        raise TypeError(f"true or false, got {x!r}")
    return x


def _name(x):
    if not isinstance(x, str) or not x:
        raise TypeError(f"a non-empty string (a head name), got {x!r}")
    return x


def _numbers_or_rows(x):
    """A list of numbers (one head) or a list of lists of numbers (per head)."""
    if isinstance(x, list) and x and all(isinstance(v, list) for v in x):
        return _seq(_seq(_real))(x)
    return _seq(_real)(x)


def _number_or_list(x):
    return _seq(_real, min_length=1)(x) if isinstance(x, list) else _real(x)


_LAYER = {"interaction": _choice(*M.INTERACTIONS), "node_irreps": _irreps, "edge_irreps": _irreps,
          "target_irreps": _irreps, "hidden_irreps": _irreps,
          "correlation": lambda x: _int(x, 1), "readout": _choice("linear", "nonlinear")}


def _layer(x):
    if not isinstance(x, dict):
        raise TypeError(f"a layer object, got {type(x).__name__}")
    _same_keys(x, _LAYER, "layer")
    return M.Layer(**{k: _field(k, check, x[k]) for k, check in _LAYER.items()})


_CONFIG = {
    "atomic_numbers": _seq(lambda z: _int(z, 1), min_length=1),
    "r_max": lambda x: _real(x, positive=True),
    "num_bessel": lambda x: _int(x, 1),
    "num_polynomial_cutoff": lambda x: _int(x, 1),
    "max_ell": lambda x: _int(x, 0),
    "avg_num_neighbors": lambda x: _real(x, positive=True),
    "radial_mlp": _seq(lambda w: _int(w, 1)),
    "layers": _seq(_layer, min_length=1),
    "mlp_irreps": _irreps,
    "atomic_energies": _numbers_or_rows,
    "scale": _number_or_list, "shift": _number_or_list, "act_constant": _real,
    "distance_transform": _choice(None, "Agnesi"),
    "agnesi": _seq(_real, length=3),
    "pair_repulsion": _bool,
    "zbl": _seq(_real, length=6),
    "covalent_radii": _seq(_real),
    "heads": _seq(_name, min_length=1),
}


def _same_keys(d, fields, what):
    required = {f.name for f in dataclasses.fields(M.Layer if what == "layer" else MaceConfig)
                if f.default is dataclasses.MISSING}
    missing = sorted(required - set(d))
    unknown = sorted(set(d) - set(fields))
    if missing or unknown:
        raise ValueError(f"the {what} lacks the field(s) {missing} and has unknown field(s) "
                         f"{unknown}" if missing and unknown else
                         f"the {what} lacks the field(s) {missing}" if missing else
                         f"the {what} has unknown field(s) {unknown} (written by a newer chemtrain?)")


def _field(name, check, value):
    try:
        return check(value)
    except (_Expect, TypeError) as e:
        raise ValueError(f"{name!r} must be {e}") from None
    except ValueError as e:
        raise ValueError(f"{name!r}: {e}") from None


def config_from_json(text) -> MaceConfig:
    """A :class:`MaceConfig` from the JSON of :meth:`MaceConfig.to_json`, checked.

    Every field is checked for its type and range (e.g. positive ``r_max``,
    integer widths >= 1, irreps strings e3nn can parse), and the fields
    against each other: distinct atomic numbers 1..118 in increasing order,
    distinct head names, one E0 per element (per head), one scale and shift
    per head for several heads, covalent radii up to the largest atomic number when the
    Agnesi transform or ZBL repulsion is on, scalar node irreps in the first
    layer, layers that chain, and irreps that can be combined.

    Args:
      text: the JSON string.

    Returns:
      The checked :class:`MaceConfig`.

    Raises:
      ValueError: naming the first problem: ``text`` is not a string, not
        valid JSON or not a JSON object, a field is missing, unknown or
        invalid, or the fields are inconsistent.
    """
    if not isinstance(text, str):
        raise ValueError(f"the configuration must be a JSON string, got {type(text).__name__}")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the configuration is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"the configuration must be a JSON object, got {type(d).__name__}")
    _same_keys(d, _CONFIG, "configuration")
    cfg = MaceConfig(**{k: _field(k, check, d[k]) for k, check in _CONFIG.items() if k in d})
    _check_consistent(cfg)
    return cfg


def _check_consistent(cfg: MaceConfig) -> None:
    Z = cfg.atomic_numbers
    if list(Z) != sorted(set(Z)) or max(Z) > 118:
        raise ValueError(f"'atomic_numbers' must be distinct atomic numbers 1..118 in increasing "
                         f"order, got {list(Z)}")
    _check_heads(cfg)
    if (cfg.distance_transform or cfg.pair_repulsion) and len(cfg.covalent_radii) <= max(Z):
        raise ValueError(f"'covalent_radii' (indexed by atomic number) must reach Z={max(Z)}, "
                         f"got {len(cfg.covalent_radii)} entries")
    first = M.irreps(cfg.layers[0].node_irreps)
    if len(first) != 1 or first[0].ir.l != 0 or first[0].ir.p != 1:
        raise ValueError(f"the first layer's 'node_irreps' must be scalars like '16x0e' (the "
                         f"element embedding), got {cfg.layers[0].node_irreps!r}")
    for t in range(1, len(cfg.layers)):
        if M.irreps(cfg.layers[t].node_irreps) != M.irreps(cfg.layers[t - 1].hidden_irreps):
            raise ValueError(f"layer {t} reads node features {cfg.layers[t].node_irreps!r} but "
                             f"layer {t - 1} writes {cfg.layers[t - 1].hidden_irreps!r}")
    if cfg.num_heads > 1 and any(layer.readout == "nonlinear" for layer in cfg.layers) \
            and len(M.irreps(cfg.mlp_irreps)) != 1:
        raise ValueError(f"a model of several heads needs 'mlp_irreps' of one kind such as "
                         f"'16x0e', got {cfg.mlp_irreps!r}")
    try:
        param_shapes(cfg)
    except Exception as e:  # noqa: BLE001 - irreps that cannot be combined
        raise ValueError(f"the layers' irreps cannot be combined ({type(e).__name__}: {e})") from None


def _check_heads(cfg: MaceConfig) -> None:
    """Distinct head names, and E0s, scale and shift laid out for them: flat
    E0s and numbers for one head, one row and one entry per head for several."""
    heads, Z, e0 = list(cfg.heads), list(cfg.atomic_numbers), cfg.atomic_energies
    if len(set(heads)) != len(heads):
        raise ValueError(f"'heads' must be distinct names, got {heads}")
    rows = all(isinstance(v, tuple) for v in e0) and len(e0) > 0
    if len(heads) == 1:
        if rows:
            raise ValueError(f"'atomic_energies' of a model of one head {heads} must be a list of "
                             f"one E0 per element, got a list of {len(e0)} lists")
        if len(e0) != len(Z):
            raise ValueError(f"'atomic_energies' must hold one E0 per element: {len(Z)} for the "
                             f"atomic numbers {Z}, got {len(e0)}")
        for key in ("scale", "shift"):
            if isinstance(getattr(cfg, key), tuple):
                raise ValueError(f"{key!r} of a model of one head {heads} must be a number, "
                                 f"got a list")
        return
    if not rows or len(e0) != len(heads) or any(len(row) != len(Z) for row in e0):
        raise ValueError(f"'atomic_energies' of a model of {len(heads)} heads {heads} must be "
                         f"{len(heads)} lists (one per head) of one E0 per element ({len(Z)} for "
                         f"the atomic numbers {Z})")
    for key in ("scale", "shift"):
        value = getattr(cfg, key)
        if not isinstance(value, tuple) or len(value) != len(heads):
            raise ValueError(f"{key!r} of a model of {len(heads)} heads {heads} must be a list of "
                             f"{len(heads)} numbers (one per head), got {value!r}")
