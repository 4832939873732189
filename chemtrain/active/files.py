"""The run's folder: every file written whole or not at all, so that a crash
at any moment leaves a folder the next start continues from."""
from __future__ import annotations

import json
import os

import numpy as np

#: where the labels of a structure live in the run's extxyz files
ENERGY_KEY, FORCES_KEY = "REF_energy", "REF_forces"


def write_json(path: str, data) -> None:
    from ..checkpoint import atomic_write_bytes
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode())


def read_json(path: str, default=None):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def write_frames(path: str, frames) -> None:
    """``frames`` (``ase.Atoms``) as one extxyz file, replaced atomically."""
    import ase.io
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    ase.io.write(tmp, list(frames), format="extxyz")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_frames(path: str) -> list:
    import ase.io
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return []
    return ase.io.read(path, index=":", format="extxyz")


def append_log(folder: str, event: dict) -> None:
    """One JSON line in ``log.jsonl`` (what was done and why)."""
    with open(os.path.join(folder, "log.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())


def labelled_copy(atoms, energy: float, forces) -> object:
    """A plain copy of ``atoms`` holding its labels (eV, eV/Angstrom)."""
    a = atoms.copy()
    a.calc = None
    a.info = {k: v for k, v in atoms.info.items() if isinstance(v, (int, float, str, bool))}
    a.info[ENERGY_KEY] = float(energy)
    a.arrays[FORCES_KEY] = np.asarray(forces, float)
    return a


def as_labelled(frames, what: str) -> list:
    """Labelled structures (``REF_energy``/``REF_forces``, or the results of
    the calculator ASE attached when reading) as plain copies; ValueError
    naming the first structure without labels."""
    from ..uncertainty import as_frames
    out = []
    for i, a in enumerate(as_frames(frames, what)):
        e = a.info.get(ENERGY_KEY)
        f = a.arrays.get(FORCES_KEY)
        results = getattr(a.calc, "results", {}) if a.calc is not None else {}
        e = results.get("energy") if e is None else e
        f = results.get("forces") if f is None else f
        if e is None or f is None:
            raise ValueError(f"Structure {i} of the {what} has no energy and forces: give "
                             f"info[{ENERGY_KEY!r}] and arrays[{FORCES_KEY!r}] (eV, eV/Å), or "
                             f"structures with a calculator's results.")
        out.append(labelled_copy(a, e, f))
    return out
