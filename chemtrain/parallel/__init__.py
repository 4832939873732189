"""The only place that knows single / jax / mpi / jax-distributed.

``make_strategy(parallelism, mesh)`` resolves the user's choice into one
:class:`~chemtrain.parallel.base.Strategy`. Importing this package imports
neither mpi4py nor mpi4jax and initialises no JAX backend; those happen in
``make_strategy`` and only when needed.
"""
from __future__ import annotations

import os

from .base import Strategy

METHODS = ("auto", "single", "jax", "mpi")

# Environment variables that MPI launchers set for every rank.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS",
                  "MV2_COMM_WORLD_SIZE")


def launched_by_mpi_with_several_ranks() -> bool:
    """Cheap check of the launcher environment (imports nothing)."""
    for var in _MPI_SIZE_VARS:
        try:
            if int(os.environ.get(var, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def mpi_world_size() -> int:
    """Number of MPI ranks; imports mpi4py only when a launcher says > 1."""
    if not launched_by_mpi_with_several_ranks():
        return 1
    try:
        from mpi4py import MPI
    except ImportError:
        return 1
    return MPI.COMM_WORLD.Get_size()


def jax_process_count() -> int:
    """Processes of an initialized ``jax.distributed`` run (1 otherwise)."""
    import jax
    if not jax.distributed.is_initialized():
        return 1
    return jax.process_count()


def resolve(parallelism: str = "auto") -> str:
    """Name of the parallel method that ``parallelism`` stands for on this machine.

    An explicit method is returned as it is (after the check below);
    ``'auto'`` picks, in this order, ``'jax'`` when ``jax.distributed`` runs
    several processes, ``'mpi'`` when an MPI launcher started several ranks,
    ``'jax'`` when this process sees several JAX devices, else ``'single'``.
    For ``'auto'`` it may count the JAX devices, which initialises JAX's
    backend.

    Args:
      parallelism: one of ``METHODS`` (``'auto'``, ``'single'``, ``'jax'``,
        ``'mpi'``).

    Returns:
      ``'single'``, ``'jax'`` or ``'mpi'``.

    Raises:
      ValueError: if ``parallelism`` is not one of ``METHODS``.
      RuntimeError: if both ``jax.distributed`` (several processes) and MPI
        (several ranks) are active, whatever ``parallelism`` asks for.
    """
    if not isinstance(parallelism, str) or parallelism not in METHODS:
        raise ValueError(
            f"Unknown parallelism {parallelism!r}; expected one of {METHODS}. "
            f"'auto' picks jax.distributed, then MPI, then local multi-device "
            f"JAX, then single.")
    n_jax, n_mpi = jax_process_count(), mpi_world_size()
    if n_jax > 1 and n_mpi > 1:
        raise RuntimeError(
            f"Both jax.distributed ({n_jax} processes) and MPI ({n_mpi} ranks) "
            f"are active. Use one: either call jax.distributed.initialize() and "
            f"parallelism='jax' (launching with mpirun is fine for that), or do "
            f"not initialize jax.distributed and use parallelism='mpi'.")
    if parallelism != "auto":
        return parallelism
    if n_jax > 1:
        return "jax"
    if n_mpi > 1:
        return "mpi"
    import jax
    if jax.local_device_count() > 1:
        return "jax"
    return "single"


def make_strategy(parallelism: str = "auto", mesh=None, check_vma: bool = True,
                  allow_jax: bool = True, trainer: str = "this trainer") -> Strategy:
    """Build the parallel strategy for ``parallelism``.

    The method is chosen by :func:`resolve`; mpi4py, mpi4jax and a JAX
    backend are imported only here and only when the method needs them.

    Args:
      parallelism: ``'auto'``, ``'single'``, ``'jax'`` or ``'mpi'`` (see
        :func:`resolve`).
      mesh: a 1-D ``jax.sharding.Mesh`` with the axis ``'data'`` that selects
        the devices for ``'jax'`` (and makes ``'auto'`` mean ``'jax'``);
        None: all devices.
      check_vma: False turns off shard_map's varying-axis check under
        ``'jax'``, for models whose primitives drop that information.
      allow_jax: False for trainers that spread work over MPI ranks only
        (DiffTRe): ``'auto'`` then means ``'mpi'`` with several ranks and
        ``'single'`` otherwise, and JAX sharding is an error naming
        ``trainer``.
      trainer: the trainer's name in that error message.

    Returns:
      The :class:`Strategy`, a ``SingleStrategy``, a ``JaxStrategy`` (over
      ``mesh``, or a mesh of all devices) or an ``MpiStrategy``.

    Raises:
      ValueError: if ``parallelism`` is unknown; with ``allow_jax=False``,
        if ``parallelism`` is ``'jax'``, a ``mesh`` is given or
        ``jax.distributed`` runs several processes; if a ``mesh`` is given
        with ``'single'`` or ``'mpi'``, or is not 1-D with the axis
        ``'data'``; or if the mesh holds none of this process's devices, or
        they are not contiguous along its axis.
      TypeError: if ``mesh`` is not a ``jax.sharding.Mesh``.
      RuntimeError: if ``jax.distributed`` and MPI are both active, or if
        ``'mpi'`` finds a rank that sees more than one JAX device.
      ImportError: if ``'mpi'`` needs mpi4py (or, with several ranks,
        mpi4jax) and it cannot be imported.
    """
    if not allow_jax:
        method = resolve(parallelism) if parallelism != "auto" else None
        if parallelism == "jax" or mesh is not None or jax_process_count() > 1:
            raise ValueError(
                f"{trainer} does not support JAX sharding (parallelism='jax', a mesh, or "
                f"jax.distributed with {jax_process_count()} process(es)). Run one process per "
                f"device under mpirun with parallelism='mpi' (or 'auto'), or 'single'.")
        if method is None:
            method = "mpi" if mpi_world_size() > 1 else "single"
        if method == "single":
            from .single import SingleStrategy
            return SingleStrategy()
        from .mpi import MpiStrategy
        return MpiStrategy()
    if mesh is not None and parallelism in ("auto", "jax"):
        from .jax_mesh import JaxStrategy, check_mesh
        resolve("jax")  # still refuses an accidental MPI + jax.distributed mix
        return JaxStrategy(check_mesh(mesh), check_vma=check_vma)
    method = resolve(parallelism)
    if mesh is not None:
        raise ValueError(f"mesh is only used with parallelism='jax', not {method!r}.")
    if method == "single":
        from .single import SingleStrategy
        return SingleStrategy()
    if method == "jax":
        from .jax_mesh import JaxStrategy
        return JaxStrategy(check_vma=check_vma)
    from .mpi import MpiStrategy
    return MpiStrategy()


from .failures import agree, on_root, raised_everywhere  # noqa: E402

__all__ = ["Strategy", "make_strategy", "resolve", "METHODS", "on_root", "agree",
           "raised_everywhere"]
