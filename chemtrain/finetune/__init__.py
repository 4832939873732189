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

import glob
import hashlib
import json
import logging
import os
import sys

import numpy as np

from . import data as D
from . import model as M
from . import report as R
from .cli import given, parse_args
from ..checkpoint import why_not_writable
from ..parallel.failures import is_raised_everywhere, raised_everywhere
from .data import DataError

log = logging.getLogger("chemtrain")

__all__ = ["main", "run", "DataError"]


def _check_writable(out: str) -> None:
    """``--results_dir`` must be (or become) a folder this process can write
    to; found before any work, not when the first file is written."""
    if not out.strip():
        raise DataError("--results_dir is empty; name a folder such as runs/mine.")
    problem = why_not_writable(out)
    if problem:
        raise DataError(f"--results_dir {out!r} {problem}; choose another --results_dir.")


def _check_folder(out: str, name: str, restart: bool) -> list[str]:
    """Checkpoints to resume from; refuse a folder that holds another run."""
    _check_writable(out)
    earlier = sorted(glob.glob(os.path.join(out, "checkpoints", "epoch_*.npz")))
    if restart:
        if not earlier:
            raise DataError(f"--restart_latest: no checkpoint in {os.path.join(out, 'checkpoints')}; "
                            f"run without it first.")
        return earlier
    theirs = earlier + [p for p in (os.path.join(out, f) for f in
                                    ("results.json", "metrics.jsonl", f"{name}.npz", f"{name}.model"))
                        if os.path.exists(p)]
    if theirs:
        raise DataError(f"{out!r} holds another run ({', '.join(os.path.basename(p) for p in theirs[:4])}"
                        f"); nothing was changed. Continue it with --restart_latest, or choose "
                        f"another --results_dir.")
    return []


def _load_sets(args, weights):
    """(sets, rows, hdf5): ``sets`` hold the raw training structures (for an
    HDF5 training file: its training rows, read for statistics only) and the
    validation and test sets (None where there are none); ``rows`` the split
    of the training file; ``hdf5`` whether training reads from that file."""
    path = args.train_file
    hdf5 = D.kind(path) == "hdf5"
    if hdf5:
        import h5py
        if not os.path.exists(path):
            raise DataError(f"{path!r} does not exist.")
        with h5py.File(path, "r") as f:
            n = len(f["R"])
    else:
        full = D.read(path, args.energy_key, args.forces_key, args.stress_key)
        D.check_labels(full, path, weights)
        n = len(full["R"])
    rows = D.split(n, args, args.valid_file is not None, args.test_file is not None)
    pick = (lambda r: D.read_hdf5(path, r)) if hdf5 else (lambda r: D.take(full, r))
    sets = {"training": pick(rows["training"])}
    if hdf5:
        D.check_labels(sets["training"], path, weights)
    for stage, flag in (("validation", args.valid_file), ("testing", args.test_file)):
        if flag:
            sets[stage] = D.read(flag, args.energy_key, args.forces_key, args.stress_key)
            D.check_labels(sets[stage], flag, weights)
        else:
            sets[stage] = pick(rows[stage]) if len(rows[stage]) else None
    return sets, rows, hdf5


def _check_plausible(args, sets: dict, rows: dict) -> None:
    """Refuse absurd outliers (unless --allow_outliers) and warn about forces
    too large for eV/Å."""
    files = {"training": args.train_file, "validation": args.valid_file or args.train_file,
             "testing": args.test_file or args.train_file}
    found = []
    for stage, d in sets.items():
        if d is None:
            continue
        from_file = (stage == "validation" and args.valid_file) or (stage == "testing"
                                                                    and args.test_file)
        for text in D.outliers(d, None if from_file else rows[stage]):
            found.append(f"{files[stage]!r} {text}")
    if found and not args.allow_outliers:
        raise DataError(f"{len(found)} structure(s) are absurd outliers and would wreck the fit: "
                        f"{'; '.join(found[:5])}{' ...' if len(found) > 5 else ''}. Remove them "
                        f"(overlapping atoms? a failed calculation?), or pass --allow_outliers to "
                        f"train on them anyway.")
    D.check_force_scale(sets["training"], args.train_file, log)


def _check_edges(sample: dict, r_max: float, foundation: bool) -> None:
    if D.mean_pairs(sample) == 0:
        whose = "the foundation model's r_max" if foundation else "--r_max"
        raise DataError(f"No atom of the first {len(sample['R'])} training structures has a "
                        f"neighbour within {whose} = {r_max:g} Å, so the model would see no "
                        f"edges. --r_max is in Å (as mace-torch's), typically 4-6; a value in "
                        f"nm must be multiplied by 10.")


def _setup(args, sets: dict, rows: dict, model_flags: bool) -> dict:
    """What a resumed run must share with the run it continues, by flag."""
    path = lambda p: None if p is None else os.path.abspath(p)  # noqa: E731
    split = hashlib.sha256(json.dumps({k: v.tolist() for k, v in rows.items()}).encode())
    out = {"--train_file": path(args.train_file),
           "the content of --train_file": D.fingerprint(sets["training"]),
           "--valid_file": path(args.valid_file), "--test_file": path(args.test_file),
           "the content of --valid_file": args.valid_file and D.fingerprint(sets["validation"]),
           "the content of --test_file": args.test_file and D.fingerprint(sets["testing"]),
           "--seed": args.seed,
           "the split (--n_train, --n_valid, --n_test, --valid_fraction, --test_fraction)":
               split.hexdigest()[:16],
           "--default_dtype": args.default_dtype, "--foundation_model": path(args.foundation_model),
           "--E0s": args.E0s}
    if model_flags:
        out.update({f"--{k}": getattr(args, k) for k in M.SIZE_FLAGS})
    return out


def _check_resumed(setup: dict, record: str) -> None:
    if not os.path.exists(record):
        return  # a run from before setup records: nothing to compare with
    with open(record) as f:
        then = json.load(f)
    changed = [f"{k} (then {then[k]!r}, now {v!r})" if k.startswith("--") else k
               for k, v in setup.items() if k in then and then[k] != v]
    if changed:
        run_dir = os.path.dirname(os.path.dirname(record))
        raise DataError(f"--restart_latest continues the run in {run_dir!r}, "
                        f"which was started otherwise: {'; '.join(changed)}. A resumed run must "
                        f"train the same model on the same data and split: resume with that "
                        f"run's flags, or start a new run in another --results_dir.")


def _check_ranks_agree(strategy, setup: dict) -> None:
    """Every process must build the same model from the same data: each
    reads its own copy of the files (node-local copies may differ)."""
    everyone = [json.loads(t) for t in strategy.host_allgather_object(
        json.dumps(setup, sort_keys=True, default=str))]
    mine = everyone[0]
    differ = [k for k in mine if any(e.get(k) != mine[k] for e in everyone[1:])]
    if differ:
        raise raised_everywhere(DataError(
            f"The processes of this run disagree on the data, split and model set-up: "
            f"{'; '.join(differ)} differ between processes. Every process must read the same "
            f"files with the same flags (node-local copies must be identical)."))


def _restore(trainer, earlier: list[str]) -> None:
    import zipfile
    try:
        trainer.restore(earlier[-1])
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
        fix = (f"If it is damaged (e.g. a run killed while it was written), move it away; "
               f"--restart_latest then resumes from {earlier[-2]!r}." if len(earlier) > 1 else
               "There is no earlier checkpoint; start the run again in another --results_dir.")
        error = DataError(f"--restart_latest cannot read the newest checkpoint {earlier[-1]!r} "
                          f"({type(e).__name__}: {str(e)[:300]}). {fix}")
        # read on the root and raised on every process: printed once, no abort
        raise (raised_everywhere(error) if is_raised_everywhere(e) else error) from None


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
      ``train_file`` and ``config`` (the MACE configuration as a dict). On
      the root process also the paths ``model_npz``, ``model_torch`` (unless
      ``--no_torch_export``) and ``curve_plot`` (when a learning curve was
      drawn).

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
    import jax
    if args.default_dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    if args.jax_cache:
        jax.config.update("jax_compilation_cache_dir", args.jax_cache)
    import jax.numpy as jnp
    import optax
    from ..models import mace
    from ..trainers import ForceMatching
    dtype = np.float64 if args.default_dtype == "float64" else np.float32
    out = args.results_dir
    earlier = _check_folder(out, args.name, args.restart_latest)
    weights = {"U": args.energy_weight, "F": args.forces_weight, "stress": args.stress_weight}
    gammas = M.gammas(args)
    sets, rows, hdf5 = _load_sets(args, weights)
    _check_plausible(args, sets, rows)
    train = sets["training"]
    everything = [s for s in sets.values() if s is not None]
    notes = []

    # the starting model
    if args.foundation_model:
        cfg, params = M.load_foundation(args.foundation_model, args.trust_foundation_model)
        for s in everything:
            M.check_elements(cfg, s["species"], s["mask"], args.foundation_model)
        M.check_sizes_unused(cfg, args, size_flags, args.foundation_model)
        notes.append(f"Fine-tuning {args.foundation_model}: {M.describe(cfg, params)}.")
    r_max = cfg.r_max if args.foundation_model else args.r_max
    for path in (args.train_file, args.valid_file, args.test_file):
        if path:
            D.check_graph_cutoff(path, r_max * D.LENGTH)
    sample = D.prepare(D.take(train, np.arange(min(32, len(train["R"])))), r_max * D.LENGTH,
                       dtype, False)
    _check_edges(sample, r_max, bool(args.foundation_model))
    if not args.foundation_model:
        z = np.unique(np.concatenate([s["species"][s["mask"].astype(bool)] for s in everything]))
        rms = float(np.sqrt(np.mean(train["F"][train["mask"].astype(bool)] ** 2))) / D.FORCE \
            if "F" in train else 1.0
        cfg = M.random_config(z.tolist(), D.mean_pairs(sample), rms,
                              **{k: getattr(args, k) for k in M.SIZE_FLAGS})
        params = mace.init_params(cfg, jax.random.PRNGKey(args.seed), dtype)
        notes.append(f"No --foundation_model: a random MACE, {M.describe(cfg, params)}.")
    params = jax.tree.map(lambda p: jnp.asarray(p, dtype), params)
    cfg, e0_note = M.set_e0s(cfg, args.E0s, train, bool(args.foundation_model))
    notes.append(e0_note)
    r_max_nm = cfg.r_max * D.LENGTH

    # the data the trainer sees: graphs everywhere but in an HDF5 training
    # file of molecules without graphs (a jax-md list, built for free space)
    nbrs_init, displacement = None, None
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
        if "U" in gammas:  # a per-atom energy loss through the mean 1/N^2 of the training rows
            gammas["U"] *= float(np.mean(1.0 / train["mask"].sum(1) ** 2))
        loader = HDF5ParallelDataLoader(args.train_file, keys=file_keys, rows=rows["training"],
                                        dtype=dtype)
        prep = lambda s: D.prepare(s, r_max_nm, dtype, False)  # noqa: E731
    else:
        if "U" in gammas:
            weights_keys["U"] = "U_weight"
        prep = lambda s: D.prepare(s, r_max_nm, dtype, True)  # noqa: E731
    ready = {stage: (prep(s) if s is not None else None) for stage, s in sets.items()
             if not (hdf5 and stage == "training")}
    test_stage = "testing" if ready.get("testing") is not None else "validation"
    if ready.get(test_stage) is None:
        raise DataError("There is neither a test nor a validation set: give --test_file, "
                        "--n_test or --test_fraction, or --valid_fraction above 0.")

    n_train = len(rows["training"])
    steps = max(args.max_num_epochs * (n_train // args.batch_size), 1)
    optimizer = optax.adam(optax.cosine_decay_schedule(args.lr, steps, alpha=0.05))
    template = mace.energy_fn_template(cfg, displacement)
    ckpt_dir = os.path.join(out, "checkpoints")
    trainer = ForceMatching(params, optimizer, template, nbrs_init, batch=args.batch_size,
                            parallelism=args.parallelism, gammas=gammas, weights_keys=weights_keys,
                            checkpoint_path=ckpt_dir, log_file=os.path.join(out, "metrics.jsonl"),
                            seed=args.seed, epoch_line=R.epoch_line(ready.get("validation")))
    root = trainer.strategy.is_root
    say = print if root else (lambda *a, **k: None)
    setup = _setup(args, sets, rows, not args.foundation_model)
    _check_ranks_agree(trainer.strategy, {**setup, "the model (E0s included)":
                                          json.loads(cfg.to_json())})
    record = os.path.join(ckpt_dir, "setup.json")
    if earlier:
        _check_resumed(setup, record)
    for note in notes:
        say(note)
    say(f"{args.train_file}: training on {n_train}, validating on "
        f"{0 if ready['validation'] is None else len(ready['validation']['R'])}, testing on "
        f"{len(ready[test_stage]['R'])} ({test_stage} set) structures; parallelism "
        f"{args.parallelism!r} -> {trainer.strategy.name}, {trainer.strategy.n_shards} shard(s), "
        f"global batch {args.batch_size}, {args.default_dtype}")
    if hdf5:
        trainer.set_loader(loader, "training")
    else:
        trainer.set_dataset(ready["training"], "training")
    for stage in ("validation", "testing"):
        if ready.get(stage) is not None:
            trainer.set_dataset(ready[stage], stage)
    if earlier:
        _restore(trainer, earlier)
        say(f"Resumed from {earlier[-1]} (epoch {trainer.epoch})")
    if root:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(record, "w") as f:
            json.dump(setup, f, indent=1)

    test = ready[test_stage]

    test_has_stress = "stress" in test and bool(np.any(test.get("stress_weight", 1.0)))
    if "stress" in gammas and not test_has_stress:
        say(f"The {test_stage} set has no stress labels: no stress errors are reported.")

    def measure(pred):
        s = R.summary(pred, test)
        if "stress" in gammas and test_has_stress:
            st = trainer.evaluate(test_stage)["stress"]
            s["stress_eV_per_A3"] = {k: v / D.STRESS for k, v in st.items()}
        return s

    pred_before = trainer.predict(test)
    before = measure(pred_before)
    label = "starting model" if not earlier else f"restored model (epoch {trainer.epoch})"
    say(R.line(label, before))
    from tqdm.contrib.logging import logging_redirect_tqdm
    with logging_redirect_tqdm():
        trainer.train(max(args.max_num_epochs - trainer.epoch, 0),
                      checkpoint_freq=args.checkpoint_every)
    if trainer.epoch % args.checkpoint_every:
        trainer.save_checkpoint(os.path.join(ckpt_dir, f"epoch_{trainer.epoch:05d}.npz"))
    pred_after = trainer.predict(test)
    after = measure(pred_after)
    say(R.line(f"trained (epoch {trainer.epoch})", after))
    results = {"before": before, "after": after, "epoch": trainer.epoch, "test_set": test_stage,
               "n_test": len(test["R"]), "test_rows": rows[test_stage].tolist()
               if not (test_stage == "testing" and args.test_file) else None,
               "parallelism": trainer.strategy.name, "n_shards": trainer.strategy.n_shards,
               "train_file": args.train_file, "config": json.loads(cfg.to_json())}
    if root:
        os.makedirs(out, exist_ok=True)  # also after 0 epochs, when nothing else made it
        plot = os.path.join(out, "parity.png")
        R.parity_plot(plot, test, {label: pred_before, f"trained, epoch {trainer.epoch}":
                                   pred_after}, f"{test_stage} set: {len(test['R'])} structures")
        metrics = os.path.join(out, "metrics.jsonl")
        curve = os.path.join(out, "curve.png")
        if os.path.exists(metrics) and R.curve_plot(curve, metrics):
            results["curve_plot"] = curve
        model_npz = os.path.join(out, f"{args.name}.npz")
        mace.save(model_npz, cfg, trainer.params)
        results["model_npz"] = model_npz
        if not args.no_torch_export:
            model_torch = os.path.join(out, f"{args.name}.model")
            mace.export_mace_torch(cfg, trainer.params, model_torch, overwrite=True)  # ours
            results["model_torch"] = model_torch
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        say(f"Parity plot: {plot}" + (f"; learning curve: {curve}" if "curve_plot" in results else ""))
        say(f"Model: {model_npz}" + (f" and {results['model_torch']}" if "model_torch" in results
                                     else ""))
        say("Load it in ASE:\n"
            f"  from chemtrain.calculator import ChemtrainCalculator; "
            f"atoms.calc = ChemtrainCalculator.from_mace({model_npz!r})"
            + ("" if "model_torch" not in results else
               f"\n  from mace.calculators import MACECalculator; atoms.calc = "
               f"MACECalculator(model_paths={results['model_torch']!r}, device='cpu', "
               f"default_dtype={args.default_dtype!r})"))
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
