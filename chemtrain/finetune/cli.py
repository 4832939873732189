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


def _frozen(text):
    """``--freeze``: block names separated by commas, or mace-torch's number."""
    text = text.strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    names = [n.strip() for n in text.split(",")]
    if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", n) for n in names):
        raise argparse.ArgumentTypeError(
            f"must be block names separated by commas, such as 'embedding,interactions.0', "
            f"or a whole number as in mace-torch, got {text!r}")
    return names


_frozen.__name__ = "blocks"


def _bool(text):
    """mace-torch's booleans: True/False, yes/no, 1/0."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False,
             "0": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be True or False, got {text!r}")
    return value


_bool.__name__ = "bool"

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
    g.add_argument("--model", default="MACE", choices=["MACE", "NequIP"],
                   help="chemtrain: the architecture of a new model (without "
                        "--foundation_model): MACE, or NequIP as SevenNet builds it")
    g.add_argument("--foundation_model",
                   help="start from a mace-torch .model file, a SevenNet checkpoint (.pth, or "
                        "a name such as 'sevennet-0' for the one in the sevenn package) or a "
                        "chemtrain .npz (default: a randomly initialised --model of the size "
                        "below)")
    g.add_argument("--foundation_head",
                   help="the head of a --foundation_model of several heads to fine-tune "
                        "(default, as mace-torch: the first that is not 'pt_head')")
    g.add_argument("--trust_foundation_model", action="store_true",
                   help="chemtrain: a .model or .pth file is a pickle that can run code; read "
                        "it only from a source you trust")
    g.add_argument("--E0s", default="average",
                   help="'average' (least squares of the training energies on the element "
                        "counts, as mace-torch), 'foundation' (keep the foundation model's), "
                        "'estimated' (the foundation's, corrected by least squares on its energy "
                        "errors on the training set, as mace-torch), or a dict such as "
                        "'{1: -13.6, 6: -1027.6}' (eV); a NequIP's E0s are its per-element shift, "
                        "and fine-tuning one keeps them ('foundation') unless this is given")
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
    g.add_argument("--lr", type=_POSITIVE, default=0.01,
                   help="learning rate (Adam); the peak of --scheduler cosine")
    g.add_argument("--amsgrad", nargs="?", const=True, type=_bool, default=True,
                   help="Adam's AMSGrad variant (mace-torch's default, which it cannot turn "
                        "off); --amsgrad False: plain Adam")
    g.add_argument("--clip_grad", type=_number(float, 0.0, False), default=10.0,
                   help="clip the gradient to this global norm before each step, in the "
                        "units of the loss in eV and Angstrom (0: no clipping)")
    g.add_argument("--weight_decay", type=_number(float, 0.0, False), default=5e-7,
                   help="L2 penalty added to the gradient of the interactions' linear and "
                        "skip weights and of the products, as mace-torch's Adam")
    g.add_argument("--scheduler", default="cosine",
                   choices=["cosine", "ReduceLROnPlateau", "ExponentialLR", "constant"],
                   help="learning-rate schedule: chemtrain's 'cosine' (decay to 5 %% of --lr "
                        "over the run; mace-torch's default is ReduceLROnPlateau, which keeps "
                        "--lr constant for runs shorter than --scheduler_patience epochs), "
                        "'ReduceLROnPlateau' (times --lr_factor after --scheduler_patience "
                        "epochs without a better validation loss), 'ExponentialLR' (times "
                        "--lr_scheduler_gamma per epoch) or 'constant'")
    g.add_argument("--lr_factor", type=_number(float, 0.0, True, 1.0, True), default=0.8,
                   help="ReduceLROnPlateau's factor")
    g.add_argument("--scheduler_patience", type=_COUNT, default=50,
                   help="ReduceLROnPlateau's epochs without improvement")
    g.add_argument("--lr_scheduler_gamma", type=_number(float, 0.0, True, 1.0, False),
                   default=0.9993, help="ExponentialLR's factor per epoch")
    g.add_argument("--patience", type=_AT_LEAST_ONE, default=2048,
                   help="stop after this many epochs in a row without a better validation loss "
                        "(the exported model is the best epoch's unless --export_model last)")
    g.add_argument("--ema", action="store_true",
                   help="evaluate, keep and export an exponential moving average of the weights")
    g.add_argument("--ema_decay", type=_number(float, 0.0, False, 1.0, True), default=0.99,
                   help="decay of --ema per step (warmed up as mace-torch's: min(decay, "
                        "(1 + n) / (10 + n)) at step n)")
    g.add_argument("--loss", default="weighted", choices=["weighted", "huber", "universal"],
                   help="'weighted': squared errors (energy per atom, forces, stress) times "
                        "their weights; 'huber': Huber's loss with --huber_delta on each; "
                        "'universal': as 'huber', but the force threshold shrinks for atoms "
                        "whose reference force exceeds 100, 200, 300 eV/A (mace-torch's)")
    g.add_argument("--huber_delta", type=_POSITIVE, default=0.01,
                   help="threshold of 'huber' and 'universal' (eV/atom, eV/A, eV/A^3)")
    g.add_argument("--swa", "--stage_two", dest="swa", action="store_true",
                   help="stage two: from epoch --start_swa on, train with --swa_lr and the "
                        "--swa_*_weight loss weights (mace-torch's, formerly called SWA); the "
                        "best model is then the best of stage two")
    g.add_argument("--start_swa", "--start_stage_two", dest="start_swa", type=_COUNT,
                   default=None, help="first epoch of stage two (default: 3/4 of "
                                      "--max_num_epochs, as mace-torch)")
    g.add_argument("--swa_lr", "--stage_two_lr", dest="swa_lr", type=_POSITIVE, default=1e-3,
                   help="constant learning rate of stage two")
    g.add_argument("--swa_energy_weight", "--stage_two_energy_weight", dest="swa_energy_weight",
                   type=_WEIGHT, default=1000.0, help="energy weight of stage two")
    g.add_argument("--swa_forces_weight", "--stage_two_forces_weight", dest="swa_forces_weight",
                   type=_WEIGHT, default=100.0, help="forces weight of stage two")
    g.add_argument("--swa_stress_weight", "--stage_two_stress_weight", dest="swa_stress_weight",
                   type=_WEIGHT, default=10.0, help="stress weight of stage two (used when "
                                                    "--stress_weight trains stresses)")
    g.add_argument("--freeze", type=_frozen, default=None,
                   help="keep blocks of the model fixed: names such as 'embedding,"
                        "interactions.0,products.0' (a MACE's blocks: embedding, "
                        "interactions.<t>, products.<t>, readouts.<t>), or mace-torch's "
                        "number: >= 1 the embedding, >= 5 also the interactions, >= 6 also "
                        "the products, >= 7 also the readouts")
    g.add_argument("--seed", type=int, default=0, help="split, initialisation and batch order")
    g.add_argument("--ensemble_size", type=_AT_LEAST_ONE, default=1,
                   help="chemtrain: train a committee of this many models in one vectorised "
                        "step (chemtrain.trainers.EnsembleOfModels); each member starts from "
                        "its own initialisation (seed + k) and batch order, and is written as "
                        "<name>_member<k>; chemtrain-select picks structures by their spread")
    g.add_argument("--member_models", nargs="+", metavar="NPZ",
                   help="chemtrain: continue a committee: member k starts from the k-th of "
                        "these chemtrain .npz files of one architecture (e.g. the "
                        "<name>_member<k>.npz of an earlier run), instead of a "
                        "--foundation_model or a random model; --ensemble_size is their number")
    g.add_argument("--ensemble_bootstrap", action="store_true",
                   help="chemtrain: train each member on its own bootstrap sample of the "
                        "training set")
    g.add_argument("--default_dtype", default="float32", choices=["float32", "float64"])
    g.add_argument("--parallelism", default="auto", choices=["auto", "single", "jax", "mpi"],
                   help="chemtrain: how the batch is split (see chemtrain.parallel)")
    g = p.add_argument_group("replay (multi-head) fine-tuning")
    g.add_argument("--multiheads_finetuning", type=_bool, default=True,
                   help="with --foundation_model and --pt_train_file: train a second readout "
                        "head ('Default') on the new data while the foundation's head "
                        "('pt_head') keeps fitting the replayed pretraining data through the "
                        "shared layers")
    g.add_argument("--pt_train_file",
                   help="the foundation model's (pretraining) data to replay, extxyz or npz")
    g.add_argument("--weight_pt_head", type=_WEIGHT, default=1.0,
                   help="loss weight of the replayed structures")
    g.add_argument("--real_pt_data_ratio_threshold", type=_POSITIVE, default=0.1,
                   help="repeat the fine-tuning structures when they are fewer than this "
                        "fraction of the replayed ones")
    g.add_argument("--force_mh_ft_lr", type=_bool, default=False,
                   help="keep --lr, --ema and --loss in replay fine-tuning (otherwise, as "
                        "mace-torch: learning rate 1e-4, EMA 0.99999, the 'universal' loss)")
    g = p.add_argument_group("output")
    g.add_argument("--results_dir", default="runs/finetune",
                   help="metrics.jsonl, parity.png, results.json, checkpoints/, the models")
    g.add_argument("--name", type=_file_name, default="model",
                   help="file name of the written models (inside --results_dir)")
    g.add_argument("--restart_latest", "--resume", dest="restart_latest", action="store_true",
                   help="continue from the last checkpoint in --results_dir")
    g.add_argument("--checkpoint_every", type=_AT_LEAST_ONE, default=5, help="chemtrain: epochs between "
                                                                   "checkpoints")
    g.add_argument("--export_model", default="best", choices=["best", "last"],
                   help="chemtrain: write (and test) the model of the epoch with the lowest "
                        "validation loss, as mace-torch does, or the last epoch's")
    g.add_argument("--no_torch_export", action="store_true",
                   help="chemtrain: do not write the mace-torch .model (needs torch)")
    g.add_argument("--jax_cache", help="chemtrain: folder for JAX's persistent compilation cache "
                                       "(default: $CHEMTRAIN_JAX_CACHE, else "
                                       "~/.cache/chemtrain/jax; 'off' turns it off)")
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
