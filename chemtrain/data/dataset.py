"""In-memory datasets: dicts of equal-length numpy arrays, one row per structure.

Conventions: ``R`` positions (n, atoms, 3) in nm, ``U`` energies (n,) in
kJ/mol, ``F`` forces (n, atoms, 3) in kJ/mol/nm, optional ``mask`` (n, atoms)
marking real atoms, and any per-structure inputs of the energy function
(``species``, ``box``, ...).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

CHECK_FINITE = ("R", "U", "F")


def validate_dataset(data: Mapping, required: Iterable[str] = ("R",), name: str = "dataset") -> dict:
    """Check a dataset and return it as a dict of numpy arrays.

    Raises ``ValueError`` naming the problem: not a dict, missing keys, unequal
    lengths, or NaN/inf in positions, energies or forces.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{name} must be a dict of arrays with one row per structure "
                        f"(keys like 'R', 'U', 'F'), got {type(data).__name__}.")
    out = {k: np.asarray(v) for k, v in data.items()}
    missing = [k for k in required if k not in out]
    if missing:
        raise ValueError(f"{name} lacks the key(s) {missing}; it has {sorted(out)}. "
                         f"'R' holds positions and each trained target needs its key "
                         f"(drop a target by leaving it out of gammas).")
    lengths = {k: (v.shape[0] if v.ndim else None) for k, v in out.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{name} arrays must all have the same length (one row per "
                         f"structure), got lengths {lengths}.")
    for k in CHECK_FINITE:
        if k in out and np.issubdtype(out[k].dtype, np.floating):
            bad = ~np.isfinite(out[k])
            if bad.any():
                rows = np.unique(np.nonzero(bad.reshape(bad.shape[0], -1))[0])
                raise ValueError(f"{name}['{k}'] holds {int(bad.sum())} NaN or inf value(s), "
                                 f"in structure(s) {rows[:10].tolist()}"
                                 f"{' ...' if rows.size > 10 else ''}. Remove or fix them.")
    if "mask" in out and out["mask"].shape != out["R"].shape[:2]:
        raise ValueError(f"{name}['mask'] must have shape (structures, atoms) = "
                         f"{out['R'].shape[:2]}, got {out['mask'].shape}.")
    return out


def dataset_length(data: Mapping) -> int:
    return int(next(iter(data.values())).shape[0])


def split_dataset(data: Mapping, train_ratio: float = 0.7, val_ratio: float = 0.1,
                  shuffle: bool = False, seed: int = 0) -> dict[str, dict]:
    """Split into 'training', 'validation' and 'testing' parts by ratios."""
    if not (0 < train_ratio <= 1 and 0 <= val_ratio and train_ratio + val_ratio <= 1 + 1e-12):
        raise ValueError(f"Need 0 < train_ratio <= 1, 0 <= val_ratio and train_ratio + "
                         f"val_ratio <= 1; got {train_ratio}, {val_ratio}.")
    n = dataset_length(data)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    n_train = int(round(n * train_ratio))
    n_val = int(round(n * val_ratio))
    parts = {"training": order[:n_train], "validation": order[n_train:n_train + n_val],
             "testing": order[n_train + n_val:]}
    return {stage: {k: v[idx] for k, v in data.items()} for stage, idx in parts.items()}


def pad_systems(systems: list[Mapping], n_atoms: int | None = None,
                per_atom: Iterable[str] = ("R", "F", "species"),
                pad_position: float | np.ndarray = 0.0) -> dict:
    """Stack structures of different size into one padded dataset.

    Per-atom arrays (``per_atom`` keys) are padded to ``n_atoms`` (default: the
    largest system) and a boolean ``mask`` (structures, atoms) marks real
    atoms. Padded positions are ``pad_position``; padded forces and species 0.
    Other keys are stacked as they are.
    """
    if not systems:
        raise ValueError("pad_systems needs at least one system.")
    sizes = [np.asarray(s["R"]).shape[0] for s in systems]
    n_atoms = max(sizes) if n_atoms is None else n_atoms
    if max(sizes) > n_atoms:
        raise ValueError(f"n_atoms={n_atoms} is smaller than the largest system ({max(sizes)} atoms).")
    keys = list(systems[0])
    out = {}
    for k in keys:
        rows = []
        for s, size in zip(systems, sizes):
            v = np.asarray(s[k])
            if k in per_atom:
                fill = pad_position if k == "R" else 0
                pad = np.broadcast_to(np.asarray(fill, v.dtype), (n_atoms - size,) + v.shape[1:])
                v = np.concatenate([v, pad], axis=0)
            rows.append(v)
        out[k] = np.stack(rows)
    out["mask"] = np.arange(n_atoms)[None, :] < np.asarray(sizes)[:, None]
    return out
