"""Plain-data checkpoints: numpy arrays and JSON, never pickled code.

A checkpoint is one ``.npz`` file (read with ``allow_pickle=False``) with a
JSON header ``__meta__`` (format name and version, the key paths of every
saved pytree, and the caller's JSON-able metadata such as the epoch and the
number of shards) and one array per pytree leaf. Pytree structure comes back
from a template the caller supplies (the trainer's own state), and every leaf
is checked against it.

Damage is detected, not guessed at: since format version 2 the zip archive's
comment (the last bytes of the file) holds the SHA-256 of everything before
it, so a truncated file, an empty one or a single flipped byte anywhere makes
:func:`load` raise :class:`CheckpointError` naming the file. A fallback loop
over several checkpoints can therefore catch ``CheckpointError`` and try the
previous file. A missing file raises :class:`CheckpointNotFoundError`, which
is both a ``FileNotFoundError`` and a ``CheckpointError``: ``except
FileNotFoundError`` sees only missing files, ``except CheckpointError`` sees
every file that cannot be used. Version-1 files (no checksum) are still read.

Files are written atomically: a temporary file ``.<name>.tmp-XXXXXXXX`` in the
same directory (never named ``*.npz``), fsync, rename, fsync of the directory.
Temporary files that a killed write left behind for the same target are
removed at the next save of that target.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import struct
import tempfile
from typing import Any, Mapping

import numpy as np

FORMAT = "chemtrain-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

_SEAL = b"chemtrain-sha256:"
_SEAL_LEN = len(_SEAL) + 64  # prefix and hex digest: the zip comment
_EOCD = b"PK\x05\x06"        # zip end-of-central-directory record (22 bytes + comment)

log = logging.getLogger("chemtrain")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read into the current run (damaged, not a
    checkpoint, or written for another run)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No file at the checkpoint's path."""


def why_not_writable(path: str, folder: bool = True, makes_parents: bool = True) -> str | None:
    """Say why this process could not write ``path``, or return None when it can.

    The probe creates and removes a temporary file in the nearest existing
    folder, which also catches read-only mounts that permission bits do not
    show. Nothing else is created.

    Args:
      path: the folder (or, with ``folder=False``, the file) to be written.
      folder: whether ``path`` is meant as a folder (True) or a file.
      makes_parents: whether folders above ``path`` that do not exist yet
        count as creatable; if False, the folder that would hold ``path``
        must exist.

    Returns:
      None when ``path`` can be written; else the reason, in words meant to
      follow the path in a message (e.g. ``"is a file, not a folder"``,
      ``"lies under the file '...'"``, ``"cannot be written (...)"``).
    """
    target = os.path.abspath(os.fspath(path))
    if os.path.exists(target):
        if folder and not os.path.isdir(target):
            return "is a file, not a folder"
        if not folder and os.path.isdir(target):
            return "is a folder, not a file"
    probe = target if (folder and os.path.isdir(target)) else os.path.dirname(target)
    if not makes_parents and not os.path.isdir(probe):
        return f"is in the folder {probe!r}, which does not exist"
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"lies under the file {probe!r}"
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as e:
        return f"cannot be written ({probe!r}: {e.strerror or e})"
    return None


def _leaves_with_paths(tree):
    import jax
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), np.asarray(v)) for p, v in flat]


# -- atomic writes ------------------------------------------------------------

def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.tmp-"


def _remove_stale_tmp(path: str) -> None:
    """Remove temporary files a killed write of ``path`` left behind."""
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(_tmp_prefix(path)) + r"[A-Za-z0-9_]{8}")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if pattern.fullmatch(name):
            try:
                os.unlink(os.path.join(directory, name))
                log.info("Removed %s, left by an interrupted write of %s", name, path)
            except OSError:
                pass


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a crash leaves the old file or the new one.

    The bytes go to a temporary file ``.<name>.tmp-XXXXXXXX`` in the same
    folder, are fsynced and renamed over ``path``; then the folder is
    fsynced. After a kill such a temporary file may remain; the next write of
    ``path`` removes it. Missing folders above ``path`` are created.

    Args:
      path: the file to write.
      data: its new contents.

    Raises:
      OSError: if the folder cannot be created or the file cannot be
        written or renamed; a temporary file already made is removed.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_stale_tmp(path)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), dir=directory)
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


# -- the checksum in the zip comment ------------------------------------------

def _seal(data: bytes) -> bytes:
    """Put the SHA-256 of the archive into its comment (the file's end)."""
    if data[-22:-18] != _EOCD or data[-2:] != b"\0\0":
        raise RuntimeError("numpy wrote an npz archive without the expected end record.")
    body = data[:-2] + struct.pack("<H", _SEAL_LEN)
    return body + _SEAL + hashlib.sha256(body).hexdigest().encode()


def _verify(data: bytes, path: str) -> bool:
    """True if ``data`` carries a checksum and it matches; raise if it
    carries one that does not; False if it carries none."""
    tail = data[-_SEAL_LEN:]
    if len(data) < _SEAL_LEN + 22 or not tail.startswith(_SEAL):
        return False
    if hashlib.sha256(data[:-_SEAL_LEN]).hexdigest().encode() != tail[len(_SEAL):]:
        raise CheckpointError(f"{path!r} is damaged: its SHA-256 checksum does not match its "
                              f"contents (a changed or corrupted byte). Use an earlier checkpoint.")
    return True


# -- save and load --------------------------------------------------------------

def save(path: str, trees: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Save pytrees of arrays and JSON-able metadata to a checkpoint file.

    The file is an ``.npz`` archive with one array per leaf and the JSON
    header ``__meta__``, sealed with its SHA-256 checksum (format version 2)
    and written with :func:`atomic_write_bytes`.

    Args:
      path: the file to write (by convention ending in ``.npz``).
      trees: ``{name: pytree of numeric arrays}``; names must not contain
        ``'/'``.
      meta: JSON-able metadata (epoch, number of shards, ...). Its keys
        ``format``, ``format_version`` and ``trees`` are replaced by the
        header's own.

    Raises:
      ValueError: if a tree name contains ``'/'``.
      TypeError: if a leaf is not numeric data (an object array), or
        ``meta`` is not JSON-serialisable.
      RuntimeError: if numpy wrote an archive without the expected zip end
        record, so that the checksum cannot be added.
      OSError: if the file cannot be written.
    """
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
    atomic_write_bytes(path, _seal(buf.getvalue()))


def load(path: str) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """Read a checkpoint written by :func:`save`; runs no code (no pickle).

    Version-2 files must carry a matching SHA-256 checksum; version-1 files
    (no checksum) are still read. Use :func:`unflatten_like` to turn a
    tree's leaves back into a pytree.

    Args:
      path: the checkpoint file.

    Returns:
      A tuple ``(meta, leaves)`` of the header as a dict (the caller's
      metadata plus ``format``, ``format_version`` and ``trees``, the leaf
      paths of every tree) and ``{tree name: list of numpy arrays}``, in the
      order of the leaf paths.

    Raises:
      CheckpointNotFoundError: if there is no file at ``path`` (also a
        ``FileNotFoundError``).
      CheckpointError: naming the file, if ``path`` is a folder, empty,
        damaged in any way (checksum mismatch, missing checksum of a
        version-2 file, unreadable archive), of another file format, of an
        unknown format version, has a header without the expected fields,
        or lacks arrays the header lists. Other ``OSError`` exceptions of
        opening the file (such as ``PermissionError``) propagate unchanged.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"No checkpoint at {path!r}.") from e
    except IsADirectoryError as e:
        raise CheckpointError(f"{path!r} is a directory, not a checkpoint file.") from e
    if not data:
        raise CheckpointError(f"{path!r} is empty (0 bytes): an interrupted copy or a full "
                              f"disk? Use an earlier checkpoint.")
    sealed = _verify(data, path)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("a single .npy array, not an .npz archive")
            if "__meta__" not in z.files:
                raise CheckpointError(f"{path!r} is not a chemtrain checkpoint (an .npz file "
                                      f"without the '__meta__' header; it has {z.files[:8]}).")
            meta = json.loads(z["__meta__"].tobytes().decode())
            files = {k: z[k] for k in z.files if k != "__meta__"}
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile, numpy and json raise many kinds
        raise CheckpointError(f"{path!r} is not a chemtrain checkpoint or is damaged "
                              f"({type(e).__name__}: {e}).") from e
    _check_header(meta, path, sealed)
    leaves = {}
    for name, keys in meta["trees"].items():
        wanted = [f"{name}/{i:05d}" for i in range(len(keys))]
        missing = [k for k in wanted if k not in files]
        if missing:
            raise CheckpointError(f"{path!r} is damaged: the header lists {len(keys)} arrays of "
                                  f"{name!r} but {len(missing)} are missing ({missing[:3]}).")
        leaves[name] = [files[k] for k in wanted]
    return meta, leaves


def _check_header(meta, path: str, sealed: bool) -> None:
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path!r}: the checkpoint header is a {type(meta).__name__}, "
                              f"not a JSON object.")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a chemtrain checkpoint "
                              f"(format {meta.get('format')!r}, expected {FORMAT!r}).")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(f"{path!r} has checkpoint format version {version!r}; this "
                              f"chemtrain reads versions {list(READABLE_VERSIONS)}.")
    if version >= 2 and not sealed:
        raise CheckpointError(f"{path!r} is damaged: a version-{version} checkpoint must end "
                              f"with its SHA-256 checksum, and this one does not.")
    trees = meta.get("trees")
    if not (isinstance(trees, dict) and all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(p, str) for p in v)
            for k, v in trees.items())):
        raise CheckpointError(f"{path!r} is damaged: its header lacks a valid 'trees' field "
                              f"(tree name -> list of leaf paths), got {trees!r:.100}.")


def unflatten_like(template, leaves: list[np.ndarray], paths: list[str], name: str):
    """Rebuild ``template``'s pytree from saved ``leaves``, checking each one.

    Args:
      template: a pytree of this run with the expected structure, shapes
        and dtypes (e.g. the trainer's own state).
      leaves: the saved leaves, as :func:`load` returns them for one tree.
      paths: the saved leaf paths (``jax.tree_util.keystr`` of each), from
        the header's ``trees`` entry.
      name: the tree's name in error messages.

    Returns:
      A pytree with ``template``'s structure holding ``leaves``.

    Raises:
      CheckpointError: if ``paths`` differ from ``template``'s leaf paths
        (other leaves, or the same in another order), or a leaf's shape or
        dtype differs from the template's.
    """
    import jax
    expected = _leaves_with_paths(template)
    mine = [p for p, _ in expected]
    if mine != list(paths):
        only_file = [p for p in paths if p not in mine]
        only_run = [p for p in mine if p not in paths]
        def show(ps):
            return ", ".join(ps[:4]) + (f" ... ({len(ps)} in all)" if len(ps) > 4 else "")
        detail = (f"only in the checkpoint: {show(only_file) or 'none'}; only in this run: "
                  f"{show(only_run) or 'none'}" if only_file or only_run else
                  "the same leaves in another order")
        raise CheckpointError(
            f"The checkpoint's {name} has another structure than this run's "
            f"({len(paths)} leaves vs {len(mine)}; {detail}); was it written for another "
            f"model or optimizer, or were parameters renamed?")
    for (p, ref), v in zip(expected, leaves):
        if ref.shape != v.shape or ref.dtype != v.dtype:
            raise CheckpointError(f"{name}{p}: checkpoint has {v.dtype}{list(v.shape)}, "
                                  f"this run expects {ref.dtype}{list(ref.shape)}.")
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(treedef, leaves)


_KINDS = {"error_state": "an error_state written after a failure ({error}); it is for "
                         "diagnosis, not for resuming",
          "trajstates": "a trajectory-state file (save_trajstates): load it with "
                        "trainer.load_trajstates(path), or restore a checkpoint"}


def check_kind(path: str, meta: Mapping[str, Any], allowed) -> None:
    """Refuse a chemtrain file of another kind than ``allowed``, saying what it is.

    Args:
      path: the file, for the message.
      meta: its header (:func:`load`'s first part).
      allowed: the kinds accepted, e.g. ``("checkpoint", "trajstates")``.

    Raises:
      CheckpointError: the file is of another kind (an error state, a
        trajectory-state file, ...).
    """
    kind = meta.get("kind")
    if kind in allowed:
        return
    what = _KINDS.get(kind, "not a file this trainer reads (kind {kind!r})")
    raise CheckpointError(f"{path!r} is " + what.format(error=meta.get("error"), kind=kind)
                               + ".")
