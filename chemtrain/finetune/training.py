"""How ``chemtrain-finetune`` trains: the optimizer (Adam, its learning-rate
schedule, ``--ema``, ``--freeze``), the loss (``--loss``) in chemtrain's
units, and the flags that contradict each other."""
from __future__ import annotations

from .cli import given
from .data import ENERGY, FORCE, STRESS, DataError

# mace-torch's --freeze numbers: from this number on, these blocks are fixed
MACE_TORCH_FREEZE = ((1, "embedding"), (5, "interactions"), (6, "products"), (7, "readouts"))

# flag -> (what must hold for it to mean anything, why)
DEPENDENT = {
    "ema_decay": (lambda a: a.ema, "--ema_decay is the decay of --ema; add --ema"),
    "foundation_head": (lambda a: a.foundation_model is not None,
                        "--foundation_head picks a head of --foundation_model; add it"),
    "ensemble_bootstrap": (lambda a: a.ensemble_size > 1,
                           "--ensemble_bootstrap draws a bootstrap sample for each member of a "
                           "committee; add --ensemble_size K (K >= 2)"),
    "huber_delta": (lambda a: a.loss in ("huber", "universal"),
                    "--huber_delta is the threshold of --loss huber or universal, but --loss is "
                    "'weighted' (squared errors)"),
    "lr_factor": (lambda a: a.scheduler == "ReduceLROnPlateau",
                  "--lr_factor belongs to --scheduler ReduceLROnPlateau"),
    "scheduler_patience": (lambda a: a.scheduler == "ReduceLROnPlateau",
                           "--scheduler_patience belongs to --scheduler ReduceLROnPlateau"),
    "lr_scheduler_gamma": (lambda a: a.scheduler == "ExponentialLR",
                           "--lr_scheduler_gamma belongs to --scheduler ExponentialLR"),
    **{flag: (lambda a: a.swa, f"--{flag} belongs to stage two; add --swa")
       for flag in ("start_swa", "swa_lr", "swa_energy_weight", "swa_forces_weight",
                    "swa_stress_weight")},
}


def check_flags(args, argv) -> None:
    """Refuse flags that would be silently ignored by the others given."""
    set_ = given(argv, tuple(DEPENDENT))
    wrong = [why for flag, (ok, why) in DEPENDENT.items() if flag in set_ and not ok(args)]
    if wrong:
        raise DataError("Contradicting flags: " + "; ".join(wrong) + ". Drop the flag or "
                        "choose the option it belongs to.")
    start = stage_two_start(args)
    if start is not None and start >= args.max_num_epochs:
        raise DataError(f"Contradicting flags: stage two would start at epoch {start}, but "
                        f"--max_num_epochs {args.max_num_epochs} ends the run before it; give a "
                        f"smaller --start_swa or more epochs.")
    if args.swa and "patience" in given(argv, ("patience",)):
        raise DataError("Contradicting flags: --patience with --swa is not supported: an early "
                        "stop in stage one would end the run before stage two (mace-torch "
                        "jumps to stage two instead). Drop --patience, or --swa.")
    if args.swa and args.stress_weight == 0 and "swa_stress_weight" in set_:
        raise DataError("Contradicting flags: --swa_stress_weight weights stresses in stage two, "
                        "but --stress_weight 0 leaves them out of training.")


def stage_two_start(args) -> int | None:
    """The first epoch of stage two (``--swa``), None without it: mace-torch's
    default is ``max(1, max_num_epochs // 4 * 3)``."""
    if not args.swa:
        return None
    return args.start_swa if args.start_swa is not None else max(1, args.max_num_epochs // 4 * 3)


def stage_two_args(args):
    """A copy of the flags as stage two trains: ``--swa_lr`` constant (or on
    its plateau), the ``--swa_*_weight`` loss weights; everything that shapes
    the optimizer state (EMA, freezing, the plateau) stays."""
    import argparse
    two = argparse.Namespace(**vars(args))
    two.lr = args.swa_lr
    two.scheduler = "ReduceLROnPlateau" if args.scheduler == "ReduceLROnPlateau" else "constant"
    two.energy_weight = args.swa_energy_weight if args.energy_weight > 0 else 0.0
    two.forces_weight = args.swa_forces_weight if args.forces_weight > 0 else 0.0
    two.stress_weight = args.swa_stress_weight if args.stress_weight > 0 else 0.0
    return two


def frozen_blocks(spec, params, untrained=()) -> list[str]:
    """The block names of ``--freeze`` (names, or mace-torch's number) that
    exist in ``params``, and those ``untrained``; DataError for names of no
    block, or everything."""
    from ..models import block_names, frozen
    if spec is None and not untrained:
        return []
    if isinstance(spec, int):
        names = [name for level, name in MACE_TORCH_FREEZE if spec >= level]
        if not names:
            raise DataError(f"--freeze {spec} freezes no block (mace-torch's numbers: >= 1 the "
                            f"embedding, >= 5 the interactions, >= 6 the products, >= 7 the "
                            f"readouts); name blocks instead, e.g. --freeze "
                            f"embedding,interactions.0.")
    else:
        names = list(spec or ())
    names += [n for n in untrained if n not in names]
    try:
        labels = frozen.labels(params, names)
    except ValueError:
        unknown = [n for n in names if n not in block_names(params, 3)]
        raise DataError(f"--freeze names no block of this model: {unknown}. Its blocks are "
                        f"{block_names(params, 2)}.") from None
    import jax
    if all(label == "frozen" for label in jax.tree.leaves(labels)):
        raise DataError(f"--freeze {','.join(names)} leaves nothing to train; freeze fewer "
                        f"blocks (the model has {block_names(params, 2)}).")
    return names


def optimizer(args, params, steps_per_epoch: int, untrained=()):
    """(optax transformation, note) for the flags: Adam with the
    ``--scheduler``, ``--freeze`` and ``--ema``; the blocks ``untrained``
    (the family's, e.g. NequIP's scale and shift) are kept fixed as well."""
    import optax
    from ..learn import optimizers
    from ..models import freeze
    total = max(args.max_num_epochs * steps_per_epoch, 1)
    if args.scheduler == "cosine":
        lr = optax.cosine_decay_schedule(args.lr, total, alpha=0.05)
    elif args.scheduler == "ExponentialLR":
        lr = optax.exponential_decay(args.lr, max(steps_per_epoch, 1), args.lr_scheduler_gamma,
                                     staircase=True)
    else:   # a schedule too: every stage's optimizer state has the same structure
        lr = optax.constant_schedule(args.lr)
    opt = adam_as_mace_torch(lr, params, args.amsgrad, args.clip_grad, args.weight_decay)
    parts = [f"{'AMSGrad' if args.amsgrad else 'Adam'}, learning rate {args.lr:g}, "
             f"{args.scheduler}" + (f", gradient clipped at norm {args.clip_grad:g}"
                                    if args.clip_grad else "")
             + (f", weight decay {args.weight_decay:g}" if args.weight_decay else "")]
    if args.scheduler == "ReduceLROnPlateau":
        opt = optimizers.reduce_on_plateau(opt, args.lr_factor, args.scheduler_patience)
        parts[-1] += f" (factor {args.lr_factor:g}, patience {args.scheduler_patience})"
    blocks = frozen_blocks(args.freeze, params, untrained)
    if blocks:
        opt = freeze(opt, params, blocks)
        parts.append(f"frozen: {', '.join(blocks)}")
    if args.ema:
        opt = optimizers.ema(opt, args.ema_decay)
        parts.append(f"EMA of the weights (decay {args.ema_decay:g})")
    return opt, "Optimizer: " + "; ".join(parts) + "."


def decayed(params):
    """mace-torch's weight-decay mask: the interactions' ``linear`` and
    ``skip_tp`` weights and the products; not the embedding, the radial
    MLPs, the up-projections or the readouts."""
    import jax

    def mask(path, _):
        keys = [getattr(k, "key", None) for k in path]
        return ("products" in keys or ("interactions" in keys
                                       and ("linear" in keys or "skip_tp" in keys)))
    return jax.tree_util.tree_map_with_path(mask, params)


def adam_as_mace_torch(lr, params, amsgrad: bool, clip: float, weight_decay: float):
    """torch's Adam as mace-torch steps it: the gradient clipped to a global
    norm (``clip_grad_norm_``, 0: none), plus ``weight_decay`` x the weights
    of :func:`decayed` (torch's L2 form, not AdamW's), then Adam or AMSGrad
    moments, then the learning rate (a schedule)."""
    import optax
    parts = [optax.clip_by_global_norm(clip)] if clip else []
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask=decayed(params)))
    parts += [optax.scale_by_amsgrad() if amsgrad else optax.scale_by_adam(),
              optax.scale_by_learning_rate(lr)]
    return optax.chain(*parts)


def losses(args) -> tuple[dict, bool]:
    """(``{target: TargetLoss}``, whether energies are compared per atom in
    the loss itself) of ``--loss`` in chemtrain's units (kJ/mol, nm): a
    threshold of delta eV is delta x ENERGY kJ/mol, and so on, so that with
    the weights of :func:`chemtrain.finetune.model.gammas` the loss is
    mace-torch's in eV and Angstrom."""
    from ..learn.losses import MACE_TORCH_EDGES_EV_PER_A, TargetLoss, conditional_huber, huber
    if args.loss == "weighted":
        return {}, False
    d = args.huber_delta
    forces = (huber(d * FORCE) if args.loss == "huber" else
              conditional_huber(d * FORCE, edges=tuple(e * FORCE for e in
                                                       MACE_TORCH_EDGES_EV_PER_A)))
    out = {"U": TargetLoss(huber(d * ENERGY), per_atom=True), "F": forces,
           "stress": huber(d * STRESS)}
    trained = {"U": args.energy_weight, "F": args.forces_weight, "stress": args.stress_weight}
    return {t: v for t, v in out.items() if trained[t] > 0}, True
