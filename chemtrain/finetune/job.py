"""The stages of a ``chemtrain-finetune`` job, in order (:data:`STAGES`).

:func:`configure` reads the flags into a :class:`Job`; each stage then takes
the job, reads what earlier stages set and sets its own fields. The model
family (``job.family``, :mod:`chemtrain.finetune.family`: MACE or NequIP)
is a value that every stage calls, so a new family needs no stage changed.

1. :func:`read_data`: the training, validation and test sets, checked.
2. :func:`starting_model`: the foundation model or a random one, E0s, and
   replay's heads.
3. :func:`trainer_inputs`: the arrays (or HDF5 loader) the trainer sees,
   loss weights, the optimizer and the energy template.
4. :func:`start_trainer`: the trainer, checked against a run it resumes.
5. :func:`train`: the test errors before, the epochs (and stage two), the
   test errors after.
6. :func:`write_results`: plots, model files and ``results.json``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import numpy as np

from . import data as D
from . import family as F
from . import model as M
from . import replay as P
from . import report as R
from . import training as T
from .cli import given, parse_args
from .data import DataError
from .inputs import check_edges, check_plausible, load_sets
from .resume import check_folder, check_ranks_agree, check_resumed, restore, setup_record


@dataclasses.dataclass
class Job:
    """What the stages know so far (see the module docs for who sets what)."""
    args: Any
    family: Any
    size_flags: set
    notes: list
    dtype: Any
    earlier: list
    weights: dict
    gammas: dict
    losses: Any
    per_atom: bool
    replay_note: str = None
    sets: dict = None
    rows: dict = None
    hdf5: bool = False
    cfg: Any = None
    params: Any = None
    foundation_cfg: Any = None
    rms: float = 1.0
    r_max_nm: float = None
    nbrs_init: Any = None
    u_factor: float = 1.0
    weights_keys: dict = None
    loader: Any = None
    ready: dict = None
    test_stage: str = None
    n_train: int = None
    optimizer: Any = None
    template: Callable = None
    trainer: Any = None
    say: Callable = print
    label: str = None
    pred_before: Any = None
    before: dict = None
    final: Any = None
    pred_after: Any = None
    after: dict = None
    results: dict = None

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.args.results_dir, "checkpoints")


def configure(argv) -> Job:
    """The flags, checked; the model family; JAX's precision and cache."""
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
    losses, per_atom = T.losses(args)
    return Job(args=args, family=family, size_flags=size_flags,
               notes=[family_note] if family_note else [], replay_note=replay_note,
               dtype=np.float64 if args.default_dtype == "float64" else np.float32,
               earlier=check_folder(args.results_dir, args.name, args.restart_latest),
               weights={"U": args.energy_weight, "F": args.forces_weight,
                        "stress": args.stress_weight},
               gammas=M.gammas(args), losses=losses, per_atom=per_atom)


def read_data(job: Job) -> None:
    job.sets, job.rows, job.hdf5 = load_sets(job.args, job.weights)
    check_plausible(job.args, job.sets, job.rows)


def starting_model(job: Job) -> None:
    import jax
    import jax.numpy as jnp
    args, family, dtype = job.args, job.family, job.dtype
    train = job.sets["training"]
    everything = [s for s in job.sets.values() if s is not None]
    if args.foundation_model:
        cfg, params = family.load(args.foundation_model, args.trust_foundation_model)
        if family.name == "MACE":
            cfg, params, head_note = M.foundation_head(cfg, params, args.foundation_model,
                                                       args.foundation_head)
            job.notes += [head_note] if head_note else []
        for s in everything:
            M.check_elements(cfg, s["species"], s["mask"], args.foundation_model)
        M.check_sizes_unused(cfg, args, job.size_flags, args.foundation_model, family.name)
        job.notes.append(f"Fine-tuning {args.foundation_model}: "
                         f"{family.describe(cfg, params)}.")
    r_max = family.r_max(cfg) if args.foundation_model else args.r_max
    for path in (args.train_file, args.valid_file, args.test_file):
        if path:
            D.check_graph_cutoff(path, r_max * D.LENGTH)
    sample = D.to_model_arrays(D.take(train, np.arange(min(32, len(train["R"])))),
                               r_max * D.LENGTH, dtype, False)
    check_edges(sample, r_max, bool(args.foundation_model))
    if not args.foundation_model:
        z = np.unique(np.concatenate([s["species"][s["mask"].astype(bool)] for s in everything]))
        job.rms = float(np.sqrt(np.mean(train["F"][train["mask"].astype(bool)] ** 2))) \
            / D.FORCE if "F" in train else 1.0
        cfg = family.random(z.tolist(), D.mean_pairs(sample), job.rms, args, job.size_flags)
        params = family.init(cfg, jax.random.PRNGKey(args.seed), dtype, job.rms)
        job.notes.append(f"No --foundation_model: a random {family.name}, "
                         f"{family.describe(cfg, params)}.")
    cast = lambda tree: jax.tree.map(lambda p: jnp.asarray(p, dtype), tree)  # noqa: E731
    params = cast(params)
    job.foundation_cfg = cfg
    job.r_max_nm = family.r_max(cfg) * D.LENGTH
    if args.E0s == "estimated" and args.foundation_model:
        cfg, params, e0_note = M.estimated_e0s(family, cfg, params, D.to_model_arrays(
            train, job.r_max_nm, dtype, False), train)
    else:
        cfg, params, e0_note = M.set_e0s(family, cfg, params, args.E0s, train,
                                         bool(args.foundation_model))
    params = cast(params)
    job.notes.append(e0_note)
    if P.active(args):   # heads pt_head and Default; the replayed structures join the training set
        pt = P.load_pretraining(args, job.foundation_cfg, job.weights, args.seed)
        cfg, params = P.heads_model(job.foundation_cfg, cfg, params)
        job.sets["training"], mix = P.combine(job.sets["training"], pt, args)
        for stage in ("validation", "testing"):
            job.sets[stage] = P.with_head(job.sets[stage], 1)
        job.notes += [n for n in (job.replay_note, mix) if n]
    job.cfg, job.params = cfg, params


def trainer_inputs(job: Job) -> None:
    """The data the trainer sees: graphs everywhere but in an HDF5 training
    file of molecules without graphs (a jax-md list, built for free space)."""
    import jax.numpy as jnp
    args, dtype, train, r_max_nm = job.args, job.dtype, job.sets["training"], job.r_max_nm
    displacement = None
    job.weights_keys = {"stress": "stress_weight"} if "stress" in job.gammas else {}
    if job.hdf5:
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
            job.nbrs_init = neighbors.neighbor_list(displacement, None, r_max_nm).allocate(
                jnp.asarray(train["R"][int(np.argmax(train["mask"].sum(1)))], dtype))
        if "U" in job.gammas and not job.per_atom:  # a per-atom energy loss through 1/N^2
            job.u_factor = float(np.mean(1.0 / train["mask"].sum(1) ** 2))
            job.gammas["U"] *= job.u_factor
        job.loader = HDF5ParallelDataLoader(args.train_file, keys=file_keys,
                                            rows=job.rows["training"], dtype=dtype)
        prep = lambda s: D.to_model_arrays(s, r_max_nm, dtype, False)  # noqa: E731
    else:
        if "U" in job.gammas and not job.per_atom:   # (error per atom)^2 = error^2 / N^2
            job.weights_keys["U"] = "U_weight"
        prep = lambda s: D.to_model_arrays(s, r_max_nm, dtype, True)  # noqa: E731
    job.ready = {stage: (prep(s) if s is not None else None) for stage, s in job.sets.items()
                 if not (job.hdf5 and stage == "training")}
    D.share_shapes([job.ready.get("validation"), job.ready.get("testing")])
    if P.active(args):
        job.weights_keys = P.weight_keys(job.ready, job.gammas, job.weights_keys)
    job.test_stage = "testing" if job.ready.get("testing") is not None else "validation"
    if job.ready.get(job.test_stage) is None:
        raise DataError("There is neither a test nor a validation set: give --test_file, "
                        "--n_test or --test_fraction, or --valid_fraction above 0.")
    job.n_train = len(job.sets["training"]["R"]) if not job.hdf5 else len(job.rows["training"])
    job.optimizer, opt_note = T.optimizer(args, job.params, job.n_train // args.batch_size,
                                          job.family.untrained)
    job.notes.append(opt_note)
    job.template = job.family.template(job.cfg, displacement)
    if args.ensemble_size > 1 and job.hdf5:
        raise DataError("--ensemble_size trains from in-memory data (each member draws its "
                        "own order): give --train_file as extxyz or npz, or train one model.")
    if args.ensemble_size > 1:
        job.notes.append(f"A committee of {args.ensemble_size} members, trained in one "
                         f"vectorised step" + (", each on its own bootstrap sample"
                                               if args.ensemble_bootstrap else "") + ".")


def build(job: Job, optimizer, gammas):
    """The trainer (with its data) of one stage's optimizer and loss weights."""
    from ..trainers import EnsembleOfModels, ForceMatching, RunOptions
    args, ready = job.args, job.ready
    options = dict(batch=args.batch_size, parallelism=args.parallelism, gammas=gammas,
                   weights_keys=job.weights_keys, checkpoint_path=job.ckpt_dir,
                   log_file=os.path.join(args.results_dir, "metrics.jsonl"), seed=args.seed,
                   losses=job.losses,
                   options=RunOptions(epoch_line=R.epoch_line(ready.get("validation"))))
    if args.ensemble_size > 1:
        trainer = EnsembleOfModels(M.committee_params(job.family, job.cfg, job.params, args,
                                                      job.dtype, job.rms),
                                   optimizer, job.template, job.nbrs_init,
                                   bootstrap=args.ensemble_bootstrap, **options)
    else:
        trainer = ForceMatching(job.params, optimizer, job.template, job.nbrs_init, **options)
    if job.hdf5:
        trainer.set_loader(job.loader, "training")
    else:
        trainer.set_dataset(ready["training"], "training")
    for stage in ("validation", "testing"):
        if ready.get(stage) is not None:
            trainer.set_dataset(ready[stage], stage)
    return trainer


def stage_two(job: Job, checkpoint: str):
    """Stage two's trainer, continuing from ``checkpoint`` (the state at its
    first epoch, or later): its best model is stage two's own."""
    from ..learn import optimizers
    two = T.stage_two_args(job.args)
    g2 = {t: w * job.u_factor if t == "U" else w for t, w in M.gammas(two).items()}
    trainer = build(job, T.optimizer(two, job.params, job.n_train // job.args.batch_size,
                                     job.family.untrained)[0], g2)
    restore(trainer, [checkpoint])
    if trainer.epoch == T.stage_two_start(job.args):
        # the loss weights change: so does the scale of the best loss, and a
        # plateau schedule starts afresh at --swa_lr
        host = optimizers.reset_plateau(trainer.strategy.to_host(trainer.opt_state))
        trainer.state = trainer.state.replace(best_loss=math.inf,
                                              opt_state=trainer.strategy.replicate(host))
    return trainer


def start_trainer(job: Job) -> None:
    """The trainer, its setup checked against every rank and against the run
    it resumes; the notes told; ``setup.json`` written."""
    args, ready = job.args, job.ready
    trainer = build(job, job.optimizer, job.gammas)
    root = trainer.strategy.is_root
    job.say = say = print if root else (lambda *a, **k: None)
    setup = {**setup_record(args, job.sets, job.rows, not args.foundation_model),
             "--model": job.family.name}
    check_ranks_agree(trainer.strategy,
                      {**setup, "the model (E0s included)": job.family.config(job.cfg)})
    record = os.path.join(job.ckpt_dir, "setup.json")
    if job.earlier:
        check_resumed(setup, record)
    for note in job.notes:
        say(note)
    say(f"{args.train_file}: training on {job.n_train}, validating on "
        f"{0 if ready['validation'] is None else len(ready['validation']['R'])}, testing on "
        f"{len(ready[job.test_stage]['R'])} ({job.test_stage} set) structures; parallelism "
        f"{args.parallelism!r} -> {trainer.strategy.name}, {trainer.strategy.n_shards} shard(s), "
        f"global batch {args.batch_size}, {args.default_dtype}")
    if job.earlier:
        restore(trainer, job.earlier)
        start_two = T.stage_two_start(args)
        if start_two is not None and trainer.epoch >= start_two:
            trainer = stage_two(job, job.earlier[-1])
        say(f"Resumed from {job.earlier[-1]} (epoch {trainer.epoch})")
    if root:
        os.makedirs(job.ckpt_dir, exist_ok=True)
        with open(record, "w") as f:
            json.dump(setup, f, indent=1)
    job.trainer = trainer


def _measure(job: Job, pred, params=None) -> dict:
    test = job.ready[job.test_stage]
    s = R.summary(pred, test)
    if "stress" in job.gammas and _test_has_stress(job):
        st = job.trainer.evaluate(job.test_stage, params=params)["stress"]
        s["stress_eV_per_A3"] = {k: v / D.STRESS for k, v in st.items()}
    return s


def _test_has_stress(job: Job) -> bool:
    test = job.ready[job.test_stage]
    return "stress" in test and bool(np.any(test.get("stress_weight", 1.0)))


def train(job: Job) -> None:
    """The test errors before and after; the epochs, with stage two."""
    args, say, test = job.args, job.say, job.ready[job.test_stage]
    if "stress" in job.gammas and not _test_has_stress(job):
        say(f"The {job.test_stage} set has no stress labels: no stress errors are reported.")
    job.pred_before = job.trainer.predict(test)
    job.before = _measure(job, job.pred_before)
    job.label = "starting model" if not job.earlier else \
        f"restored model (epoch {job.trainer.epoch})"
    say(R.line(job.label, job.before))
    start_two = T.stage_two_start(args)
    from tqdm.contrib.logging import logging_redirect_tqdm
    with logging_redirect_tqdm():
        if start_two is not None and job.trainer.epoch < start_two:
            job.trainer.train(start_two - job.trainer.epoch,
                              checkpoint_freq=args.checkpoint_every, patience=args.patience)
            if job.trainer.epoch == start_two:   # not stopped early: on to stage two
                boundary = os.path.join(job.ckpt_dir, f"epoch_{job.trainer.epoch:05d}.npz")
                if job.trainer.epoch % args.checkpoint_every:
                    job.trainer.save_checkpoint(boundary)
                job.trainer = stage_two(job, boundary)
                say(f"Stage two from epoch {start_two}: learning rate {args.swa_lr:g}, weights "
                    f"energy {args.swa_energy_weight:g}, forces {args.swa_forces_weight:g}"
                    + (f", stress {args.swa_stress_weight:g}" if "stress" in job.gammas
                       else ""))
        if not job.trainer.stopped_early:
            job.trainer.train(max(args.max_num_epochs - job.trainer.epoch, 0),
                              checkpoint_freq=args.checkpoint_every, patience=args.patience)
    trainer = job.trainer
    if trainer.epoch % args.checkpoint_every:
        trainer.save_checkpoint(os.path.join(job.ckpt_dir, f"epoch_{trainer.epoch:05d}.npz"))
    job.final, which = M.final_params(trainer, args.export_model)
    job.pred_after = trainer.predict(test, params=job.final)
    job.after = _measure(job, job.pred_after, job.final)
    say(R.line(f"trained (epoch {trainer.epoch}{which})", job.after))


def write_results(job: Job) -> None:
    """``results.json``'s dict; on the root process the plots, the model
    files and ``results.json`` itself."""
    args, trainer, family, out = job.args, job.trainer, job.family, job.args.results_dir
    test, test_stage = job.ready[job.test_stage], job.test_stage
    results = {"before": job.before, "after": job.after, "epoch": trainer.epoch,
               "exported_epoch": M.exported_epoch(trainer, args.export_model),
               "stopped_early": trainer.stopped_early, "test_set": test_stage,
               "n_test": len(test["R"]), "test_rows": job.rows[test_stage].tolist()
               if not (test_stage == "testing" and args.test_file) else None,
               "parallelism": trainer.strategy.name, "n_shards": trainer.strategy.n_shards,
               "train_file": args.train_file, "model": family.name,
               "config": family.config(job.cfg)}
    if trainer.strategy.is_root:
        os.makedirs(out, exist_ok=True)  # also after 0 epochs, when nothing else made it
        plot = os.path.join(out, "parity.png")
        R.parity_plot(plot, test, {job.label: job.pred_before,
                                   f"trained, epoch {trainer.epoch}": job.pred_after},
                      f"{test_stage} set: {len(test['R'])} structures")
        metrics = os.path.join(out, "metrics.jsonl")
        curve = os.path.join(out, "curve.png")
        if os.path.exists(metrics) and R.curve_plot(curve, metrics):
            results["curve_plot"] = curve
        results.update(M.write_models(out, args, family, job.cfg, trainer, job.final))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(M.relative_files(results, out), f, indent=1)
        job.say(f"Parity plot: {plot}"
                + (f"; learning curve: {curve}" if "curve_plot" in results else ""))
        job.say(R.models_note(results, args.default_dtype, family.calculator))
    job.results = results


STAGES = (read_data, starting_model, trainer_inputs, start_trainer, train, write_results)
