"""Saving and loading converted MACE models as plain data (no torch)."""
from __future__ import annotations

import numpy as np

from chemtrain import checkpoint
from chemtrain.models.mace.model import MaceConfig, zeros_like_shapes
from chemtrain.models.mace.torch_io import UnsupportedModelError, load_mace_torch

KIND = "chemtrain-mace"

__all__ = ["save", "load", "load_mace_torch", "UnsupportedModelError"]


def save(path: str, cfg: MaceConfig, params) -> None:
    """Write the configuration (JSON) and parameters (arrays) to one
    ``.npz`` file (atomic write; read back with :func:`load`)."""
    checkpoint.save(path, {"params": params}, {"kind": KIND, "config": cfg.to_json()})


def load(path: str):
    """Read a model written by :func:`save`: ``(config, params)``."""
    meta, leaves = checkpoint.load(path)
    if meta.get("kind") != KIND:
        raise checkpoint.CheckpointError(f"{path!r} is a chemtrain file but not a MACE model "
                                         f"(kind {meta.get('kind')!r}).")
    cfg = MaceConfig.from_json(meta["config"])
    dtype = leaves["params"][0].dtype if leaves["params"] else np.float32
    template = zeros_like_shapes(cfg, dtype)
    params = checkpoint.unflatten_like(template, leaves["params"], meta["trees"]["params"], "MACE params")
    return cfg, params
