"""The run's folder: its paths, and how a run starts or is continued there."""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import socket

import numpy as np

from . import files as F
from . import md as MD
from .settings import Settings

#: the file a running process holds locked (:func:`locked`)
LOCK = "run.lock"
#: what start writes before state.json; a folder holding only these was cut short in start
START_FILES = {"seeds.extxyz", "labelled.extxyz", "test.extxyz", "calibration.extxyz",
               "settings.json", "guards.json", "log.jsonl", LOCK}
NAMES = {"seeds": "seed structures", "test": "test set", "calibration": "calibration set"}


class Paths:
    """The files of a run's folder."""

    def __init__(self, folder: str):
        self.folder = folder
        for name in ("settings", "state", "guards"):
            setattr(self, name, os.path.join(folder, f"{name}.json"))
        for name in ("seeds", "labelled", "test", "calibration"):
            setattr(self, name, os.path.join(folder, f"{name}.extxyz"))

    def round(self, r: int, *parts) -> str:
        return os.path.join(self.folder, f"round_{r:03d}", *parts)

    def members(self, r: int) -> list[str]:
        return sorted(glob.glob(self.round(r, "train", "model_member*.npz")),
                      key=lambda p: int(p.rsplit("member", 1)[1][:-4]))


class FolderInUse(RuntimeError):
    """Another process is working in the run's folder."""


@contextlib.contextmanager
def locked(folder: str):
    """Hold the run folder's lock while this process works in it; a second
    process is refused by name. The lock is the operating system's
    (``flock`` on ``run.lock``): it ends with the process, also one that was
    killed, so no stale lock is left behind. A folder this call created is
    removed again, and the lock file of a folder that holds no run yet,
    if what runs inside fails."""
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK)
    new_lock = not os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise FolderInUse(
                f"{folder!r} is in use by another process ({holder}): two processes in one "
                f"run's folder would overwrite each other's rounds. Wait for it to end (or stop "
                f"it), then continue; the folder is freed when that process ends, also if it "
                f"was killed.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        try:
            yield
        except BaseException:
            if new_lock and not os.path.exists(Paths(folder).state):
                os.remove(path)   # a start refused or cut short: leave the folder as it was
                if created and not os.listdir(folder):
                    os.rmdir(folder)
            raise
    finally:
        os.close(fd)


def start(folder: str, seeds, labelled, settings: Settings, test=None, calibration=None):
    """Create the folder of a new run, or check that a restart names the same run."""
    paths = Paths(folder)
    if os.path.exists(paths.state):
        old = Settings.from_json(F.read_json(paths.settings))
        if settings is not None and old.differences(settings):
            raise ValueError(f"{folder!r} holds a run with other settings ("
                             f"{'; '.join(old.differences(settings))}); continue it with its "
                             f"own (settings=None) or start in another folder.")
        for name, given in (("seeds", seeds), ("test", test), ("calibration", calibration)):
            _check_same(paths, name, given)
        if labelled is not None and not _same(F.read_frames(paths.labelled)[:_seed_count(paths)],
                                              F.as_labelled(labelled, "seed labels")):
            raise ValueError(f"{folder!r} holds a run started from other seed labels; continue "
                             f"it without them (labelled=None) or start in another folder.")
        if settings is not None and settings.rounds != old.rounds:
            F.write_json(paths.settings, settings.to_json())
        return paths
    if seeds is None or labelled is None:
        raise ValueError(f"{folder!r} holds no run yet: give the seed structures and the seed "
                         f"labels.")
    settings = settings or Settings()
    from ..uncertainty import as_frames
    seed_frames = as_frames(seeds, "seed structures")
    sets = {"labelled": F.as_labelled(labelled, "seed labels")}
    if len(sets["labelled"]) < 3:
        raise ValueError(f"{len(sets['labelled'])} seed labels: a committee needs at least 3 "
                         f"(training and validation).")
    for name, given in (("test", test), ("calibration", calibration)):
        if given is not None:
            sets[name] = F.as_labelled(given, f"{name} set")
    os.makedirs(folder, exist_ok=True)
    if set(os.listdir(folder)) - START_FILES:   # start's own files only: a start cut short
        raise ValueError(f"{folder!r} is not empty and holds no active-learning run: choose an "
                         f"empty or new folder.")
    F.write_frames(paths.seeds, [a.copy() for a in seed_frames])
    for name, frames in sets.items():
        F.write_frames(getattr(paths, name), frames)
    F.write_json(paths.settings, settings.to_json())
    shortest = min(MD.shortest_distance(a) for a in sets["labelled"])
    F.write_json(paths.guards, {"min_distance": settings.min_distance or 0.7 * shortest,
                                "shortest_labelled_distance": shortest,
                                "seed_labels": len(sets["labelled"])})
    F.write_json(paths.state, {"round": 0, "phase": "train"})
    F.append_log(folder, {"event": "start", "seeds": len(seed_frames),
                          "labels": len(sets["labelled"])})
    return paths


def _seed_count(paths) -> int:
    """How many of the labels were the seed labels."""
    return F.read_json(paths.guards)["seed_labels"]


def _same(a: list, b: list) -> bool:
    """The same structures (and energies, where both have them), to extxyz's precision."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if len(x) != len(y) or not np.array_equal(x.numbers, y.numbers) \
                or not np.allclose(x.positions, y.positions, atol=1e-6):
            return False
        e, f = x.info.get(F.ENERGY_KEY), y.info.get(F.ENERGY_KEY)
        if e is not None and f is not None and not np.isclose(e, f, rtol=1e-8, atol=1e-6):
            return False
    return True


def _check_same(paths, name: str, given) -> None:
    """A restart that names the run's seeds, test or calibration set names the same ones."""
    if given is None:
        return
    from ..uncertainty import as_frames
    stored = getattr(paths, name)
    if not os.path.exists(stored) or not _same(F.read_frames(stored), as_frames(given, name)):
        raise ValueError(f"{paths.folder!r} holds a run with other {NAMES[name]} (or none); "
                         f"continue it without {name}=... or start in another folder.")
