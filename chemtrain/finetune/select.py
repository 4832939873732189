"""``chemtrain-select``: the structures of a pool a committee is least sure
about, to label next (active learning).

    chemtrain-finetune --train_file seed.xyz --ensemble_size 4 --results_dir runs/c
    chemtrain-select --model_dir runs/c --pool pool.xyz --n 20 --out picked.xyz

The committee is the members ``chemtrain-finetune --ensemble_size K`` wrote
(``results.json``'s ``members_npz``, or every ``*_member<k>.npz`` of
``--model_dir``), or the files given with ``--models``. Each picked
structure is written with ``pool_index`` (its index in the pool) and
``committee_forces_std`` (its score, eV/Angstrom) in its info; the indices
are printed, most uncertain first.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from .cli import _AT_LEAST_ONE
from .data import DataError

__all__ = ["main", "members_of"]


def parser() -> argparse.ArgumentParser:
    from ..uncertainty import SCORES
    p = argparse.ArgumentParser(prog="chemtrain-select", description=__doc__.split("\n\n")[0])
    p.add_argument("--model_dir", help="a chemtrain-finetune --ensemble_size results folder")
    p.add_argument("--models", nargs="+", help="the members' chemtrain .npz files instead")
    p.add_argument("--pool", required=True, help="candidate structures (extxyz or any file ASE "
                                                 "reads)")
    p.add_argument("--n", type=_AT_LEAST_ONE, required=True, help="how many to pick")
    p.add_argument("--out", required=True, help="where to write the picked structures (extxyz)")
    p.add_argument("--head", help="the head of members of several heads (default, as "
                                  "mace-torch's calculator: the one named 'Default')")
    p.add_argument("--by", default="forces_std", choices=SCORES,
                   help="the score: the largest atom's force spread (default), the mean over "
                        "atoms, or the energy spread per atom")
    return p


def members_of(model_dir: str) -> list[str]:
    """The member files of a ``chemtrain-finetune --ensemble_size`` folder.

    Args:
      model_dir: the folder.

    Returns:
      The paths, in member order: ``results.json``'s ``members_npz`` where
      it lists them, else every ``*_member<k>.npz`` of the folder. Listed
      members are always read from ``model_dir`` itself (by file name), so
      a copied or moved folder reads its own members, never the files at
      the path the run was written to (older ``results.json`` files hold
      absolute paths).

    Raises:
      DataError: the folder does not exist or holds no committee, or a
        member ``results.json`` lists is not in it.
    """
    if not os.path.isdir(model_dir):
        raise DataError(f"--model_dir {model_dir!r} is not a folder.")
    record = os.path.join(model_dir, "results.json")
    if os.path.exists(record):
        with open(record) as f:
            listed = json.load(f).get("members_npz")
        if listed:
            here = [os.path.join(model_dir, os.path.basename(p)) for p in listed]
            missing = [os.path.basename(p) for p in here if not os.path.exists(p)]
            if missing:
                raise DataError(f"{record!r} lists the members {missing}, which are not in "
                                f"--model_dir {model_dir!r} (a copy of the folder without its "
                                f"models?). Copy them in, or give the files with --models.")
            return here
    found = glob.glob(os.path.join(model_dir, "*_member*.npz"))
    found.sort(key=lambda p: int(re.search(r"_member(\d+)\.npz$", p).group(1))
               if re.search(r"_member(\d+)\.npz$", p) else -1)
    if len(found) < 2:
        raise DataError(f"--model_dir {model_dir!r} holds no committee (no results.json listing "
                        f"members, fewer than two *_member<k>.npz files): train one with "
                        f"chemtrain-finetune --ensemble_size K, or give --models.")
    return found


def run(argv=None) -> list[int]:
    """Pick and write the structures; return their pool indices.

    Raises:
      DataError: no committee, members of different architectures, a pool
        ASE cannot read or with a structure without atoms, ``--n`` larger
        than the pool, an ``--out`` that exists.
    """
    args = parser().parse_args(argv)
    import ase.io
    import numpy as np
    from ..uncertainty import as_frames, check_informative, rank, scores
    if bool(args.model_dir) == bool(args.models):
        raise DataError("Give the committee either as --model_dir or as --models, not both "
                        "(nor neither).")
    paths = args.models or members_of(args.model_dir)
    if len(paths) < 2:
        raise DataError(f"A committee needs at least 2 members, --models gives {len(paths)}.")
    real = [os.path.realpath(p) for p in paths]
    twice = sorted({p for p, r in zip(paths, real) if real.count(r) > 1})
    if twice:
        raise DataError(f"The committee holds the same file more than once ({twice}): its "
                        f"members would agree everywhere. Give each member's file once.")
    if os.path.exists(args.out):
        raise DataError(f"--out {args.out!r} exists; choose a new file (nothing is written over).")
    try:
        from .family import committee_of
        committee = committee_of(paths, args.head)
        frames = as_frames(args.pool, f"pool {args.pool!r}")
    except (ValueError, FileNotFoundError) as e:
        raise DataError(str(e)) from e
    if args.n > len(frames):
        raise DataError(f"--n {args.n} is more than the pool's {len(frames)} structures.")
    score = scores(committee, frames, args.by)
    try:
        check_informative(score, args.by)
    except ValueError as e:
        raise DataError(str(e)) from None
    picked = rank(score, args.n)
    out = []
    for i in picked:
        atoms = frames[int(i)].copy()
        atoms.info.update(pool_index=int(i), **{f"committee_{args.by}": float(score[i])})
        out.append(atoms)
    ase.io.write(args.out, out, format="extxyz")
    unit = "eV/atom" if args.by == "energy_std" else "eV/A"
    print(f"Picked {len(out)} of {len(frames)} structures by {args.by} (committee of "
          f"{committee.n_members}; scores {score[picked[0]]:.4g} to {score[picked[-1]]:.4g} "
          f"{unit}, pool median {np.median(score):.4g}): {args.out}")
    print("pool indices:", " ".join(str(int(i)) for i in picked))
    return [int(i) for i in picked]


def main(argv=None) -> int:
    """Console entry point: :func:`run`, a :class:`DataError` printed as one
    line with exit code 2."""
    try:
        run(argv)
    except DataError as e:
        print(f"chemtrain-select: error: {e}", file=sys.stderr)
        return 2
    return 0
