"""JAX's persistent compilation cache, on by default for chemtrain's jobs.

JAX can write every compiled program to a folder and read it back in the
next process that compiles the same program (keyed as JAX keys it: the
program, its shapes and options, the JAX and jaxlib versions, the device).
A second fine-tuning of the same model sizes, a committee, a scan over
hyper-parameters or the rounds of an active-learning loop then skip most of
what their first epoch would spend compiling.

:func:`enable` turns it on; ``chemtrain-finetune`` and the trainers
(:class:`~chemtrain.trainers.ForceMatching`, its committee, the reweighting
trainers) call it when they are built. The folder is:

- ``$CHEMTRAIN_JAX_CACHE`` when set (not empty); ``off`` (or ``0``,
  ``none``, ``false``, ``no``) turns the cache off;
- else ``$XDG_CACHE_HOME/chemtrain/jax``, i.e. ``~/.cache/chemtrain/jax``.

It holds at most ``$CHEMTRAIN_JAX_CACHE_MAX_GB`` gigabytes (default 2): JAX
removes the least recently used programs beyond that, and reads and writes
under a file lock, so MPI ranks and concurrent jobs may share it. Delete the
folder (or call :func:`clear`) at any time; nothing else is kept there.

A cache folder the user set for JAX (``jax.config.update(
"jax_compilation_cache_dir", ...)`` or ``JAX_COMPILATION_CACHE_DIR``) is
left as it is, and so is a process where the cache is on already.
"""
from __future__ import annotations

import logging
import os
import shutil

log = logging.getLogger("chemtrain")

__all__ = ["enable", "default_folder", "clear", "ENV", "MAX_GB_ENV"]

#: the environment variable naming the folder (``off`` turns the cache off)
ENV = "CHEMTRAIN_JAX_CACHE"
#: the environment variable bounding its size, in gigabytes
MAX_GB_ENV = "CHEMTRAIN_JAX_CACHE_MAX_GB"
_OFF = ("off", "0", "none", "false", "no")
#: programs that compile faster than this are not written (JAX's default: 1 s).
#: 0: every program. On the main job all 35 programs take 10 s of XLA compilation;
#: JAX's default caches 5 of them (2.4 s left to compile), 0 caches all (0.6 s)
MIN_COMPILE_SECONDS = 0.0
_UNWRITABLE: set = set()   # folders this process could not write


def default_folder() -> str | None:
    """The cache folder :func:`enable` uses without an argument: the value
    of ``$CHEMTRAIN_JAX_CACHE`` (None when it turns the cache off), else
    ``$XDG_CACHE_HOME/chemtrain/jax`` (``~/.cache/chemtrain/jax``).

    Returns:
      The folder's path, or None when the cache is turned off.
    """
    given = os.environ.get(ENV, "").strip()
    if given:
        return None if given.lower() in _OFF else given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "chemtrain", "jax")


def _max_bytes() -> int:
    text = os.environ.get(MAX_GB_ENV, "2")
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise ValueError(f"${MAX_GB_ENV} must be a size in gigabytes above 0, got {text!r}; "
                         f"turn the cache off with {ENV}=off instead.")
    return int(gb * 1024 ** 3)


def enable(folder: str | None = None) -> str | None:
    """Turn JAX's persistent compilation cache on in ``folder``.

    Nothing changes when JAX already has a cache folder (the user's, or an
    earlier call's) or the cache is turned off (``folder`` or
    ``$CHEMTRAIN_JAX_CACHE`` ``'off'``). A folder that cannot be created or
    written is reported with a warning and the run goes on without a cache.

    Args:
      folder: the cache folder; None: :func:`default_folder`.

    Returns:
      The folder in use (the one already configured, or ``folder``), or None
      when no cache is used.

    Raises:
      ValueError: ``$CHEMTRAIN_JAX_CACHE_MAX_GB`` is not a size above 0.
    """
    import jax
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if folder is not None and str(folder).strip().lower() in _OFF:
        return None
    folder = default_folder() if folder is None else str(folder)
    if folder is None:
        return None
    max_bytes = _max_bytes()
    if folder in _UNWRITABLE:   # reported once per process, not at every trainer
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".chemtrain-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        _UNWRITABLE.add(folder)
        log.warning("JAX's compilation cache stays off: %s cannot be written (%s). Set %s to a "
                    "writable folder, or %s=off to silence this.", folder, e, ENV, ENV)
        return None
    from jax.experimental.compilation_cache import compilation_cache
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_dir", folder)
    # a process that compiled before has decided the cache is off: ask again
    compilation_cache.reset_cache()
    return folder


def clear(folder: str | None = None) -> None:
    """Delete the cache folder (:func:`default_folder` by default) and
    everything in it; a folder that does not exist is fine.

    Args:
      folder: the folder to delete.
    """
    folder = default_folder() if folder is None else folder
    if folder and os.path.isdir(folder):
        shutil.rmtree(folder)
