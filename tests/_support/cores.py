"""The machine's cores shared by pytest-xdist workers.

Each test holds a shared turn while it runs (conftest). A test marked
``all_cores`` takes an exclusive one, so that it never runs beside another
worker's test: timing-sensitive tests (kills, exit watches) see the cores
they would see alone, and the other worker's tests wait.

Work that starts several processes (MPI ranks, jax.distributed processes:
:mod:`mp`) keeps its shared turn and takes the session's launch lock: one
launch at a time, beside the other worker's test. Measured on 2 cores
(issue 51, the suite's timeline, ``CHEMTRAIN_TEST_TIMELINE``): two ranks
keep about 0.9 of the 2 cores busy on average (start-up, compilation, one
rank waiting on the other), so running each launch alone left a core idle;
beside the other worker's test the suite took 28:09 instead of 31:24, with
less CPU time in all (2935 s against 3016 s).
``CHEMTRAIN_TEST_LAUNCH=exclusive`` runs every launch alone again.

The turns are a readers-writer lock of two ``flock`` files in the session's
folder: a turn is taken through a gate, so a waiting exclusive turn holds
the gate and new shared turns queue behind it instead of starving it.
Outside xdist (a plain ``pytest`` run) nothing is locked.
"""
import contextlib
import fcntl
import json
import os
import time

_fds = {}
_held = None   # None, "shared" or "exclusive"
_waited = 0.0  # seconds this worker spent waiting for turns in the current test


def _active() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) and \
        os.path.isdir(os.environ.get("CHEMTRAIN_TEST_CACHE_ROOT", ""))


def _fd(name):
    if name not in _fds:
        path = os.path.join(os.environ["CHEMTRAIN_TEST_CACHE_ROOT"], f"cores-{name}.lock")
        _fds[name] = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    return _fds[name]


def _take(kind):
    global _held, _waited
    t = time.perf_counter()
    fcntl.flock(_fd("gate"), fcntl.LOCK_EX)
    try:
        fcntl.flock(_fd("main"), fcntl.LOCK_SH if kind == "shared" else fcntl.LOCK_EX)
    finally:
        fcntl.flock(_fd("gate"), fcntl.LOCK_UN)
    _held = kind
    _waited += time.perf_counter() - t


def _give():
    global _held
    fcntl.flock(_fd("main"), fcntl.LOCK_UN)
    _held = None


@contextlib.contextmanager
def turn(exclusive=False):
    """One test's turn (conftest): shared, or exclusive for ``all_cores``."""
    if not _active():
        yield
        return
    _take("exclusive" if exclusive else "shared")
    try:
        yield
    finally:
        _give()


@contextlib.contextmanager
def all_cores():
    """Within a test: run what follows alone (the shared turn is given up
    first, so two workers that both ask never wait for each other)."""
    if not _active() or _held == "exclusive":
        yield
        return
    before = _held
    if before:
        _give()
    _take("exclusive")
    try:
        yield
    finally:
        _give()
        if before:
            _take(before)


@contextlib.contextmanager
def launch():
    """Within a test: start several processes (mp.mpirun, mp.distributed).
    One launch at a time in the whole session, beside the other worker's
    test (the shared turn is kept). CHEMTRAIN_TEST_LAUNCH=exclusive runs
    each launch alone instead (all_cores)."""
    if os.environ.get("CHEMTRAIN_TEST_LAUNCH") == "exclusive":
        with all_cores():
            yield
        return
    if not _active() or _held == "exclusive":
        yield
        return
    global _waited
    t = time.perf_counter()
    fcntl.flock(_fd("launch"), fcntl.LOCK_EX)
    _waited += time.perf_counter() - t
    try:
        yield
    finally:
        fcntl.flock(_fd("launch"), fcntl.LOCK_UN)


@contextlib.contextmanager
def timeline(nodeid):
    """With ``CHEMTRAIN_TEST_TIMELINE=FILE``, append one JSON line per test:
    worker, start and end (wall clock), seconds spent waiting for turns, and
    the CPU seconds of this worker and of the processes it waited for: the
    record of where a suite's time goes (issue 51), summarised by
    tests/_support/timeline.py."""
    path = os.environ.get("CHEMTRAIN_TEST_TIMELINE")
    if not path:
        yield
        return
    global _waited
    import resource
    _waited = 0.0

    def cpu():
        return [u.ru_utime + u.ru_stime for u in map(resource.getrusage, (
            resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))]
    before, start = cpu(), time.time()
    try:
        yield
    finally:
        end, after = time.time(), cpu()
        line = {"test": nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                "start": start, "end": end, "waited": round(_waited, 3),
                "cpu": round(after[0] - before[0], 3),
                "cpu_children": round(after[1] - before[1], 3)}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
