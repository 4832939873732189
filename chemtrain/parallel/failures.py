"""No process ever waits forever: errors shared by every process, and aborts.

Two kinds of failure exist in a multi-process run:

- An error that every process raises together (the root found bad data and
  told everyone, a checkpoint write failed and every process learned it,
  processes disagreed on their input). Nobody is left in a collective, so it
  propagates as a normal exception that the user may catch. Such exceptions
  are marked with :func:`raised_everywhere`.
- An error on one process only. The others would wait in their next
  collective, so the failing process ends the whole job: MPI aborts the
  communicator; ``jax.distributed`` processes learn it through the
  coordination service (:func:`start_jax_watchdog`) and exit.

:func:`on_root` and :func:`agree` turn the second kind into the first where
the code knows a process may fail alone (reading data or files). The
exception's class travels with it, so ``UnknownElementError`` raised on the
root arrives as ``UnknownElementError`` on every rank.
"""
from __future__ import annotations

import builtins
import importlib
import os
import sys
import threading
import traceback
from typing import Any, Callable

_EVERYWHERE = "_chemtrain_raised_everywhere"


def raised_everywhere(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised on every process at once (no abort needed).

    A failure guard lets such an exception propagate instead of ending every
    process. Use it as ``raise raised_everywhere(ValueError(...))`` where all
    processes are known to raise together.

    Args:
      exc: the exception; it gets a marker attribute (set in place).

    Returns:
      ``exc`` itself.
    """
    setattr(exc, _EVERYWHERE, True)
    return exc


def is_raised_everywhere(exc: BaseException) -> bool:
    return bool(getattr(exc, _EVERYWHERE, False))


def describe_exception(exc: BaseException) -> list:
    """JSON-able description of an exception: [module, class name, message]."""
    cls = type(exc)
    return [cls.__module__, cls.__qualname__, str(exc)]


def rebuild_exception(data) -> BaseException:
    """The exception described by :func:`describe_exception`, of the same
    class where that class can be imported and built from a message
    (builtins and chemtrain's own errors), else a ``RuntimeError`` naming it."""
    module, qualname, message = data
    cls = None
    if module == "builtins":
        cls = getattr(builtins, qualname, None)
    elif module.split(".")[0] in ("chemtrain", "h5py", "jax", "optax", "numpy"):
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            cls = obj
        except (ImportError, AttributeError):
            cls = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 - constructors with other signatures
            pass
    return RuntimeError(f"{module}.{qualname}: {message}")


def on_root(strategy, fn: Callable, share: bool = False, only_root: bool | None = None):
    """Run ``fn`` where in-memory data lives: on every process, or only on the root.

    Strategies that scatter data from the root run ``fn`` on the root only;
    other strategies run it on every process. With a single process ``fn`` simply
    runs. When only the root runs ``fn``, every process must call
    :func:`on_root` together (it broadcasts).

    Args:
      strategy: the run's :class:`~chemtrain.parallel.Strategy`.
      fn: function of no arguments.
      share: send the root's result (a JSON-like object) to all processes;
        else the other processes get None. Only used when the root alone
        runs ``fn``.
      only_root: True runs ``fn`` on the root whatever the strategy (e.g.
        for files); False on every process; None (default): on the root for
        strategies that scatter from it (``strategy.scatters_from_root``).

    Returns:
      ``fn``'s result where it ran; on the other processes the root's result
      with ``share``, else None.

    Raises:
      Exception: when only the root runs ``fn`` and it raises, the exception
        is raised on every process, of the same class (the original one on
        the root, a rebuilt one elsewhere; a ``RuntimeError`` naming the
        class where it cannot be rebuilt) and marked with
        :func:`raised_everywhere`. When ``fn`` runs on every process (or
        there is one), its exceptions propagate unchanged, on the process
        that raised them only.
    """
    if only_root is None:
        only_root = strategy.scatters_from_root
    if not only_root or strategy.process_count == 1:
        return fn()
    result, error, original = None, None, None
    if strategy.is_root:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every kind is shared
            original, error = e, describe_exception(e)
    error = strategy.bcast_object(error)
    if error is not None:
        raise raised_everywhere(original if original is not None else rebuild_exception(error))
    return strategy.bcast_object(result) if share else result


def agree(strategy, fn: Callable, what: str):
    """Run ``fn`` on every process; if it raises on any, raise on all.

    No process is left waiting in a later collective for one that failed.
    Every process must call :func:`agree` together (it gathers from all).
    With a single process ``fn`` simply runs.

    Args:
      strategy: the run's :class:`~chemtrain.parallel.Strategy`.
      fn: function of no arguments.
      what: what ``fn`` does, in words, for the message on the other
        processes (``"... (raised by process 2 while <what>)"``).

    Returns:
      ``fn``'s result on this process.

    Raises:
      Exception: if ``fn`` raises an ``Exception`` on any process, every
        process raises the exception of the lowest-numbered failing process,
        marked with :func:`raised_everywhere`: that process its original
        exception, the others one of the same class (a ``RuntimeError``
        naming it where it cannot be rebuilt) whose message names the
        process and ``what``. With one process ``fn``'s exception propagates
        unchanged.
    """
    if strategy.process_count == 1:
        return fn()
    result, error, original = None, None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001
        original, error = e, describe_exception(e)
    errors = strategy.host_allgather_object(error)
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if failed:
        index, data = failed[0]
        if index == strategy.process_index and original is not None:
            raise raised_everywhere(original)
        exc = rebuild_exception([data[0], data[1], f"{data[2]} (raised by process {index} "
                                                   f"while {what})"])
        raise raised_everywhere(exc)
    return result


def format_failure(strategy, exc_type, exc, tb) -> str:
    return (f"chemtrain: process {strategy.process_index} of {strategy.process_count} failed; "
            f"ending every process of the run.\n"
            + "".join(traceback.format_exception(exc_type, exc, tb)))


#: (depth, serial) of the failure guards this process is inside: work that
#: reaches collectives (see :func:`start_mpi_exit_watch`)
_guards = {"depth": 0, "serial": 0}


class AbortOnError:
    """Context manager: an exception raised on this process alone ends every
    process (``strategy.abort``); one raised everywhere propagates."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __enter__(self):
        _guards["depth"] += 1
        _guards["serial"] += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        _guards["depth"] -= 1
        if (exc is None or self.strategy.process_count == 1 or isinstance(exc, KeyboardInterrupt)
                or is_raised_everywhere(exc)):
            return False
        self.strategy.abort(format_failure(self.strategy, exc_type, exc, tb))
        return False


# -- MPI: a rank whose script ends while others still train ----------------------
EXIT_TAG = 30517
_exit_watch: dict[str, Any] = {}
#: seconds a process may stay inside a trainer method after another process
#: ended (the last collective of a method may be followed by local work)
PEER_EXIT_GRACE_S = float(os.environ.get("CHEMTRAIN_PEER_EXIT_GRACE_S", "30"))


def start_mpi_exit_watch(strategy, poll_s: float = 0.2) -> None:
    """Make a rank that ends normally (its script finished, or it left the
    trainer's methods) unable to leave the others waiting forever.

    At exit each rank tells every other one. A daemon thread on each rank
    listens; if a peer has ended while this rank is inside a trainer method
    (a failure guard: work that reaches collectives) and is still inside the
    same call ``PEER_EXIT_GRACE_S`` later, it can never complete: the thread
    ends every process with a message naming both ranks.

    A rank that ends waits, before MPI is finalized, until every other rank
    has ended too (or the run is ended for it). Finalizing would wait for
    them anyway, but it fails when a peer still at work has already sent
    this rank a message (a collective the peer entered): MPICH's launcher
    then killed the other ranks without a word and reported success."""
    import atexit
    if _exit_watch or strategy.process_count == 1:
        return
    MPI, comm = strategy.MPI, strategy.comm.Dup()   # a communicator of its own
    rank, stop, ended = comm.Get_rank(), threading.Event(), {}

    def watch():
        import time
        request, stuck = comm.irecv(source=MPI.ANY_SOURCE, tag=EXIT_TAG), None
        while not stop.is_set():
            done, peer = request.test()
            if done:
                ended[peer] = time.monotonic()
                request = comm.irecv(source=MPI.ANY_SOURCE, tag=EXIT_TAG)
                continue
            if ended and _guards["depth"] > 0:
                if stuck is None or stuck[0] != _guards["serial"]:
                    stuck = (_guards["serial"], time.monotonic())
                elif time.monotonic() - stuck[1] > PEER_EXIT_GRACE_S:
                    strategy.abort(
                        f"chemtrain: process(es) {sorted(ended)} of this run ended (their script "
                        f"finished) while process {rank} is still in a trainer method that needs "
                        f"them ({PEER_EXIT_GRACE_S:g} s later): it would wait forever. Every "
                        f"process must call the same trainer methods in the same order (the same "
                        f"max_epochs, the same train() calls).")
            else:
                stuck = None
            stop.wait(poll_s)
        request.Cancel()
        request.Wait()

    thread = threading.Thread(target=watch, name="chemtrain-mpi-exit-watch", daemon=True)
    thread.start()
    _exit_watch.update(thread=thread, stop=stop)

    def tell_the_others():   # atexit: before mpi4py finalizes MPI
        import time
        others = comm.Get_size() - 1
        sends = [comm.isend(rank, dest=r, tag=EXIT_TAG) for r in range(others + 1) if r != rank]
        MPI.Request.Waitall(sends)
        while len(ended) < others and thread.is_alive():
            time.sleep(poll_s)   # the watch thread counts the peers that ended
        stop.set()
        thread.join(timeout=poll_s + 5)

    atexit.register(tell_the_others)


_hook_installed = False


def install_excepthook(strategy) -> None:
    """Make an uncaught exception anywhere in a multi-process run end every
    process with its traceback (as ``python -m mpi4py`` does for MPI)."""
    global _hook_installed
    if _hook_installed or strategy.process_count == 1:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        strategy.abort(format_failure(strategy, exc_type, exc, tb))

    sys.excepthook = hook
    _hook_installed = True


# -- jax.distributed -----------------------------------------------------------
ABORT_KEY = "chemtrain/abort"


def _client():
    """The coordination service's client of this jax.distributed process
    (None before ``jax.distributed.initialize``). The only private JAX
    import of chemtrain: JAX has no public handle on the client, whose
    key-value store carries abort messages between processes."""
    from jax._src import distributed
    return distributed.global_state.client


def jax_abort(message: str, delay: float = 2.0) -> None:
    """Tell every jax.distributed process that this one failed, then exit.

    The message goes to this process's stderr and into the coordination
    service's key-value store, where the other processes' watchdogs find it.
    ``os._exit`` skips jax's shutdown barrier, which would wait for the others.
    """
    import time
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    client = _client()
    if client is not None:
        try:
            client.key_value_set(ABORT_KEY, message[-4000:])
        except Exception:  # noqa: BLE001 - another process may have set it first
            pass
        time.sleep(delay)  # let the others read it before the service may go
    os._exit(1)


_watchdog: dict[str, Any] = {}


def start_jax_watchdog(poll_ms: int = 1000) -> None:
    """Start a daemon thread that ends this process as soon as another
    jax.distributed process reports a failure (see :func:`jax_abort`).

    Without it, processes blocked in a collective wait until the coordination
    service misses the failed process's heartbeats
    (``jax.distributed.initialize(heartbeat_timeout_seconds=...)``, default
    100 s) or longer."""
    import atexit
    if _watchdog or _client() is None:
        return
    stop = threading.Event()

    def watch():
        client = _client()
        while not stop.is_set():
            try:
                message = client.blocking_key_value_get(ABORT_KEY, poll_ms)
            except Exception as e:  # noqa: BLE001
                if stop.is_set():
                    return
                if "DEADLINE_EXCEEDED" in str(e) or "deadline" in str(e).lower():
                    continue
                sys.stderr.write(f"chemtrain: lost the jax.distributed coordination service "
                                 f"({type(e).__name__}: {e}); another process has probably "
                                 f"failed. Exiting.\n")
                sys.stderr.flush()
                os._exit(1)
            if stop.is_set():
                return
            sys.stderr.write(f"chemtrain: another process failed; exiting. Its message:\n"
                             f"{message}\n")
            sys.stderr.flush()
            os._exit(1)

    thread = threading.Thread(target=watch, name="chemtrain-watchdog", daemon=True)
    thread.start()
    _watchdog.update(thread=thread, stop=stop)

    def stop_watchdog():  # runs before jax's own shutdown (atexit is LIFO)
        stop.set()
        thread.join(timeout=poll_ms / 1000 + 5)

    atexit.register(stop_watchdog)
