"""The starting MACE of ``chemtrain-finetune``: a foundation model (mace-torch
``.model`` or chemtrain ``.npz``) or a random one, its E0s, and the loss
weights in chemtrain's units."""
from __future__ import annotations

import ast
import json
import os

import ase.data
import numpy as np

from .data import ENERGY, FORCE, STRESS, DataError

SILU_2MOM = 1.6791767923989418  # e3nn's second-moment normalisation of SiLU, as in mace-torch
RESIDUAL = "RealAgnosticResidualInteractionBlock"


def random_config(atomic_numbers, avg_num_neighbors: float, scale: float, *,
                  num_channels: int = 8, max_L: int = 0, max_ell: int = 1, correlation: int = 2,
                  r_max: float = 4.0, num_interactions: int = 2, num_radial_basis: int = 10,
                  num_cutoff_basis: int = 5, radial_MLP=(64, 64, 64), MLP_irreps: str = "16x0e"):
    """The :class:`~chemtrain.models.mace.MaceConfig` of the ``ScaleShiftMACE``
    that ``mace_run_train`` builds from these size flags: residual
    interaction blocks, Bessel basis with polynomial cutoff, hidden features
    ``num_channels x (0e + 1o + ...)`` up to ``max_L`` (scalars only after
    the last layer), non-linear last readout; E0s zero, shift zero."""
    from ..models import mace
    c = num_channels
    if min(c, num_interactions, correlation) < 1 or min(max_L, max_ell) < 0:
        raise DataError("--num_channels, --num_interactions and --correlation must be at least 1, "
                        "--max_L and --max_ell at least 0.")
    parity = lambda l: "e" if l % 2 == 0 else "o"  # noqa: E731
    sh = "+".join(f"{c}x{l}{parity(l)}" for l in range(max_ell + 1))
    hidden = "+".join(f"{c}x{l}{parity(l)}" for l in range(max_L + 1))
    scalars = f"{c}x0e"
    layers = []
    for i in range(num_interactions):
        node = scalars if i == 0 else hidden
        last = i == num_interactions - 1
        layers.append(mace.Layer(interaction=RESIDUAL, node_irreps=node, edge_irreps=node,
                                 target_irreps=sh, hidden_irreps=scalars if last else hidden,
                                 correlation=correlation, readout="nonlinear" if last else "linear"))
    if isinstance(radial_MLP, str):
        radial_MLP = ast.literal_eval(radial_MLP)
    # covalent radii: unused by this architecture, but mace-torch's constructor
    # stores ASE's table, and an exported model must match it
    return mace.MaceConfig(
        atomic_numbers=tuple(int(z) for z in atomic_numbers), r_max=float(r_max),
        num_bessel=num_radial_basis, num_polynomial_cutoff=num_cutoff_basis, max_ell=max_ell,
        avg_num_neighbors=float(avg_num_neighbors), radial_mlp=tuple(int(w) for w in radial_MLP),
        layers=tuple(layers), mlp_irreps=MLP_irreps, atomic_energies=(0.0,) * len(atomic_numbers),
        scale=float(scale), shift=0.0, act_constant=SILU_2MOM,
        covalent_radii=tuple(float(r) for r in ase.data.covalent_radii))


SIZE_FLAGS = ("num_channels", "max_L", "max_ell", "correlation", "r_max", "num_interactions",
              "num_radial_basis", "num_cutoff_basis", "radial_MLP", "MLP_irreps")


def sizes(cfg) -> dict:
    """The size flags' values that describe ``cfg`` (a model as
    :func:`random_config` builds it from them)."""
    terms = [t.strip().split("x") for t in cfg.layers[0].hidden_irreps.split("+")]
    return {"num_channels": int(terms[0][0]), "max_L": max(int(t[1][:-1]) for t in terms),
            "max_ell": cfg.max_ell, "correlation": cfg.layers[0].correlation, "r_max": cfg.r_max,
            "num_interactions": len(cfg.layers), "num_radial_basis": cfg.num_bessel,
            "num_cutoff_basis": cfg.num_polynomial_cutoff, "radial_MLP": list(cfg.radial_mlp),
            "MLP_irreps": cfg.mlp_irreps}


def check_sizes_unused(cfg, args, given: set, path: str, family: str = "MACE") -> None:
    """Size flags set on the command line that a foundation model overrides."""
    if family != "MACE":
        if given:
            raise DataError(f"With --foundation_model {path!r} the model keeps its own size, so "
                            f"{', '.join('--' + k for k in sorted(given))} would be ignored. "
                            f"Remove those flags.")
        return
    own = sizes(cfg)
    differ = lambda a, b: (abs(a - b) > 1e-9 * abs(b) if isinstance(b, float)  # noqa: E731
                           else a != b)
    clash = [f"--{k} {getattr(args, k)} (the model has {own[k]})" for k in SIZE_FLAGS
             if k in given and differ(getattr(args, k), own[k])]
    if clash:
        raise DataError(f"With --foundation_model {path!r} the model keeps its own size, so "
                        f"{', '.join(clash)} would be ignored. Remove those flags, or train a new "
                        f"model of that size without --foundation_model.")


def load_foundation(path: str, trusted: bool):
    from ..models import mace
    from ..models.mace.torch_io import UntrustedFileError
    if not os.path.exists(path):
        raise DataError(f"--foundation_model {path!r} does not exist.")
    if path.endswith(".npz"):
        return mace.load(path)
    try:
        return mace.load_mace_torch(path, trusted=trusted)
    except UntrustedFileError as e:
        raise DataError(f"{e} Here: pass --trust_foundation_model if you trust {path!r}.") from None


def foundation_head(cfg, params, path: str, head: str | None):
    """(cfg, params, note) of the one head a fine-tuning starts from: a
    model of several heads is cut to ``--foundation_head``, else (as
    mace-torch) to its first head that is not ``pt_head``, so that a model
    of an earlier replay fine-tuning goes on from its fine-tuned head."""
    from ..models import mace
    try:
        name = cfg.heads[mace.finetuned_head(cfg, head)]
    except ValueError as e:
        raise DataError(f"--foundation_head {head!r}: {e}") from None
    if cfg.num_heads == 1:
        return cfg, params, None
    heads = list(cfg.heads)
    cfg, params = mace.select_head(cfg, params, name)
    why = "" if head is not None else (" (the first that is not 'pt_head', as mace-torch; "
                                       "choose another with --foundation_head)")
    return cfg, params, f"{path} has the heads {heads}: fine-tuning {name!r}{why}."


def check_elements(cfg, species, mask, path: str) -> None:
    present = np.unique(np.asarray(species)[np.asarray(mask, bool)])
    missing = sorted(set(present.tolist()) - set(cfg.atomic_numbers))
    if missing:
        raise DataError(f"The data hold atomic numbers {missing} that the foundation model "
                        f"{path!r} does not know (it has {list(cfg.atomic_numbers)}). Remove "
                        f"those structures, or train a new model (no --foundation_model).")


def average_e0s(atomic_numbers, d: dict) -> np.ndarray:
    """mace-torch's 'average' E0s: least squares of the training energies (eV)
    on each structure's element counts (minimum norm where the counts do not
    fix them, e.g. one composition only)."""
    counts = np.stack([((d["species"] == z) & d["mask"]).sum(1) for z in atomic_numbers], 1)
    e0, *_ = np.linalg.lstsq(counts.astype(float), d["U"] / ENERGY, rcond=None)
    return e0


def set_e0s(family, cfg, params, how: str, train: dict, foundation: bool):
    """``(cfg, params, description)`` with the E0s chosen by ``--E0s``
    (where they live is the ``family``'s: MACE's config, NequIP's shift)."""
    if how == "foundation":
        if not foundation:
            raise DataError("--E0s foundation needs --foundation_model.")
        return cfg, params, "E0s of the foundation model"
    if how == "estimated":
        raise DataError("--E0s estimated needs --foundation_model (it corrects the foundation's "
                        "E0s by its errors on the training set).")
    old = family.e0s(cfg, params)
    if how == "average":
        if "U" not in train:
            return cfg, params, "E0s unchanged (no energies)"
        e0 = average_e0s(cfg.atomic_numbers, train)
        present = np.isin(cfg.atomic_numbers, train["species"][train["mask"]])
        return (*family.with_e0s(cfg, params, np.where(present, e0, old)),
                "E0s 'average' of the training set")
    try:
        given = {int(k): float(v) for k, v in ast.literal_eval(how).items()}
    except (ValueError, SyntaxError, AttributeError):
        raise DataError(f"--E0s must be 'average', 'foundation', 'estimated' or a dict of atomic "
                        f"number -> "
                        f"energy in eV such as '{{1: -13.6, 6: -1027.6}}', got {how!r}.") from None
    bad = {z: e for z, e in given.items() if not np.isfinite(e)}
    if bad:
        raise DataError(f"--E0s must give a finite energy (eV) for every element; got {bad}.")
    lacking = sorted(set(cfg.atomic_numbers) - set(given))
    if lacking:
        raise DataError(f"--E0s lacks the atomic numbers {lacking}.")
    return (*family.with_e0s(cfg, params, [given[z] for z in cfg.atomic_numbers]),
            f"E0s given: {json.dumps(given)}")


def estimated_e0s(family, cfg, params, ready: dict, raw: dict):
    """mace-torch's ``--E0s estimated``: the foundation's E0s plus the least
    squares correction, on each training structure's element counts, of the
    foundation model's energy errors (eV); elements absent from the data keep
    the foundation's E0s. ``ready`` is the training set with graphs (for the
    predictions), ``raw`` its raw form; returns (cfg, params, description)."""
    import jax
    from ..learn.force_matching import TARGETS, make_predictor
    if "U" not in raw:
        raise DataError("--E0s estimated fits the foundation's energy errors: the training set "
                        "needs energies.")
    predict = make_predictor(family.template(cfg, None), None)
    skip = {"R", *TARGETS, "U_weight", "stress_weight", "head_weight"}
    energy = jax.jit(lambda p, R, kw: predict(p, R, kw)[0]["U"])
    n, chunk, out = len(ready["R"]), 16, []
    for i in range(0, n, chunk):
        rows = {k: v[i:i + chunk] for k, v in ready.items() if k not in skip}
        out.append(np.asarray(energy(params, ready["R"][i:i + chunk], rows), np.float64))
    errors = (np.asarray(raw["U"], np.float64) - np.concatenate(out)) / ENERGY
    present = [z for z in cfg.atomic_numbers if ((raw["species"] == z) & raw["mask"]).any()]
    counts = np.stack([((raw["species"] == z) & raw["mask"]).sum(1) for z in present], 1)
    correction, *_ = np.linalg.lstsq(counts.astype(float), errors, rcond=None)
    fix = dict(zip(present, correction))
    new = [float(e) + float(fix.get(z, 0.0)) for z, e in
           zip(cfg.atomic_numbers, family.e0s(cfg, params))]
    return (*family.with_e0s(cfg, params, new),
            "E0s 'estimated': the foundation's, corrected by least squares on its energy errors "
            f"on the training set ({', '.join(f'{z}: {c:+.4g} eV' for z, c in fix.items())})")


def gammas(args) -> dict:
    """mace-torch's 'weighted' loss in chemtrain's units: energy_weight x
    (energy error per atom, eV)^2 is gamma_U x w x (error, kJ/mol)^2 with the
    per-structure weight w = 1/N^2 (``U_weight``) and gamma_U =
    energy_weight / (kJ/mol per eV)^2; forces and stresses likewise."""
    out = {"U": args.energy_weight / ENERGY ** 2, "F": args.forces_weight / FORCE ** 2,
           "stress": args.stress_weight / STRESS ** 2}
    for flag in ("energy", "forces", "stress"):
        w = getattr(args, f"{flag}_weight")
        if not (np.isfinite(w) and w >= 0):
            raise DataError(f"--{flag}_weight must be a number >= 0, got {w}.")
    return {k: v for k, v in out.items() if v > 0}


def describe(cfg, params) -> str:
    import jax
    n = sum(int(np.size(p)) for p in jax.tree.leaves(params))
    layer = cfg.layers[0]
    return (f"{len(cfg.layers)} layers, hidden {cfg.layers[0].hidden_irreps}, L_max "
            f"{cfg.max_ell}, correlation {layer.correlation}, r_max {cfg.r_max} A, {n} parameters")



def check_members(args, ensemble_size_given: bool) -> None:
    """``--member_models``: at least two chemtrain files of one architecture,
    no ``--foundation_model`` beside them; ``--ensemble_size`` becomes their
    number and ``--foundation_model`` the first (the job's model and E0s)."""
    paths = args.member_models
    if args.foundation_model:
        raise DataError("--member_models and --foundation_model both name the starting "
                        "model: give one of them.")
    if len(paths) < 2:
        raise DataError(f"--member_models names {len(paths)} file; a committee has at least "
                        f"two members (one model: --foundation_model {paths[0]}).")
    if ensemble_size_given and args.ensemble_size != len(paths):
        raise DataError(f"--ensemble_size {args.ensemble_size} but --member_models names "
                        f"{len(paths)} files: leave out --ensemble_size.")
    from ..checkpoint import CheckpointError, load
    first = None
    for path in paths:
        if not path.endswith(".npz") or not os.path.isfile(path):
            raise DataError(f"--member_models takes existing chemtrain .npz files, got {path!r}.")
        try:
            config = load(path)[0]   # {'kind', 'config'}: plain data
        except (CheckpointError, OSError) as e:
            raise DataError(f"--member_models {path!r}: {e}") from None
        if first is not None and config != first:
            raise DataError(f"--member_models {path!r} is another architecture (or other E0s) "
                            f"than {paths[0]!r}; a committee's members share them.")
        first = config
    args.ensemble_size = len(paths)
    args.foundation_model = paths[0]


def committee_params(family, cfg, params, args, dtype, scale: float) -> list:
    """The starting parameters of ``--ensemble_size`` members: from
    ``--member_models``, each member continues from its file; from a
    foundation model, each member starts from its parameters (they differ in
    batch order and, with ``--ensemble_bootstrap``, in their data); a
    random model initialises member ``k`` with ``--seed + k``. Every member
    gets the E0s of ``params``."""
    import jax
    import jax.numpy as jnp
    e0s = family.e0s(cfg, params)
    if args.member_models:   # each member continues from its own file, with the job's E0s
        return [jax.tree.map(lambda p: jnp.asarray(p, dtype),
                             family.with_e0s(cfg, family.load(path, False)[1], e0s)[1])
                for path in args.member_models]
    if args.foundation_model:
        return [params] * args.ensemble_size
    return [jax.tree.map(lambda p: jnp.asarray(p, dtype), family.with_e0s(
        cfg, family.init(cfg, jax.random.PRNGKey(args.seed + k), dtype, scale), e0s)[1])
            for k in range(args.ensemble_size)]


def exported_epoch(trainer, which: str) -> int | None:
    """The epoch whose model ``--export_model`` writes, numbered as in the
    log and ``metrics.jsonl`` (from 0); None before any epoch."""
    if not trainer.history:
        return None
    return trainer.epoch - 1 - (trainer.epochs_since_best() if which == "best" else 0)


def final_params(trainer, which: str):
    """(parameters, note) of ``--export_model``: the best epoch's (the moving
    average with ``--ema``), or the last epoch's (likewise)."""
    if which == "best" and trainer.history:
        since = trainer.epochs_since_best()
        return trainer.best_params, (f", best: epoch {exported_epoch(trainer, which)}"
                                     if since else "")
    return trainer.strategy.to_host(trainer.eval_params), ""


def write_models(out: str, args, family, cfg, trainer, params) -> dict:
    """Write the trained model ``params`` (``<name>.npz`` and, unless
    ``--no_torch_export``, the home library's file: mace-torch's
    ``<name>.model``, or for a model fine-tuned from a SevenNet checkpoint
    ``<name>.pth``), or a committee's members (the stacked ``params``) as
    ``<name>_member<k>``; return the paths for ``results.json``
    (``model_npz`` and ``model_torch``/``model_sevennet``; a committee's
    as lists ``members_npz``, ``members_torch``/``members_sevennet``)."""
    from ..learn.ensemble import member_params
    one = getattr(trainer, "n_members", None) is None
    members = [params] if one else [member_params(params, k) for k in range(trainer.n_members)]
    names = [args.name] if one else [f"{args.name}_member{k}" for k in range(len(members))]
    npz, home = [], []
    for name, params in zip(names, members):
        npz.append(os.path.join(out, f"{name}.npz"))
        family.save(npz[-1], cfg, params)
        if not args.no_torch_export:
            written = family.export(os.path.join(out, name), cfg, params, args.foundation_model)
            home += [written] if written else []
    key = family.export_key
    if one:
        return {"model_npz": npz[0], **({f"model_{key}": home[0]} if home else {})}
    return {"members_npz": npz, **({f"members_{key}": home} if home else {})}


FILE_KEYS = ("model_npz", "model_torch", "members_npz", "members_torch", "model_sevennet",
             "members_sevennet", "curve_plot")


def relative_files(results: dict, out: str) -> dict:
    """``results`` with the files it names relative to ``out`` (the
    ``--results_dir``), as ``results.json`` records them: a folder copied or
    moved elsewhere then still names its own files."""
    rel = lambda p: os.path.relpath(p, out)  # noqa: E731
    return {k: ([rel(p) for p in v] if isinstance(v, list) else rel(v))
            if k in FILE_KEYS else v for k, v in results.items()}
