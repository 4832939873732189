"""SevenNet-0 on a materials set: EMT copper, gold and their alloys, bulk
and (111) slabs; zero-shot, fine-tuned, and against a MACE trained from
scratch on the same data.

    python examples/nequip/sevennet_cuau.py                  # about 5 min on 2 cores

The structures are those of ``examples/uncertainty/active_learning.py``
(ASE's EMT labels, eV and Angstrom): 40 for training, 8 for validation and
40 for testing, ten of each kind per 40. Two thin calls of
``chemtrain-finetune`` write ``sevennet/`` (SevenNet-0 from the ``sevenn``
package, ``--E0s estimated``, learning rate 1e-3) and ``mace/`` (a random
MACE of the active-learning example's size), and ``comparison.json`` the
test errors; each job's ``parity.png`` plots its model before and after.
EMT is not DFT: the zero-shot errors measure how far SevenNet-0's PBE
potential is from EMT's, and fine-tuning how fast it adapts. Covered in the
test suite by ``tests/finetune/test_nequip_job.py``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "uncertainty"))
from active_learning import KINDS, SIZES, labelled  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10, help="epochs of both models")
    p.add_argument("--out", default="runs/sevennet_cuau", help="results folder")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    # chemtrain's progress (one line per epoch) on stdout, as chemtrain-finetune shows it
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("chemtrain").setLevel(logging.INFO)
    import ase.io
    from chemtrain.finetune import run
    os.makedirs(args.out, exist_ok=True)
    files = {}
    for name, n, seed in (("train", 48, 1), ("test", 40, 2)):
        files[name] = os.path.join(args.out, f"{name}.xyz")
        ase.io.write(files[name], labelled(list(KINDS) * (n // len(KINDS)), seed), format="extxyz")
    common = ["--train_file", files["train"], "--test_file", files["test"], "--n_valid", "8",
              "--batch_size", "4", "--max_num_epochs", str(args.epochs), "--seed", "0"]
    seven = run([*common, "--foundation_model", "sevennet-0", "--trust_foundation_model",
                 "--E0s", "estimated", "--lr", "1e-3",
                 "--results_dir", os.path.join(args.out, "sevennet")])
    mace = run([*common, *SIZES, "--lr", "0.01", "--results_dir", os.path.join(args.out, "mace")])
    table = {"SevenNet-0, zero-shot": seven["before"], "SevenNet-0, fine-tuned": seven["after"],
             "MACE from scratch": mace["after"]}
    with open(os.path.join(args.out, "comparison.json"), "w") as f:
        json.dump(table, f, indent=1)
    for name, row in table.items():
        print(f"{name:24s} energy MAE {row['energy_eV_per_atom']['MAE']:.4g} eV/atom, force "
              f"MAE {row['force_eV_per_A']['MAE']:.4g} RMSE {row['force_eV_per_A']['RMSE']:.4g} "
              f"eV/Å")
    return 0


if __name__ == "__main__":
    sys.exit(main())
