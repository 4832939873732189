"""A NequIP model as one plain-data ``.npz`` file (no pickle): the
configuration as JSON, the parameters as arrays, written atomically by
:func:`chemtrain.checkpoint.save` (the format of MACE's files, kind
``'chemtrain-nequip'``)."""
from __future__ import annotations

import jax
import numpy as np

from chemtrain import checkpoint
from chemtrain.checkpoint import CheckpointError
from chemtrain.models.nequip.model import NequipConfig, param_shapes

KIND = "chemtrain-nequip"


def save(path: str, cfg: NequipConfig, params) -> None:
    """Write a NequIP model (``cfg`` and ``params``) to ``path``; read it back
    with :func:`load`, which runs no code from the file.

    Args:
      path: the ``.npz`` file (replaced if it exists).
      cfg: the architecture.
      params: its parameters (numpy or JAX arrays).
    """
    checkpoint.save(path, {"params": params}, {"kind": KIND, "config": cfg.to_json()})


def load(path: str):
    """Read a model written by :func:`save`: ``(NequipConfig, params)``.

    The configuration is rebuilt field by field and the parameters are
    checked against the shapes it implies, one dtype, finite values.

    Args:
      path: the ``.npz`` file.

    Raises:
      chemtrain.checkpoint.CheckpointError: naming the file, when it is not a
        NequIP model, its configuration is invalid, or its parameters do not
        fit it (a missing file: ``CheckpointNotFoundError``).
    """
    meta, leaves = checkpoint.load(path)
    if meta.get("kind") != KIND:
        raise CheckpointError(f"{path!r} is a chemtrain file but not a NequIP model "
                              f"(kind {meta.get('kind')!r}, expected {KIND!r}).")
    if "config" not in meta or "params" not in leaves:
        raise CheckpointError(f"{path!r} is a damaged NequIP model file: it lacks the "
                              f"{'configuration' if 'config' not in meta else 'parameters'}.")
    try:
        cfg = NequipConfig.from_json(meta["config"])
        shapes = param_shapes(cfg)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path!r} holds an invalid NequIP configuration: {e!r}") from e
    values, paths = leaves["params"], meta["trees"]["params"]
    dtypes = sorted({str(v.dtype) for v in values})
    if len(dtypes) != 1 or dtypes[0] not in ("float32", "float64"):
        raise CheckpointError(f"{path!r}: NequIP parameters must all be float32 or all float64, "
                              f"got dtypes {dtypes}.")
    is_shape = lambda s: isinstance(s, tuple) and all(isinstance(i, int) for i in s)  # noqa: E731
    zeros = jax.tree.map(lambda s: np.zeros(s, dtypes[0]), shapes, is_leaf=is_shape)
    try:
        params = checkpoint.unflatten_like(zeros, values, paths, "NequIP params")
    except CheckpointError as e:
        raise CheckpointError(f"{path!r}: the parameters do not fit the configuration stored "
                              f"with them: {e}") from e
    bad = [p for p, v in zip(paths, values) if not np.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{path!r}: the NequIP parameter(s) {', '.join(bad[:3])} hold NaN "
                              f"or inf.")
    return cfg, params
