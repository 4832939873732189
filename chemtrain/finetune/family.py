"""The architecture families of ``chemtrain-finetune``: what the job needs of
a model, as one value of plain functions per family (MACE, NequIP).

The job itself (reading data, E0s, training, resuming, reports) is the same
for both; a family says how to load a foundation model, build a random one,
where its atomic reference energies (E0s) live, and how to write it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable

import numpy as np

from . import model as M
from .data import DataError


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture family, as ``chemtrain-finetune`` uses it.

    Attributes:
      name: as ``--model`` names it.
      load: ``(path, trusted) -> (cfg, params)`` of a foundation model.
      random: ``(atomic_numbers, mean_pairs, scale, args, given) -> cfg`` of
        a new model of the size flags (``given``: the flags on the command
        line); ``scale`` is the training forces' RMS (eV/A), the output
        scale of a new model, which MACE keeps in ``cfg``, NequIP in its
        parameters (``init``'s ``scale``).
      init: ``(cfg, key, dtype, scale) -> params``, random.
      template: ``(cfg, displacement) -> energy template``.
      r_max: ``cfg -> cutoff`` (Angstrom).
      e0s / with_e0s: the atomic reference energies (eV, per element of
        ``cfg.atomic_numbers``): ``(cfg, params) -> array`` and ``(cfg,
        params, e0s) -> (cfg, params)``.
      describe: ``(cfg, params) -> str`` for the log.
      config: ``cfg -> dict`` (plain JSON data).
      save: ``(path, cfg, params)``, chemtrain's ``.npz``.
      export: ``(stem, cfg, params, source) -> path or None``: the model in
        its home library's format, None where it cannot be written.
      export_key: the name of that file in ``results.json``.
      untrained: parameter blocks that fine-tuning keeps fixed.
      calculator: the ASE calculator's constructor, for the closing note.
    """
    name: str
    load: Callable
    random: Callable
    init: Callable
    template: Callable
    r_max: Callable
    e0s: Callable
    with_e0s: Callable
    describe: Callable
    config: Callable
    save: Callable
    export: Callable
    export_key: str
    untrained: tuple = ()
    calculator: str = "ChemtrainCalculator.from_mace"


def _mace() -> Family:
    from ..models import mace

    def export(stem, cfg, params, source):
        mace.export_mace_torch(cfg, params, stem + ".model", overwrite=True)
        return stem + ".model"
    return Family(
        name="MACE", load=M.load_foundation,
        random=lambda z, pairs, scale, args, given: M.random_config(
            z, pairs, scale, **{k: getattr(args, k) for k in M.SIZE_FLAGS}),
        init=lambda cfg, key, dtype, scale: mace.init_params(cfg, key, dtype),
        template=mace.energy_fn_template, r_max=lambda cfg: cfg.r_max,
        e0s=lambda cfg, params: np.asarray(cfg.atomic_energies, np.float64),
        with_e0s=lambda cfg, params, e0s: (dataclasses.replace(
            cfg, atomic_energies=tuple(float(e) for e in e0s)), params),
        describe=M.describe, config=lambda cfg: json.loads(cfg.to_json()), save=mace.save,
        export=export, export_key="torch")


# size flags with a meaning for NequIP; the others are MACE's alone
NEQUIP_SIZES = ("num_channels", "max_L", "max_ell", "r_max", "num_interactions",
                "num_radial_basis", "num_cutoff_basis", "radial_MLP")


def _nequip_random(z, pairs, scale, args, given):
    from ..models import nequip
    mace_only = sorted(set(given) & (set(M.SIZE_FLAGS) - set(NEQUIP_SIZES)))
    if mace_only:
        raise DataError(f"--model NequIP has no {', '.join('--' + k for k in mace_only)} (MACE "
                        f"flags); its size flags are {', '.join('--' + k for k in NEQUIP_SIZES)}.")
    c, lmax, t = args.num_channels, args.max_L, args.num_interactions
    if min(c, t) < 1 or min(lmax, args.max_ell) < 0:
        raise DataError("--num_channels and --num_interactions must be at least 1, --max_L and "
                        "--max_ell at least 0.")
    hidden = tuple((c, l) for l in range(lmax + 1))
    # sevenn's layout: scalars in, hidden features between layers, scalars out;
    # its polynomial cutoff; messages divided by the square root of the
    # average number of neighbours (sevenn's conv_denominator)
    return nequip.NequipConfig(
        atomic_numbers=tuple(int(a) for a in z), cutoff=float(args.r_max), cutoff_function="poly",
        cutoff_on=0.0, poly_p=int(args.num_cutoff_basis), n_basis=int(args.num_radial_basis),
        irreps=(((c, 0),),) + (hidden,) * (t - 1) + (((c, 0),),), filter_lmax=int(args.max_ell),
        radial_hidden=tuple(int(w) for w in args.radial_MLP),
        denominators=(math.sqrt(max(pairs, 1.0)),) * t, normalize_sph=True)


def _nequip_load(path: str, trusted: bool):
    from ..models import nequip
    from ..models.mace.torch_io import UntrustedFileError
    if not os.path.exists(path):
        raise DataError(f"--foundation_model {path!r} does not exist (a file, or one of the "
                        f"SevenNet names {sorted(nequip.PRETRAINED)}).")
    if path.endswith(".npz"):
        return nequip.load(path)
    try:
        return nequip.load_sevennet(path, trusted=trusted)
    except UntrustedFileError as e:
        raise DataError(f"{e} Here: pass --trust_foundation_model if you trust {path!r}.") from None
    except nequip.UnsupportedSevenNetError as e:
        raise DataError(f"--foundation_model {path!r}: {e}") from None


def _nequip() -> Family:
    from ..models import nequip

    def init(cfg, key, dtype, scale):
        params = nequip.init_params(key, cfg, dtype)
        params["scale"] = params["scale"] * scale
        return params

    def with_e0s(cfg, params, e0s):
        return cfg, {**params, "shift": np.asarray(e0s, np.asarray(params["shift"]).dtype)}

    def describe(cfg, params):
        import jax
        n = sum(int(np.size(p)) for p in jax.tree.leaves(params))
        widest = max(cfg.irreps[1:-1] or cfg.irreps, key=len)
        return (f"{cfg.num_layers} layers, hidden {'+'.join(f'{m}x{l}e' for m, l in widest)}, "
                f"filter l_max {cfg.filter_lmax}, cutoff {cfg.cutoff} A, {n} parameters")

    def export(stem, cfg, params, source):
        if source is None or source.endswith(".npz"):
            return None   # a SevenNet checkpoint is written on the one it came from
        return nequip.save_sevennet(stem + ".pth", params, source, trusted=True, overwrite=True)
    return Family(
        name="NequIP", load=_nequip_load, random=_nequip_random, init=init,
        template=nequip.energy_fn_template, r_max=lambda cfg: cfg.cutoff,
        e0s=lambda cfg, params: np.asarray(params["shift"], np.float64), with_e0s=with_e0s,
        describe=describe, config=lambda cfg: json.loads(json.dumps(cfg.to_json())),
        save=nequip.save, export=export, export_key="sevennet",
        # sevenn fine-tunes with train_shift_scale False: the per-element
        # scale and shift (the E0s) stay as set
        untrained=("scale", "shift"), calculator="ChemtrainCalculator.from_nequip")


def of(args, given_flags) -> Family:
    """The family of the job: the foundation model's (a SevenNet checkpoint
    or name, or a chemtrain NequIP ``.npz``: NequIP), else ``--model``. A
    SevenNet name in ``args.foundation_model`` is replaced by its file."""
    nequip = args.model == "NequIP"
    if args.foundation_model:
        from ..models.nequip import PRETRAINED, resolve
        path = args.foundation_model
        if path.lower() in PRETRAINED and not os.path.exists(path):
            try:   # the file in the sevenn package, so that it is recorded as a file
                path = args.foundation_model = resolve(path)
            except FileNotFoundError as e:
                raise DataError(f"--foundation_model {path!r}: {e}") from None
        nequip = (path.endswith(".pth")
                  or (path.endswith(".npz") and file_kind(path) == "chemtrain-nequip"))
        if "model" in given_flags and (args.model == "NequIP") != nequip:
            raise DataError(f"--model {args.model} but --foundation_model {path!r} is a "
                            f"{'NequIP' if nequip else 'MACE'} model; leave out --model.")
    return _nequip() if nequip else _mace()


def file_kind(path: str):
    """The ``kind`` of a chemtrain file (e.g. ``'chemtrain-nequip'``), None if it is not one."""
    from ..checkpoint import CheckpointError, load
    try:
        return load(path)[0].get("kind")
    except (CheckpointError, OSError):
        return None   # the loader reports what is wrong with it


def committee_of(paths, head=None):
    """The :class:`~chemtrain.calculator.CommitteeCalculator` of member files
    written by ``chemtrain-finetune``, MACE or NequIP by the first file's
    kind (``head``: a MACE head; NequIP has one, and refuses it)."""
    from ..calculator import CommitteeCalculator
    if file_kind(paths[0]) == "chemtrain-nequip":
        if head is not None:
            raise DataError("--head picks a head of MACE members; NequIP members have one: "
                            "leave it out.")
        return CommitteeCalculator.from_nequip(list(paths))
    return CommitteeCalculator.from_mace(list(paths), head=head)


def check_flags(family: Family, args, given_flags: set) -> str | None:
    """Refuse the flags a NequIP job cannot honour, by name; settle the
    defaults that differ for it. Returns a note for the log, or None."""
    if family.name != "NequIP":
        return None
    if args.pt_train_file:
        raise DataError("Replay fine-tuning (--pt_train_file) adds readout heads, which "
                        "chemtrain's NequIP does not have: fine-tune without it.")
    if args.foundation_head is not None:
        raise DataError("--foundation_head picks a head of a MACE of several heads; a NequIP "
                        "has one: leave it out.")
    if isinstance(args.freeze, int):
        raise DataError(f"--freeze {args.freeze}: mace-torch's numbers name MACE blocks; name "
                        f"NequIP's instead, e.g. --freeze embedding,layers.0 (its blocks: "
                        f"basis, embedding, layers.<t>, readout).")
    if "weight_decay" in given_flags and args.weight_decay:
        raise DataError("--weight_decay applies mace-torch's mask of MACE blocks; chemtrain's "
                        "NequIP trains without weight decay: leave it out.")
    args.weight_decay = 0.0
    said = ["no weight decay (mace-torch's applies to MACE blocks)"]
    if args.foundation_model and "E0s" not in given_flags:
        args.E0s = "foundation"
        said.append("E0s 'foundation' (the checkpoint's per-element shift; give --E0s to "
                    "choose another)")
    return "NequIP: " + "; ".join(said) + "."
