"""Command-line flags of ``chemtrain-finetune``.

Where a flag means what it means in mace-torch's ``mace_run_train``, it has
mace-torch's name and default meaning (``--train_file``, ``--energy_key``,
``--foundation_model``, ``--E0s``, ``--energy_weight``, ``--forces_weight``,
``--stress_weight``, ``--num_channels``, ``--max_L``, ``--max_ell``,
``--correlation``, ``--r_max``, ``--batch_size``, ``--max_num_epochs``,
``--lr``, ``--restart_latest``, ...). chemtrain's own flags (``--n_train``,
``--parallelism``, ``--trust_foundation_model``, ...) say so in their help.
"""
from __future__ import annotations

import argparse
import ast
import math
import os
import re


def _number(kind, low, low_open, high=None, high_open=True, what=""):
    """An argparse type: a finite ``kind`` within the bounds, else an error
    naming the accepted range (argparse adds the flag's name)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        bad = not math.isfinite(value) or value < low or (low_open and value == low)
        if high is not None:
            bad = bad or value > high or (high_open and value == high)
        if bad:
            lo = f"{'>' if low_open else '>='} {low}"
            hi = "" if high is None else f" and {'<' if high_open else '<='} {high}"
            raise argparse.ArgumentTypeError(f"must be {lo}{hi}{what}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _widths(text):
    """``--radial_MLP``: a list of layer widths such as ``[64, 64, 64]``."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in value)):
        raise argparse.ArgumentTypeError(
            f"must be a list of whole numbers >= 1 (the widths of the radial MLP's hidden "
            f"layers) such as '[64, 64, 64]', got {text!r}")
    return [int(w) for w in value]


_widths.__name__ = "list"


def _scalar_irreps(text):
    """``--MLP_irreps``: the readout's hidden scalars, e.g. ``16x0e``."""
    m = re.fullmatch(r"\s*(\d+)x0e\s*", text)
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(
            f"must be scalar irreps 'Nx0e' with N >= 1 (the last readout's hidden features, "
            f"gated by SiLU), such as '16x0e', got {text!r}")
    return f"{int(m.group(1))}x0e"


_scalar_irreps.__name__ = "irreps"


def _file_name(text):
    """``--name``: a file name inside ``--results_dir``, not a path."""
    seps = [s for s in (os.sep, os.altsep) if s]
    if not text.strip() or text in (".", "..") or any(s in text for s in seps):
        raise argparse.ArgumentTypeError(
            f"is the file name of the written models inside --results_dir (e.g. 'cu_mace'), "
            f"not a path; got {text!r}. Choose the folder with --results_dir")
    return text


_file_name.__name__ = "name"

_POSITIVE = _number(float, 0.0, True)
_WEIGHT = _number(float, 0.0, False, what=" (0 leaves that target out)")
_FRACTION = _number(float, 0.0, False, 1.0, True)
_COUNT = _number(int, 0, False)
_AT_LEAST_ONE = _number(int, 1, False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chemtrain-finetune",
        description="Train or fine-tune a MACE potential on energies, forces and stresses with "
                    "chemtrain (JAX), from one CPU to many GPUs or MPI ranks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    g = p.add_argument_group("data")
    g.add_argument("--train_file", required=True,
                   help="extxyz (or any file ASE reads), MD22/sGDML .npz, or chemtrain HDF5 (.h5)")
    g.add_argument("--valid_file", help="validation set (default: taken from --train_file)")
    g.add_argument("--test_file", help="test set (default: taken from --train_file with "
                                       "--n_test/--test_fraction, else none)")
    g.add_argument("--valid_fraction", type=_FRACTION, default=0.1,
                   help="fraction of --train_file used for validation (without --valid_file)")
    g.add_argument("--test_fraction", type=_FRACTION, default=0.0,
                   help="chemtrain: fraction of --train_file held out for testing")
    g.add_argument("--n_train", type=_AT_LEAST_ONE, help="chemtrain: number of training structures "
                                              "(default: all that remain)")
    g.add_argument("--n_valid", type=_COUNT, help="chemtrain: number of validation structures "
                                              "(instead of --valid_fraction)")
    g.add_argument("--n_test", type=_COUNT, help="chemtrain: number of test structures "
                                             "(instead of --test_fraction)")
    g.add_argument("--energy_key", default="REF_energy",
                   help="extxyz key of reference energies (eV); 'energy' reads ASE's own")
    g.add_argument("--forces_key", default="REF_forces",
                   help="extxyz key of reference forces (eV/A); 'forces' reads ASE's own")
    g.add_argument("--stress_key", default="REF_stress",
                   help="extxyz key of reference stresses (eV/A^3, ASE's sign); 'stress' reads "
                        "ASE's own")
    g.add_argument("--allow_outliers", action="store_true",
                   help="chemtrain: train on structures whose energy per atom or forces are "
                        "absurd outliers (refused by default, naming them)")
    g = p.add_argument_group("model")
    g.add_argument("--foundation_model",
                   help="start from a mace-torch .model file or a chemtrain MACE .npz "
                        "(default: a randomly initialised MACE of the size below)")
    g.add_argument("--trust_foundation_model", action="store_true",
                   help="chemtrain: a .model file is a pickle that can run code; read it only "
                        "from a source you trust")
    g.add_argument("--E0s", default="average",
                   help="'average' (least squares of the training energies on the element "
                        "counts, as mace-torch), 'foundation' (keep the foundation model's), or "
                        "a dict such as '{1: -13.6, 6: -1027.6}' (eV)")
    g.add_argument("--num_channels", type=_AT_LEAST_ONE, default=8, help="channels of the hidden features")
    g.add_argument("--max_L", type=int, default=0, help="highest L of the hidden features")
    g.add_argument("--max_ell", type=int, default=1, help="highest l of the spherical harmonics")
    g.add_argument("--correlation", type=int, default=2, help="correlation order of each layer")
    g.add_argument("--r_max", type=_POSITIVE, default=4.0, help="cutoff (Angstrom)")
    g.add_argument("--num_interactions", type=int, default=2)
    g.add_argument("--num_radial_basis", type=int, default=10)
    g.add_argument("--num_cutoff_basis", type=int, default=5)
    g.add_argument("--radial_MLP", type=_widths, default="[64, 64, 64]",
                   help="widths of the radial MLP")
    g.add_argument("--MLP_irreps", type=_scalar_irreps, default="16x0e",
                   help="hidden irreps of the last readout")
    g = p.add_argument_group("training")
    g.add_argument("--energy_weight", type=_WEIGHT, default=1.0,
                   help="weight of the squared energy error per atom (eV^2), as mace-torch's "
                        "'weighted' loss")
    g.add_argument("--forces_weight", type=_WEIGHT, default=1.0,
                   help="weight of the squared force-component error ((eV/A)^2)")
    g.add_argument("--stress_weight", type=_WEIGHT, default=0.0,
                   help="weight of the squared stress-component error ((eV/A^3)^2)")
    g.add_argument("--batch_size", type=_AT_LEAST_ONE, default=2, help="structures per step, over all "
                                                             "devices and ranks")
    g.add_argument("--max_num_epochs", type=_COUNT, default=10, help="epochs in all (a resumed "
                                                                  "run continues up to this)")
    g.add_argument("--lr", type=_POSITIVE, default=0.01, help="peak learning rate (Adam, cosine "
                                                          "decay to 5 %% of it)")
    g.add_argument("--seed", type=int, default=0, help="split, initialisation and batch order")
    g.add_argument("--ensemble_size", type=_AT_LEAST_ONE, default=1,
                   help="chemtrain: train a committee of this many models in one vectorised "
                        "step (chemtrain.trainers.EnsembleOfModels); each member starts from "
                        "its own initialisation (seed + k) and batch order, and is written as "
                        "<name>_member<k>; chemtrain-select picks structures by their spread")
    g.add_argument("--ensemble_bootstrap", action="store_true",
                   help="chemtrain: train each member on its own bootstrap sample of the "
                        "training set")
    g.add_argument("--default_dtype", default="float32", choices=["float32", "float64"])
    g.add_argument("--parallelism", default="auto", choices=["auto", "single", "jax", "mpi"],
                   help="chemtrain: how the batch is split (see chemtrain.parallel)")
    g = p.add_argument_group("output")
    g.add_argument("--results_dir", default="runs/finetune",
                   help="metrics.jsonl, parity.png, results.json, checkpoints/, the models")
    g.add_argument("--name", type=_file_name, default="model",
                   help="file name of the written models (inside --results_dir)")
    g.add_argument("--restart_latest", "--resume", dest="restart_latest", action="store_true",
                   help="continue from the last checkpoint in --results_dir")
    g.add_argument("--checkpoint_every", type=_AT_LEAST_ONE, default=5, help="chemtrain: epochs between "
                                                                   "checkpoints")
    g.add_argument("--no_torch_export", action="store_true",
                   help="chemtrain: do not write the mace-torch .model (needs torch)")
    g.add_argument("--jax_cache", help="chemtrain: folder for JAX's persistent compilation cache")
    del a
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def given(argv, dests) -> set:
    """Which of the flags ``dests`` (argparse destinations) ``argv`` sets
    (abbreviations included), as opposed to their defaults."""
    unset = object()  # argparse leaves attributes the namespace already has unless given
    args = parser().parse_args(argv, namespace=argparse.Namespace(**{d: unset for d in dests}))
    return {d for d in dests if getattr(args, d) is not unset}
