"""Reading, splitting and preparing the data of ``chemtrain-finetune``.

Every reader returns one dict of padded numpy arrays in chemtrain's units
(nm, kJ/mol): ``R``, ``species``, ``mask``, ``natoms`` and, where the file
has them, ``U``, ``F``, ``box`` (cell vectors as columns; zeros for
structures without a cell), ``pbc`` (when periodicity differs), ``stress``
and ``stress_weight``. In-memory sets get precomputed graphs (every periodic
image within r_max, so cells of any size are exact); a jax-md neighbor list
is used only for an HDF5 training file of molecules that has no graphs.
"""
from __future__ import annotations

import os

import numpy as np

from .. import units
from ..data.convert import STRESS, ConversionError, read_npz, full_stress, read_images
from ..neighbors import GRAPH_KEYS, add_graphs

LENGTH, ENERGY = units.ANGSTROM_TO_NM, units.EV_TO_KJ_PER_MOL
FORCE = ENERGY / LENGTH
# what an energy function or the loss may see; anything else a file holds stays out
KEEP = ("R", "species", "mask", "U", "F", "box", "stress", "stress_weight", "head", "head_weight",
        *GRAPH_KEYS)


class DataError(ValueError):
    """The data cannot be trained on as asked; the message says how to fix it."""


def kind(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    return "hdf5" if ext in (".h5", ".hdf5") else "npz" if ext == ".npz" else "ase"


def read(path: str, energy_key="REF_energy", forces_key="REF_forces",
         stress_key="REF_stress") -> dict:
    """All structures of ``path`` (see the module docstring)."""
    if not os.path.exists(path):
        raise DataError(f"{path!r} does not exist.")
    k = kind(path)
    if k == "npz":
        with np.load(path, allow_pickle=False) as z:
            files = z.files
        if "R" not in files or "z" not in files:
            raise DataError(f"{path!r} is not an MD22/sGDML .npz (keys R, z, E, F); it has "
                            f"{files}. A chemtrain MACE model goes to --foundation_model.")
        try:
            d = read_npz(path, LENGTH, units.KCAL_TO_KJ)
        except (KeyError, ConversionError) as e:
            raise DataError(str(e)) from None
        d["mask"] = np.ones(d["R"].shape[:2], bool)
        return d
    if k == "hdf5":
        return read_hdf5(path)
    return _read_ase(path, energy_key, forces_key, stress_key)


def read_hdf5(path: str, rows=None) -> dict:
    """Datasets of a chemtrain HDF5 file (already nm and kJ/mol), all rows or ``rows``."""
    import h5py
    with h5py.File(path, "r") as f:
        sel = slice(None) if rows is None else np.sort(np.asarray(rows))
        d = {k: f[k][sel] for k in f.keys() if isinstance(f[k], h5py.Dataset)}
    if rows is not None:
        back = np.argsort(np.argsort(np.asarray(rows)))
        d = {k: v[back] for k, v in d.items()}
    if "R" not in d or "species" not in d:
        raise DataError(f"{path!r} is not a chemtrain HDF5 file (datasets R, species, ...); "
                        f"write one with chemtrain-convert.")
    d.setdefault("mask", np.ones(d["R"].shape[:2], bool))
    d["natoms"] = d["mask"].sum(1)
    return d


def _label(atoms, key, per_atom):
    """A label of one structure: ``atoms.info``/``atoms.arrays`` under ``key``,
    else the results of the calculator ASE attached (extxyz's own 'energy',
    'forces', 'stress')."""
    value = (atoms.arrays if per_atom else atoms.info).get(key)
    if value is None and atoms.calc is not None:
        value = getattr(atoms.calc, "results", {}).get(key)
    return None if value is None else np.asarray(value, np.float64)


def _read_ase(path, energy_key, forces_key, stress_key) -> dict:
    try:
        return _ase_structures(path, energy_key, forces_key, stress_key)
    except ConversionError as e:
        raise DataError(str(e)) from None


def _ase_structures(path, energy_key, forces_key, stress_key) -> dict:
    from ..data.dataset import pad_systems
    images = read_images(path)
    systems, stresses, labelled = [], [], {"U": [], "F": []}
    for i, a in enumerate(images):
        e, f, s = (_label(a, energy_key, False), _label(a, forces_key, True),
                   _label(a, stress_key, False))
        labelled["U"].append(e is not None)
        labelled["F"].append(f is not None)
        row = {"R": a.get_positions() * LENGTH, "species": a.get_atomic_numbers().astype(np.int32),
               "U": np.nan if e is None else float(e) * ENERGY,
               "F": np.full((len(a), 3), np.nan) if f is None else f * FORCE,
               "cell": np.asarray(a.cell.array).T * LENGTH, "pbc": np.asarray(a.pbc, bool)}
        if f is not None and f.shape != (len(a), 3):
            raise DataError(f"Structure {i} of {path!r}: {forces_key!r} has shape {f.shape}, "
                            f"expected ({len(a)}, 3).")
        stresses.append(None if s is None else full_stress(s, i, path) * STRESS)
        systems.append(row)
    d = pad_systems(systems, per_atom=("R", "F", "species"))
    d["natoms"] = d["mask"].sum(1)
    pbc, cell = d.pop("pbc"), d.pop("cell")
    if pbc.any():
        d["box"] = np.where(pbc.any(1)[:, None, None], cell, 0.0)
        if not (pbc.all(1) | ~pbc.any(1)).all():
            d["pbc"] = pbc
    if any(s is not None for s in stresses):
        d["stress"] = np.stack([np.zeros((3, 3)) if s is None else s for s in stresses])
        d["stress_weight"] = np.array([float(s is not None) for s in stresses])
    for key, name in (("U", energy_key), ("F", forces_key)):
        missing = ~np.asarray(labelled[key], bool)
        if missing.all():
            del d[key]
        elif missing.any():
            raise DataError(f"{path!r}: structures {np.nonzero(missing)[0][:10].tolist()} have no "
                            f"{name!r} but others do; label every structure or none.")
    d["_keys"] = {"U": energy_key, "F": forces_key, "stress": stress_key}
    return d


def check_labels(d: dict, path: str, weights: dict) -> None:
    """Every target with a weight above 0 needs its labels."""
    keys = d.get("_keys", {})
    flag = {"U": "energy", "F": "forces", "stress": "stress"}
    for target, w in weights.items():
        if w <= 0:
            continue
        if target not in d or (target == "stress" and not d.get("stress_weight", np.ones(1)).any()):
            where = (f" under the key {keys[target]!r} (choose it with --{flag[target]}_key)"
                     if target in keys else "")
            raise DataError(f"{path!r} has no {flag[target]}{where}, but --{flag[target]}_weight "
                            f"is {w}. Give labelled data or pass --{flag[target]}_weight 0.")
        bad = ~np.isfinite(d[target].reshape(len(d[target]), -1)).all(1)
        if bad.any():
            raise DataError(f"{path!r}: structures {np.nonzero(bad)[0][:10].tolist()} hold NaN "
                            f"or inf in {flag[target]}.")


def check_graph_cutoff(path: str, r_max_nm: float) -> None:
    """Graphs stored in an HDF5 file must reach the model's r_max: with a
    shorter cutoff the pairs between the two are silently left out."""
    if kind(path) != "hdf5" or not os.path.exists(path):
        return
    import h5py
    with h5py.File(path, "r") as f:
        if not all(k in f for k in GRAPH_KEYS):
            return
        cutoff = f.attrs.get("graph_cutoff_nm")
    if cutoff is None:
        raise DataError(f"{path!r} holds graphs without their cutoff (attribute graph_cutoff_nm); "
                        f"write it again with chemtrain-convert ... --graph-cutoff "
                        f"{r_max_nm:g} (nm).")
    if float(cutoff) < r_max_nm * (1 - 1e-6):
        raise DataError(
            f"{path!r} holds graphs built to {float(cutoff) / LENGTH:g} Å, shorter than the "
            f"model's r_max {r_max_nm / LENGTH:g} Å: the pairs in between would be left out. "
            f"Write the file again with chemtrain-convert ... --graph-cutoff {r_max_nm:g} "
            f"(nm), or train with --r_max {float(cutoff) / LENGTH:g}.")


def outliers(d: dict, rows=None) -> list[str]:
    """Structures whose energy per atom (after the best per-element offsets
    of this set) or largest force is an absurd outlier: more than 25 robust
    standard deviations from the median and above 1 eV/atom, or a force
    above 50 eV/Å and 25 times the median atom's. Returns one description
    per outlier (the row in its file from ``rows``)."""
    rows = np.arange(len(d["R"])) if rows is None else np.asarray(rows)
    return [f"structure {int(rows[i])} ({'; '.join(v)})" for i, v in outlier_rows(d).items()]


def outlier_rows(d: dict) -> dict:
    """``{row: [reasons]}`` of the outliers of :func:`outliers`, in row order."""
    mask = d["mask"].astype(bool)
    n = np.maximum(mask.sum(1), 1)
    found = {}
    if "U" in d and len(d["R"]) >= 3:
        z = np.unique(d["species"][mask])
        counts = np.stack([((d["species"] == k) & mask).sum(1) for k in z], 1).astype(float)
        e = d["U"] / ENERGY
        fit, *_ = np.linalg.lstsq(counts, e, rcond=None)
        per_atom = (e - counts @ fit) / n
        med = np.median(per_atom)
        spread = 1.4826 * np.median(np.abs(per_atom - med))
        bad = np.abs(per_atom - med) > max(25 * spread, 1.0)
        for i in np.nonzero(bad)[0]:
            found.setdefault(i, []).append(
                f"energy {e[i]:.6g} eV, {per_atom[i] - med:+.3g} eV/atom from the median")
    if "F" in d:
        norms = np.where(mask, np.linalg.norm(d["F"], axis=-1), 0.0) / FORCE
        typical = np.median(norms[mask]) if mask.any() else 0.0
        big = norms.max(1)
        for i in np.nonzero((big > 50.0) & (big > 25 * typical))[0]:
            found.setdefault(i, []).append(f"a force of {big[i]:.4g} eV/Å")
    return {int(i): v for i, v in sorted(found.items())}


def check_force_scale(d: dict, path: str, log) -> None:
    """Warn about forces too large for eV/Å (labels in kJ/mol or kcal/mol)."""
    if "F" not in d:
        return
    mask = d["mask"].astype(bool)
    rms = float(np.sqrt(np.mean(d["F"][mask] ** 2))) / FORCE
    if rms > 10.0:
        log.warning(f"Warning: the forces of {path!r} have an RMS component of {rms:.3g} eV/Å; "
                    f"training sets are usually below a few eV/Å. chemtrain-finetune reads "
                    f"energies in eV and forces in eV/Å: labels in kJ/mol (x96.5) or kcal/mol "
                    f"(x23.1) must be converted first.")


def fingerprint(d: dict) -> str:
    """A checksum of a set's structures and labels."""
    import hashlib
    h = hashlib.sha256()
    for k in ("R", "species", "mask", "U", "F", "box", "stress"):
        if k in d:
            h.update(k.encode())
            h.update(np.ascontiguousarray(d[k]).tobytes())
    return h.hexdigest()[:16]


def concatenate(sets: list) -> dict:
    """Raw sets one after another, per-atom arrays padded to the largest
    structure (``mask`` False on padding); a cell, stress or periodicity
    that only some sets have is zero, unlabelled or derived for the others."""
    n_atoms = max(s["R"].shape[1] for s in sets)
    keys = set().union(*(s.keys() for s in sets)) - {"_keys"}

    def part(s, k):
        n = len(s["R"])
        if k == "pbc" and k not in s:   # a set without 'pbc' is periodic where it has a cell
            cell = (s["box"] != 0).any(axis=(1, 2)) if "box" in s else np.zeros(n, bool)
            return np.repeat(cell[:, None], 3, axis=1)
        if k not in s:
            if k == "box" or k == "stress":
                return np.zeros((n, 3, 3))
            if k == "stress_weight":
                return np.zeros(n)
            raise DataError(f"One data set has {k!r} and another has not; label every set alike.")
        v = s[k]
        if k in ("R", "F", "species", "mask") and v.shape[1] < n_atoms:
            pad = [(0, 0), (0, n_atoms - v.shape[1])] + [(0, 0)] * (v.ndim - 2)
            v = np.pad(v, pad)
        return v
    out = {k: np.concatenate([part(s, k) for s in sets]) for k in keys}
    out["_keys"] = sets[0].get("_keys", {})
    return out


def take(d: dict, rows) -> dict:
    rows = np.asarray(rows)
    return {k: (v[rows] if isinstance(v, np.ndarray) else v) for k, v in d.items()}


def split(n: int, args, has_valid_file: bool, has_test_file: bool) -> dict:
    """Rows of the training file per stage: a fixed random permutation
    (``--seed``), test rows first taken, then validation, then training."""
    def count(number, fraction, flag):
        if number is not None:
            return int(number)
        if not 0.0 <= fraction < 1.0:
            raise DataError(f"--{flag}_fraction must be in [0, 1), got {fraction}.")
        return int(round(fraction * n))
    n_test = 0 if has_test_file else count(args.n_test, args.test_fraction, "test")
    n_valid = 0 if has_valid_file else count(args.n_valid, args.valid_fraction, "valid")
    n_train = n - n_test - n_valid if args.n_train is None else int(args.n_train)
    if min(n_test, n_valid) < 0 or n_train < 1 or n_train + n_valid + n_test > n:
        raise DataError(f"{n_train} training + {n_valid} validation + {n_test} test structures "
                        f"are asked for, but {args.train_file!r} holds {n}; ask for fewer "
                        f"(--n_train, --n_valid, --n_test, --valid_fraction, --test_fraction).")
    order = np.random.default_rng(args.seed).permutation(n)
    return {"testing": order[:n_test], "validation": order[n_test:n_test + n_valid],
            "training": order[n_test + n_valid:n_test + n_valid + n_train]}


def to_model_arrays(d: dict, r_max_nm: float, dtype, energy_weighting: bool) -> dict:
    """A set ready for the trainer: graphs, the training precision, the
    per-structure energy weight 1/N^2 (a per-atom energy loss, as
    mace-torch's), and only the keys the trainer should see."""
    if not all(k in d for k in GRAPH_KEYS):
        d = add_graphs(d, r_max_nm)
    out = {k: d[k] for k in KEEP if k in d}
    out = {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in out.items()}
    if energy_weighting and "U" in out:
        out["U_weight"] = (1.0 / np.maximum(d["natoms"], 1) ** 2).astype(dtype)
    return out


def share_shapes(sets: list) -> list:
    """Sets ready for the trainer, padded to common shapes (the most atoms
    and edges of any, the widest shift type), so that one compiled model
    evaluates all of them: validation, test and predictions then share a
    program instead of compiling one per set. Padded atoms are masked,
    padded edges point at the sentinel (the padded atom count)."""
    sets = [d for d in sets if d is not None]
    if not sets or not all(k in d for d in sets for k in GRAPH_KEYS):
        return sets
    atoms = max(d["R"].shape[1] for d in sets)
    edges = max(d["senders"].shape[1] for d in sets)
    shift = np.result_type(*(d["shifts"].dtype for d in sets))
    for d in sets:
        n, a, e = len(d["R"]), d["R"].shape[1], d["senders"].shape[1]
        for k in ("R", "F", "species", "mask"):
            if k in d and a < atoms:
                d[k] = np.pad(d[k], [(0, 0), (0, atoms - a)] + [(0, 0)] * (d[k].ndim - 2))
        for k in ("senders", "receivers"):
            v = np.where(d[k] == a, atoms, d[k]).astype(d[k].dtype)   # the sentinel moves
            d[k] = np.concatenate([v, np.full((n, edges - e), atoms, v.dtype)], axis=1)
        d["shifts"] = np.concatenate([d["shifts"].astype(shift),
                                      np.zeros((n, edges - e, 3), shift)], axis=1)
    return sets


def mean_pairs(d: dict) -> float:
    """Average number of neighbors per real atom (from the graphs)."""
    real = d["receivers"] < d["R"].shape[1]
    return float(real.sum() / max(d["mask"].sum(), 1))
