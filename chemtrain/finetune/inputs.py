"""The data sets of a ``chemtrain-finetune`` job: reading and splitting the
training, validation and test sets, and the checks made on them before
anything is trained (absurd outliers, force scale, edges within r_max).
"""
from __future__ import annotations

import logging
import os

from . import data as D
from .data import DataError

log = logging.getLogger("chemtrain")


def load_sets(args, weights):
    """(sets, rows, hdf5): ``sets`` hold the raw training structures (for an
    HDF5 training file: its training rows, read for statistics only) and the
    validation and test sets (None where there are none); ``rows`` the split
    of the training file; ``hdf5`` whether training reads from that file."""
    path = args.train_file
    hdf5 = D.kind(path) == "hdf5"
    if hdf5:
        import h5py
        if not os.path.exists(path):
            raise DataError(f"{path!r} does not exist.")
        with h5py.File(path, "r") as f:
            n = len(f["R"])
    else:
        full = D.read(path, args.energy_key, args.forces_key, args.stress_key)
        D.check_labels(full, path, weights)
        n = len(full["R"])
    rows = D.split(n, args, args.valid_file is not None, args.test_file is not None)
    pick = (lambda r: D.read_hdf5(path, r)) if hdf5 else (lambda r: D.take(full, r))
    sets = {"training": pick(rows["training"])}
    if hdf5:
        D.check_labels(sets["training"], path, weights)
    for stage, flag in (("validation", args.valid_file), ("testing", args.test_file)):
        if flag:
            sets[stage] = D.read(flag, args.energy_key, args.forces_key, args.stress_key)
            D.check_labels(sets[stage], flag, weights)
        else:
            sets[stage] = pick(rows[stage]) if len(rows[stage]) else None
    return sets, rows, hdf5


def check_plausible(args, sets: dict, rows: dict) -> None:
    """Refuse absurd outliers (unless --allow_outliers) and warn about forces
    too large for eV/Å."""
    files = {"training": args.train_file, "validation": args.valid_file or args.train_file,
             "testing": args.test_file or args.train_file}
    found = []
    for stage, d in sets.items():
        if d is None:
            continue
        from_file = (stage == "validation" and args.valid_file) or (stage == "testing"
                                                                    and args.test_file)
        for text in D.outliers(d, None if from_file else rows[stage]):
            found.append(f"{files[stage]!r} {text}")
    if found and not args.allow_outliers:
        raise DataError(f"{len(found)} structure(s) are absurd outliers and would wreck the fit: "
                        f"{'; '.join(found[:5])}{' ...' if len(found) > 5 else ''}. Remove them "
                        f"(overlapping atoms? a failed calculation?), or pass --allow_outliers to "
                        f"train on them anyway.")
    D.check_force_scale(sets["training"], args.train_file, log)


def check_edges(sample: dict, r_max: float, foundation: bool) -> None:
    if D.mean_pairs(sample) == 0:
        whose = "the foundation model's r_max" if foundation else "--r_max"
        raise DataError(f"No atom of the first {len(sample['R'])} training structures has a "
                        f"neighbour within {whose} = {r_max:g} Å, so the model would see no "
                        f"edges. --r_max is in Å (as mace-torch's), typically 4-6; a value in "
                        f"nm must be multiplied by 10.")
