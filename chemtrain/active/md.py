"""Molecular dynamics with a committee, watched: one run of ASE's Langevin
dynamics that records the committee's force spread, stops once enough frames
are uncertain, and stops an explosion before it reaches the labels."""
from __future__ import annotations

import numpy as np


class _Stop(Exception):
    """Raised inside the dynamics to end the run; carries the reason."""


def shortest_distance(atoms, within: float = 8.0) -> float:
    """The shortest interatomic distance of ``atoms`` (periodic images
    included; ``within`` if none is shorter)."""
    from ase.neighborlist import neighbor_list
    d = neighbor_list("d", atoms, within)
    return float(np.min(d)) if len(d) else within


def insane(atoms, forces, max_force: float, min_distance: float) -> str | None:
    """Why this frame is no longer physical (None if it is): non-finite
    positions or forces, a force above ``max_force`` eV/Angstrom, two atoms
    closer than ``min_distance`` Angstrom."""
    from ase.neighborlist import neighbor_list
    if not (np.all(np.isfinite(atoms.positions)) and np.all(np.isfinite(forces))):
        return "positions or forces are not finite"
    big = float(np.max(np.linalg.norm(forces, axis=1)))
    if big > max_force:
        return f"a force of {big:.3g} eV/Å (above max_force {max_force:g})"
    d = neighbor_list("d", atoms, min_distance)
    if len(d):
        return f"two atoms {float(np.min(d)):.3g} Å apart (below min_distance {min_distance:g})"
    return None


def run(atoms, committee, *, temperature_K: float, steps: int, timestep_fs: float,
        friction_per_fs: float, record_every: int, threshold: float, scale: float,
        stop_after: int, max_force: float, min_distance: float, keep_sane: int,
        seed: int) -> dict:
    """One Langevin run from ``atoms`` (velocities drawn at ``temperature_K``
    from ``seed``; the same arguments give the same run).

    Every ``record_every`` steps the frame is recorded with its score, the
    largest atom's force spread times ``scale`` (eV/Angstrom), and is
    uncertain when the score passes ``threshold``. The run ends after
    ``steps``, after ``stop_after`` uncertain frames, or when a frame is no
    longer physical (:func:`insane`, checked every step): then the last
    ``keep_sane`` recorded frames before it are returned for labelling.

    Returns:
      ``frames`` (``ase.Atoms`` with ``info`` ``step``, ``score``,
      ``uncertain``), ``uncertain`` and ``sane`` (indices of frames), ``end``
      (``'steps'``, ``'uncertain'`` or ``'exploded: <why>'``), ``steps``.
    """
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import Stationary
    try:
        from ase.md.velocitydistribution import thermalize_momenta   # ASE >= 3.29
    except ImportError:
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution as thermalize_momenta
    rng = np.random.default_rng(seed)
    atoms = atoms.copy()
    atoms.info = {}
    atoms.calc = committee
    thermalize_momenta(atoms, temperature_K=temperature_K, rng=rng)
    Stationary(atoms)
    dyn = Langevin(atoms, timestep_fs * units.fs, temperature_K=temperature_K,
                   friction=friction_per_fs / units.fs, fixcm=False, rng=rng)
    frames, uncertain = [], []
    done = {"steps": 0}

    def watch():
        done["steps"] = dyn.nsteps
        why = insane(atoms, committee.results["forces"], max_force, min_distance)
        if why is not None:
            raise _Stop("exploded: " + why)
        if dyn.nsteps % record_every:
            return
        score = float(np.max(committee.results["forces_std"])) * scale
        frame = atoms.copy()
        frame.calc = None
        frame.info = {"step": int(dyn.nsteps), "score": score, "uncertain": score > threshold}
        frames.append(frame)
        if score > threshold:
            uncertain.append(len(frames) - 1)
            if len(uncertain) >= stop_after:
                raise _Stop("uncertain")

    atoms.get_forces()
    dyn.attach(watch, interval=1)
    try:
        dyn.run(steps)
        end = "steps"
    except _Stop as stop:
        end = str(stop)
    sane = list(range(max(0, len(frames) - keep_sane), len(frames))) \
        if end.startswith("exploded") else []
    return {"frames": frames, "uncertain": uncertain, "sane": sane, "end": end,
            "steps": int(done["steps"])}
