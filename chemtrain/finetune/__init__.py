"""``chemtrain-finetune``: train or fine-tune MACE on any data set in one command::

    chemtrain-finetune --train_file data.xyz --foundation_model mace.model \\
        --trust_foundation_model --max_num_epochs 50 --results_dir runs/mine
    python -m chemtrain.finetune --help

mace-torch users will find ``mace_run_train``'s flags (see :mod:`.cli`). The
job reads extxyz (any file ASE reads; keys chosen by ``--energy_key``,
``--forces_key``, ``--stress_key``), MD22/sGDML ``.npz`` or chemtrain HDF5;
splits it (or takes ``--valid_file``/``--test_file``); starts from a
mace-torch ``.model``, a chemtrain ``.npz`` or a random MACE; sets E0s;
trains with :class:`chemtrain.trainers.ForceMatching` under any
``--parallelism`` (also under ``mpirun`` or ``jax.distributed``), with
checkpoints and ``--restart_latest``; and writes into ``--results_dir``
``metrics.jsonl`` (one line per epoch), ``parity.png``, ``curve.png`` (loss
and validation force error per epoch), ``results.json``
and the model as chemtrain ``<name>.npz`` and mace-torch ``<name>.model``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys

import numpy as np

from . import data as D
from . import family as F
from . import model as M
from . import replay as P
from . import report as R
from . import training as T
from .cli import given, parse_args
from ..parallel.failures import is_raised_everywhere
from .data import DataError
from .inputs import check_edges, check_plausible, load_sets
from .resume import check_folder, check_ranks_agree, check_resumed, restore, setup_record

log = logging.getLogger("chemtrain")

__all__ = ["main", "run", "DataError"]


def run(argv=None) -> dict:
    """Run one ``chemtrain-finetune`` job and return what ``results.json`` holds.

    The job reads and checks the data, builds or loads the model, trains it
    with :class:`chemtrain.trainers.ForceMatching` and, on the root process,
    writes the plots, the model files and ``results.json`` into
    ``--results_dir`` (see the module docs). Errors are reported in eV and
    Angstrom, the units of mace-torch.

    Args:
      argv: the command-line arguments without the program name, as
        ``mace_run_train`` takes them (see :mod:`chemtrain.finetune.cli`);
        None: ``sys.argv[1:]``.

    Returns:
      A dict with ``before`` and ``after`` (the test errors of the starting
      and the trained model, ``{'energy_eV_per_atom' | 'force_eV_per_A' |
      'stress_eV_per_A3': {'MAE': ..., 'RMSE': ...}}``, in eV/atom,
      eV/Angstrom and eV/Angstrom^3), ``epoch`` (epochs trained in all),
      ``test_set`` (``'testing'``, or ``'validation'`` when there is no test
      set), ``n_test``, ``test_rows`` (the rows of ``--train_file`` tested
      on; None when the test set is ``--test_file``, empty when it is
      ``--valid_file``), ``parallelism`` (the strategy's name), ``n_shards``,
      ``train_file``, ``model`` (``'MACE'`` or ``'NequIP'``) and ``config``
      (the model's configuration as a dict). On
      the root process also the paths ``model_npz``, ``model_torch`` (a
      MACE's mace-torch file) or ``model_sevennet`` (a NequIP fine-tuned from
      a SevenNet checkpoint, as one; neither with ``--no_torch_export``) and
      ``curve_plot`` (when a learning curve was drawn); a committee's
      ``members_npz`` and ``members_torch`` or ``members_sevennet``.
      ``results.json`` records these files relative to ``--results_dir``.

    Raises:
      DataError: for bad flags or data (a ``--results_dir`` that cannot be
        written or holds another run, a missing checkpoint for
        ``--restart_latest`` or a run it does not continue, outliers,
        no edges within r_max, no test or validation set, ...), before
        anything is written.
      SystemExit: from the argument parser, for unknown or invalid flags
        (code 2) and for ``--help`` (code 0).
    """
    args = parse_args(argv)
    size_flags = given(argv, M.SIZE_FLAGS)
    flags = given(argv, ("model", "E0s", "weight_decay", "ensemble_size"))
    if args.member_models:   # the first member becomes the job's foundation model
        M.check_members(args, "ensemble_size" in flags)
    family = F.of(args, flags)   # a SevenNet name becomes its file
    family_note = F.check_flags(family, args, flags)
    P.check_flags(args, argv)
    replay_note = P.mace_torch_settings(args, argv) if P.active(args) else None
    T.check_flags(args, argv)   # after replay's settings (its 'universal' loss takes a delta)
    import jax
    if args.default_dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    from ..compile_cache import enable
    enable(args.jax_cache)
    import jax.numpy as jnp
    from ..learn import optimizers
    from ..trainers import EnsembleOfModels, ForceMatching, RunOptions
    dtype = np.float64 if args.default_dtype == "float64" else np.float32
    out = args.results_dir
    earlier = check_folder(out, args.name, args.restart_latest)
    weights = {"U": args.energy_weight, "F": args.forces_weight, "stress": args.stress_weight}
    gammas = M.gammas(args)
    losses, per_atom = T.losses(args)
    sets, rows, hdf5 = load_sets(args, weights)
    check_plausible(args, sets, rows)
    train = sets["training"]
    everything = [s for s in sets.values() if s is not None]
    notes = [family_note] if family_note else []

    # the starting model
    rms = 1.0   # the output scale of a new model (eV/A), set below
    if args.foundation_model:
        cfg, params = family.load(args.foundation_model, args.trust_foundation_model)
        if family.name == "MACE":
            cfg, params, head_note = M.foundation_head(cfg, params, args.foundation_model,
                                                       args.foundation_head)
            notes += [head_note] if head_note else []
        for s in everything:
            M.check_elements(cfg, s["species"], s["mask"], args.foundation_model)
        M.check_sizes_unused(cfg, args, size_flags, args.foundation_model, family.name)
        notes.append(f"Fine-tuning {args.foundation_model}: {family.describe(cfg, params)}.")
    r_max = family.r_max(cfg) if args.foundation_model else args.r_max
    for path in (args.train_file, args.valid_file, args.test_file):
        if path:
            D.check_graph_cutoff(path, r_max * D.LENGTH)
    sample = D.to_model_arrays(D.take(train, np.arange(min(32, len(train["R"])))),
                               r_max * D.LENGTH, dtype, False)
    check_edges(sample, r_max, bool(args.foundation_model))
    if not args.foundation_model:
        z = np.unique(np.concatenate([s["species"][s["mask"].astype(bool)] for s in everything]))
        rms = float(np.sqrt(np.mean(train["F"][train["mask"].astype(bool)] ** 2))) / D.FORCE \
            if "F" in train else 1.0
        cfg = family.random(z.tolist(), D.mean_pairs(sample), rms, args, size_flags)
        params = family.init(cfg, jax.random.PRNGKey(args.seed), dtype, rms)
        notes.append(f"No --foundation_model: a random {family.name}, "
                     f"{family.describe(cfg, params)}.")
    cast = lambda tree: jax.tree.map(lambda p: jnp.asarray(p, dtype), tree)  # noqa: E731
    params = cast(params)
    foundation_cfg = cfg
    r_max_nm = family.r_max(cfg) * D.LENGTH
    if args.E0s == "estimated" and args.foundation_model:
        cfg, params, e0_note = M.estimated_e0s(family, cfg, params, D.to_model_arrays(
            train, r_max_nm, dtype, False), train)
    else:
        cfg, params, e0_note = M.set_e0s(family, cfg, params, args.E0s, train,
                                         bool(args.foundation_model))
    params = cast(params)
    notes.append(e0_note)
    if P.active(args):   # heads pt_head and Default; the replayed structures join the training set
        pt = P.load_pretraining(args, foundation_cfg, weights, args.seed)
        cfg, params = P.heads_model(foundation_cfg, cfg, params)
        sets["training"], mix = P.combine(sets["training"], pt, args)
        for stage in ("validation", "testing"):
            sets[stage] = P.with_head(sets[stage], 1)
        notes += [n for n in (replay_note, mix) if n]

    # the data the trainer sees: graphs everywhere but in an HDF5 training
    # file of molecules without graphs (a jax-md list, built for free space)
    nbrs_init, displacement = None, None
    u_factor = 1.0   # the energy weight's factor (HDF5: the mean 1/N^2)
    weights_keys = {"stress": "stress_weight"} if "stress" in gammas else {}
    if hdf5:
        import h5py
        from ..data import HDF5ParallelDataLoader
        with h5py.File(args.train_file, "r") as f:
            file_keys = [k for k in D.KEEP if k in f]
        if not all(k in file_keys for k in D.GRAPH_KEYS):
            if "box" in file_keys:
                raise DataError(
                    f"{args.train_file!r} holds periodic cells but no graphs; write it with "
                    f"stored graphs: chemtrain-convert SOURCE {args.train_file} --graph-cutoff "
                    f"{r_max_nm:g} (nm), so that every periodic image within r_max is counted.")
            from .. import neighbors
            displacement, _ = neighbors.make_space(None)
            nbrs_init = neighbors.neighbor_list(displacement, None, r_max_nm).allocate(
                jnp.asarray(train["R"][int(np.argmax(train["mask"].sum(1)))], dtype))
        if "U" in gammas and not per_atom:  # a per-atom energy loss through the mean 1/N^2
            u_factor = float(np.mean(1.0 / train["mask"].sum(1) ** 2))
            gammas["U"] *= u_factor
        loader = HDF5ParallelDataLoader(args.train_file, keys=file_keys, rows=rows["training"],
                                        dtype=dtype)
        prep = lambda s: D.to_model_arrays(s, r_max_nm, dtype, False)  # noqa: E731
    else:
        if "U" in gammas and not per_atom:   # (error per atom)^2 = error^2 / N^2
            weights_keys["U"] = "U_weight"
        prep = lambda s: D.to_model_arrays(s, r_max_nm, dtype, True)  # noqa: E731
    ready = {stage: (prep(s) if s is not None else None) for stage, s in sets.items()
             if not (hdf5 and stage == "training")}
    D.share_shapes([ready.get("validation"), ready.get("testing")])
    if P.active(args):
        weights_keys = P.weight_keys(ready, gammas, weights_keys)
    test_stage = "testing" if ready.get("testing") is not None else "validation"
    if ready.get(test_stage) is None:
        raise DataError("There is neither a test nor a validation set: give --test_file, "
                        "--n_test or --test_fraction, or --valid_fraction above 0.")

    n_train = len(sets["training"]["R"]) if not hdf5 else len(rows["training"])
    optimizer, opt_note = T.optimizer(args, params, n_train // args.batch_size, family.untrained)
    notes.append(opt_note)
    template = family.template(cfg, displacement)
    ckpt_dir = os.path.join(out, "checkpoints")
    if args.ensemble_size > 1 and hdf5:
        raise DataError("--ensemble_size trains from in-memory data (each member draws its "
                        "own order): give --train_file as extxyz or npz, or train one model.")
    if args.ensemble_size > 1:
        notes.append(f"A committee of {args.ensemble_size} members, trained in one vectorised "
                     f"step" + (", each on its own bootstrap sample" if args.ensemble_bootstrap
                                else "") + ".")

    def build(optimizer, gammas):
        """The trainer (with its data) of one stage's optimizer and loss weights."""
        options = dict(batch=args.batch_size, parallelism=args.parallelism, gammas=gammas,
                       weights_keys=weights_keys, checkpoint_path=ckpt_dir,
                       log_file=os.path.join(out, "metrics.jsonl"), seed=args.seed,
                       losses=losses,
                       options=RunOptions(epoch_line=R.epoch_line(ready.get("validation"))))
        if args.ensemble_size > 1:
            trainer = EnsembleOfModels(M.committee_params(family, cfg, params, args, dtype, rms),
                                       optimizer,
                                       template, nbrs_init, bootstrap=args.ensemble_bootstrap,
                                       **options)
        else:
            trainer = ForceMatching(params, optimizer, template, nbrs_init, **options)
        if hdf5:
            trainer.set_loader(loader, "training")
        else:
            trainer.set_dataset(ready["training"], "training")
        for stage in ("validation", "testing"):
            if ready.get(stage) is not None:
                trainer.set_dataset(ready[stage], stage)
        return trainer

    def stage_two(checkpoint):
        """Stage two's trainer, continuing from ``checkpoint`` (the state at
        its first epoch, or later): its best model is stage two's own."""
        two = T.stage_two_args(args)
        g2 = {t: w * u_factor if t == "U" else w for t, w in M.gammas(two).items()}
        trainer = build(T.optimizer(two, params, n_train // args.batch_size,
                                    family.untrained)[0], g2)
        restore(trainer, [checkpoint])
        if trainer.epoch == start_two:
            # the loss weights change: so does the scale of the best loss, and a
            # plateau schedule starts afresh at --swa_lr
            host = optimizers.reset_plateau(trainer.strategy.to_host(trainer.opt_state))
            trainer.state = trainer.state.replace(best_loss=math.inf,
                                                  opt_state=trainer.strategy.replicate(host))
        return trainer

    start_two = T.stage_two_start(args)
    trainer = build(optimizer, gammas)
    root = trainer.strategy.is_root
    say = print if root else (lambda *a, **k: None)
    setup = {**setup_record(args, sets, rows, not args.foundation_model), "--model": family.name}
    check_ranks_agree(trainer.strategy, {**setup, "the model (E0s included)": family.config(cfg)})
    record = os.path.join(ckpt_dir, "setup.json")
    if earlier:
        check_resumed(setup, record)
    for note in notes:
        say(note)
    say(f"{args.train_file}: training on {n_train}, validating on "
        f"{0 if ready['validation'] is None else len(ready['validation']['R'])}, testing on "
        f"{len(ready[test_stage]['R'])} ({test_stage} set) structures; parallelism "
        f"{args.parallelism!r} -> {trainer.strategy.name}, {trainer.strategy.n_shards} shard(s), "
        f"global batch {args.batch_size}, {args.default_dtype}")
    if earlier:
        restore(trainer, earlier)
        if start_two is not None and trainer.epoch >= start_two:
            trainer = stage_two(earlier[-1])
        say(f"Resumed from {earlier[-1]} (epoch {trainer.epoch})")
    if root:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(record, "w") as f:
            json.dump(setup, f, indent=1)

    test = ready[test_stage]

    test_has_stress = "stress" in test and bool(np.any(test.get("stress_weight", 1.0)))
    if "stress" in gammas and not test_has_stress:
        say(f"The {test_stage} set has no stress labels: no stress errors are reported.")

    def measure(pred, params=None):
        s = R.summary(pred, test)
        if "stress" in gammas and test_has_stress:
            st = trainer.evaluate(test_stage, params=params)["stress"]
            s["stress_eV_per_A3"] = {k: v / D.STRESS for k, v in st.items()}
        return s

    pred_before = trainer.predict(test)
    before = measure(pred_before)
    label = "starting model" if not earlier else f"restored model (epoch {trainer.epoch})"
    say(R.line(label, before))
    from tqdm.contrib.logging import logging_redirect_tqdm
    with logging_redirect_tqdm():
        if start_two is not None and trainer.epoch < start_two:
            trainer.train(start_two - trainer.epoch, checkpoint_freq=args.checkpoint_every,
                          patience=args.patience)
            if trainer.epoch == start_two:   # not stopped early: on to stage two
                boundary = os.path.join(ckpt_dir, f"epoch_{trainer.epoch:05d}.npz")
                if trainer.epoch % args.checkpoint_every:
                    trainer.save_checkpoint(boundary)
                trainer = stage_two(boundary)
                say(f"Stage two from epoch {start_two}: learning rate {args.swa_lr:g}, weights "
                    f"energy {args.swa_energy_weight:g}, forces {args.swa_forces_weight:g}"
                    + (f", stress {args.swa_stress_weight:g}" if "stress" in gammas else ""))
        if not trainer.stopped_early:
            trainer.train(max(args.max_num_epochs - trainer.epoch, 0),
                          checkpoint_freq=args.checkpoint_every, patience=args.patience)
    if trainer.epoch % args.checkpoint_every:
        trainer.save_checkpoint(os.path.join(ckpt_dir, f"epoch_{trainer.epoch:05d}.npz"))
    final, which = M.final_params(trainer, args.export_model)
    pred_after = trainer.predict(test, params=final)
    after = measure(pred_after, final)
    say(R.line(f"trained (epoch {trainer.epoch}{which})", after))
    results = {"before": before, "after": after, "epoch": trainer.epoch,
               "exported_epoch": M.exported_epoch(trainer, args.export_model),
               "stopped_early": trainer.stopped_early, "test_set": test_stage,
               "n_test": len(test["R"]), "test_rows": rows[test_stage].tolist()
               if not (test_stage == "testing" and args.test_file) else None,
               "parallelism": trainer.strategy.name, "n_shards": trainer.strategy.n_shards,
               "train_file": args.train_file, "model": family.name, "config": family.config(cfg)}
    if root:
        os.makedirs(out, exist_ok=True)  # also after 0 epochs, when nothing else made it
        plot = os.path.join(out, "parity.png")
        R.parity_plot(plot, test, {label: pred_before, f"trained, epoch {trainer.epoch}":
                                   pred_after}, f"{test_stage} set: {len(test['R'])} structures")
        metrics = os.path.join(out, "metrics.jsonl")
        curve = os.path.join(out, "curve.png")
        if os.path.exists(metrics) and R.curve_plot(curve, metrics):
            results["curve_plot"] = curve
        results.update(M.write_models(out, args, family, cfg, trainer, final))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(M.relative_files(results, out), f, indent=1)
        say(f"Parity plot: {plot}" + (f"; learning curve: {curve}" if "curve_plot" in results else ""))
        say(R.models_note(results, args.default_dtype, family.calculator))
    return results


def main(argv=None) -> int:
    """Console entry point of ``chemtrain-finetune``: :func:`run` with logging to stdout.

    Errors in the flags or the data (:class:`DataError`) end the job with
    their message on stderr (``chemtrain-finetune: error: ...``) and exit
    code 2; nothing has been written then. An error raised on every process
    is printed once, by rank 0. Under an MPI launcher with several ranks an
    error on one rank only ends every rank (``MPI_Abort`` with code 2): the
    others may be waiting for it in a collective. Other exceptions
    propagate.

    Args:
      argv: the command-line arguments without the program name; None:
        ``sys.argv[1:]``.

    Returns:
      The exit code, 0 when the job finished and 2 after a :class:`DataError`.

    Raises:
      SystemExit: from the argument parser, for unknown or invalid flags
        (code 2) and for ``--help`` (code 0).
    """
    # chemtrain's lines at INFO; other libraries' INFO (jax's, matplotlib's
    # "generated new fontManager" on a fresh machine) stays out of the log
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("chemtrain").setLevel(logging.INFO)
    try:
        run(argv)
    except DataError as e:
        everywhere = is_raised_everywhere(e)
        if not everywhere or _rank() == 0:  # an error of every rank is printed once
            print(f"chemtrain-finetune: error: {e}", file=sys.stderr, flush=True)
        if not everywhere:
            _end_every_rank(2)
        return 2
    return 0


def _rank() -> int:
    from ..parallel import mpi_world_size
    if mpi_world_size() > 1:
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank()
    import jax
    return jax.process_index()


def _end_every_rank(code: int) -> None:
    """Abort the whole MPI job when this process is one of several ranks."""
    from ..parallel import mpi_world_size
    if mpi_world_size() > 1:
        from mpi4py import MPI
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(code)
