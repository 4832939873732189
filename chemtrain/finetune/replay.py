"""Replay (multi-head) fine-tuning in ``chemtrain-finetune``, as mace-torch's
``--multiheads_finetuning True --pt_train_file FILE``.

The foundation model's head becomes ``pt_head`` (index 0, with the
foundation's E0s) and a new head ``Default`` (index 1) starts as a copy of
its readout with the E0s of ``--E0s``. Every training epoch mixes the
fine-tuning structures (head 1) with the structures of ``--pt_train_file``
(head 0, loss weight ``--weight_pt_head``), so the shared layers keep
fitting the pretraining data. As in mace-torch, the loss is 'universal'
(unless ``--loss`` is given), the pretraining file loses the
``int(--valid_fraction x n)`` structures it would give to validation, and when the
fine-tuning structures are fewer than ``--real_pt_data_ratio_threshold``
times the pretraining ones, they are repeated ``int(threshold / ratio)``
extra times. Validation, testing and the best model are the ``Default``
head's on the fine-tuning data.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import data as D
from .cli import given
from .data import DataError

PT_HEAD, FT_HEAD = "pt_head", "Default"


def active(args) -> bool:
    """Whether this job is a replay fine-tuning."""
    return bool(args.pt_train_file and args.multiheads_finetuning and args.foundation_model)


def check_flags(args, argv) -> None:
    """Refuse replay flags that contradict the others, before any work."""
    if args.pt_train_file and not args.foundation_model:
        raise DataError("--pt_train_file replays a foundation model's training data: give "
                        "--foundation_model too (or drop --pt_train_file).")
    if args.pt_train_file and not args.multiheads_finetuning:
        raise DataError("Contradicting flags: --pt_train_file is only read by replay "
                        "fine-tuning, but --multiheads_finetuning is False. Drop one of them.")
    set_ = given(argv, ("weight_pt_head", "real_pt_data_ratio_threshold", "force_mh_ft_lr"))
    if set_ and not active(args):
        raise DataError(f"Contradicting flags: {', '.join('--' + f for f in sorted(set_))} "
                        f"belong to replay fine-tuning (--foundation_model and "
                        f"--pt_train_file with --multiheads_finetuning True).")
    if not active(args):
        return
    if args.E0s == "average":
        raise DataError("Replay fine-tuning cannot use --E0s average (as in mace-torch): the "
                        "new head's E0s must fit the foundation's; give --E0s foundation or a "
                        "dict of atomic number -> eV.")
    if args.ensemble_size > 1:
        raise DataError("--ensemble_size with replay fine-tuning is not supported: train one "
                        "model (or a committee without --pt_train_file).")
    if D.kind(args.train_file) == "hdf5" or D.kind(args.pt_train_file) == "hdf5":
        raise DataError("Replay fine-tuning reads --train_file and --pt_train_file into memory: "
                        "give them as extxyz or npz, not HDF5.")


def mace_torch_settings(args, argv) -> str | None:
    """Apply what mace-torch sets in replay mode: the 'universal' loss
    (unless ``--loss`` is given; mace-torch switches even then), and unless
    ``--force_mh_ft_lr True`` a learning rate of 1e-4 and EMA with decay
    0.99999; return the note that says so."""
    said = []
    if "loss" not in given(argv, ("loss",)):
        args.loss = "universal"
        said.append("loss 'universal' (give --loss to choose another)")
    if not args.force_mh_ft_lr:
        said.append(f"learning rate 1e-4 (not {args.lr:g}), EMA with decay 0.99999 "
                    f"(--force_mh_ft_lr True keeps --lr and --ema)")
        args.lr, args.ema, args.ema_decay = 1e-4, True, 0.99999
    return ("Replay fine-tuning with mace-torch's settings: " + "; ".join(said) + ".") \
        if said else None


def load_pretraining(args, cfg, weights, seed: int) -> dict:
    """The replayed structures of ``--pt_train_file`` (raw set): every
    structure but a random ``--valid_fraction`` (mace-torch's split); its
    elements must be the model's."""
    pt = D.read(args.pt_train_file, args.energy_key, args.forces_key, args.stress_key)
    D.check_labels(pt, args.pt_train_file, weights)
    present = np.unique(pt["species"][pt["mask"].astype(bool)])
    missing = sorted(set(present.tolist()) - set(cfg.atomic_numbers))
    if missing:
        raise DataError(f"--pt_train_file {args.pt_train_file!r} holds atomic numbers {missing} "
                        f"that the foundation model does not know (it has "
                        f"{list(cfg.atomic_numbers)}): it cannot be the foundation's training "
                        f"data. Remove those structures.")
    n = len(pt["R"])
    keep = np.random.default_rng(seed).permutation(n)[int(args.valid_fraction * n):]
    if len(keep) == 0:
        raise DataError(f"--pt_train_file {args.pt_train_file!r} keeps no structure after "
                        f"--valid_fraction {args.valid_fraction}.")
    return D.take(pt, np.sort(keep))


def heads_model(foundation_cfg, cfg, params):
    """(cfg, params) with heads ``("pt_head", "Default")``: the foundation's
    head with its E0s, and a copy of it with the E0s of ``cfg`` (the
    fine-tuning's, from ``--E0s``)."""
    from ..models import mace
    base = dataclasses.replace(foundation_cfg, heads=(PT_HEAD,))
    e0s = dict(zip(cfg.atomic_numbers, cfg.atomic_energies))
    return mace.add_head(base, params, FT_HEAD, e0s=e0s, copy_from=0)


#: the most copies of the fine-tuning structures replay makes in an epoch
MAX_COPIES = 1000


def repeats(n_ft: int, n_pt: int, threshold: float) -> int:
    """How often replay puts each fine-tuning structure in an epoch: once,
    plus ``int(threshold / ratio)`` when the ratio ``n_ft / n_pt`` is below
    ``threshold`` (mace-torch's rule). More than :data:`MAX_COPIES` is
    refused (DataError naming the size it would give): an epoch of millions
    of copies of a few structures is a mistyped threshold, not a recipe."""
    ratio = n_ft / n_pt
    copies = 1 + (int(threshold / ratio) if ratio < threshold else 0)
    if copies > MAX_COPIES:
        raise DataError(
            f"--real_pt_data_ratio_threshold {threshold:g} would repeat the {n_ft} fine-tuning "
            f"structures {copies} times against {n_pt} replayed ones ({n_ft * copies} "
            f"structures in every epoch); at most {MAX_COPIES} copies are made. mace-torch's "
            f"default is 0.1 (fine-tuning structures at least a tenth of the replayed ones): "
            f"give a threshold below {(MAX_COPIES - 1) * ratio:.3g}, or replay fewer "
            f"structures (--pt_train_file).")
    return copies


def combine(train: dict, pt: dict, args) -> tuple[dict, str]:
    """One raw training set: the fine-tuning structures (``head`` 1, repeated
    as mace-torch repeats them) and the replayed ones (``head`` 0), with the
    per-structure loss weight ``head_weight`` (``--weight_pt_head`` on the
    replayed ones); and a note of the mix."""
    n_ft, n_pt = len(train["R"]), len(pt["R"])
    copies = repeats(n_ft, n_pt, args.real_pt_data_ratio_threshold)
    ft = D.take(train, np.tile(np.arange(n_ft), copies))
    ft["head"] = np.full(len(ft["R"]), 1, np.int32)
    pt = dict(pt, head=np.zeros(n_pt, np.int32))
    both = D.concatenate([ft, pt])
    both["head_weight"] = np.where(both["head"] == 0, args.weight_pt_head, 1.0)
    note = (f"Replay: {n_ft} fine-tuning structures{f' x {copies}' if copies > 1 else ''} "
            f"(head {FT_HEAD!r}) and {n_pt} of {args.pt_train_file} (head {PT_HEAD!r}, loss "
            f"weight {args.weight_pt_head:g}) in every epoch.")
    return both, note


def with_head(d: dict | None, head: int) -> dict | None:
    """A raw set whose structures all go to head ``head`` (loss weight 1)."""
    if d is None:
        return None
    return dict(d, head=np.full(len(d["R"]), head, np.int32), head_weight=np.ones(len(d["R"])))


def weight_keys(ready: dict, gammas: dict, weights_keys: dict) -> dict:
    """The per-structure weights of every target times ``head_weight`` (in
    place in the sets ready for the trainer); returns the trainer's
    ``weights_keys``."""
    out = dict(weights_keys)
    for d in ready.values():
        if d is None:
            continue
        w = d["head_weight"]
        if "U_weight" in d:
            d["U_weight"] = (d["U_weight"] * w).astype(d["U_weight"].dtype)
        if "stress_weight" in d:
            d["stress_weight"] = (d["stress_weight"] * w).astype(d["stress_weight"].dtype)
    for t in gammas:
        out.setdefault(t, "head_weight")
    return out
