"""Plain-data checkpoints: numpy arrays and JSON, never pickled code.

A checkpoint is one ``.npz`` file (read with ``allow_pickle=False``) with a
JSON header ``__meta__`` (format name and version, epoch, number of shards,
the key paths of every saved pytree, and any JSON-able extras) and one array
per pytree leaf. Pytree structure comes back from a template the caller
supplies (the trainer's own state), and every leaf is checked against it.
Files are written atomically: temporary file, fsync, rename.
"""
from __future__ import annotations

import io
import json
import os
import tempfile
from typing import Any, Mapping

import numpy as np

FORMAT = "chemtrain-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read into the current run."""


def _leaves_with_paths(tree):
    import jax
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), np.asarray(v)) for p, v in flat]


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def save(path: str, trees: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Save pytrees of arrays (``trees``) and JSON-able ``meta`` to ``path``."""
    arrays, paths = {}, {}
    for name, tree in trees.items():
        if "/" in name:
            raise ValueError(f"tree name {name!r} must not contain '/'.")
        leaves = _leaves_with_paths(tree)
        paths[name] = [p for p, _ in leaves]
        for i, (_, v) in enumerate(leaves):
            if v.dtype == object:
                raise TypeError(f"Leaf {paths[name][i]} of {name!r} is not numeric data.")
            arrays[f"{name}/{i:05d}"] = v
    header = dict(meta, format=FORMAT, format_version=FORMAT_VERSION, trees=paths)
    arrays["__meta__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load(path: str) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """Read a checkpoint: (meta, {tree name: list of leaves}). Runs no code."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"No checkpoint at {path!r}.")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["__meta__"].tobytes().decode())
            files = {k: z[k] for k in z.files if k != "__meta__"}
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path!r} is not a chemtrain checkpoint ({e}).") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a chemtrain checkpoint (format {meta.get('format')!r}).")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path!r} has checkpoint format version {meta.get('format_version')}, "
                              f"this chemtrain reads version {FORMAT_VERSION}.")
    leaves = {name: [files[f"{name}/{i:05d}"] for i in range(len(p))]
              for name, p in meta["trees"].items()}
    return meta, leaves


def unflatten_like(template, leaves: list[np.ndarray], paths: list[str], name: str):
    """Rebuild ``template``'s pytree from saved ``leaves``, checking each one."""
    import jax
    expected = _leaves_with_paths(template)
    if [p for p, _ in expected] != list(paths):
        raise CheckpointError(
            f"The checkpoint's {name} has another structure than this run's "
            f"({len(paths)} leaves vs {len(expected)}); was it written for another "
            f"model or optimizer?")
    for (p, ref), v in zip(expected, leaves):
        if ref.shape != v.shape or ref.dtype != v.dtype:
            raise CheckpointError(f"{name}{p}: checkpoint has {v.dtype}{list(v.shape)}, "
                                  f"this run expects {ref.dtype}{list(ref.shape)}.")
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(treedef, leaves)
