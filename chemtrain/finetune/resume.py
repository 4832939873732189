"""The results folder of a ``chemtrain-finetune`` job and resuming it: the
folder must be writable and must not hold another run (unless
``--restart_latest`` continues it), the set-up record (data, split, model
flags) a resumed run must match and every process must agree on, and
restoring the newest checkpoint.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os

from . import data as D
from . import model as M
from . import replay as P
from . import training as T
from ..checkpoint import why_not_writable
from ..parallel.failures import is_raised_everywhere, raised_everywhere
from .data import DataError


def check_writable(out: str) -> None:
    """``--results_dir`` must be (or become) a folder this process can write
    to; found before any work, not when the first file is written."""
    if not out.strip():
        raise DataError("--results_dir is empty; name a folder such as runs/mine.")
    problem = why_not_writable(out)
    if problem:
        raise DataError(f"--results_dir {out!r} {problem}; choose another --results_dir.")


def check_folder(out: str, name: str, restart: bool) -> list[str]:
    """Checkpoints to resume from; refuse a folder that holds another run."""
    check_writable(out)
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


def setup_record(args, sets: dict, rows: dict, model_flags: bool) -> dict:
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
    out.update({"--ensemble_size": args.ensemble_size,
                "--ensemble_bootstrap": args.ensemble_bootstrap,
                # what the optimizer's state holds: a resumed run must have the same
                "--ema": args.ema, "--freeze": args.freeze,
                "--scheduler ReduceLROnPlateau": args.scheduler == "ReduceLROnPlateau",
                "--pt_train_file (replay)": path(args.pt_train_file) if args.multiheads_finetuning
                and args.foundation_model else None,
                "--swa (first epoch of stage two)": T.stage_two_start(args),
                "--amsgrad": args.amsgrad, "--clip_grad": args.clip_grad,
                "--weight_decay": args.weight_decay})
    # the loss: its scale is what the best epoch (--export_model best) and a
    # plateau compare across the resume
    replay = P.active(args)
    out.update({"--loss": args.loss,
                "--huber_delta": args.huber_delta if args.loss != "weighted" else None,
                "--energy_weight": args.energy_weight, "--forces_weight": args.forces_weight,
                "--stress_weight": args.stress_weight,
                "--swa_energy_weight, --swa_forces_weight, --swa_stress_weight":
                    [args.swa_energy_weight, args.swa_forces_weight, args.swa_stress_weight]
                    if args.swa else None,
                "--weight_pt_head": args.weight_pt_head if replay else None,
                "--real_pt_data_ratio_threshold":
                    args.real_pt_data_ratio_threshold if replay else None})
    return out


def check_resumed(setup: dict, record: str) -> None:
    if not os.path.exists(record):
        return  # a run from before setup records: nothing to compare with
    with open(record) as f:
        # records of runs from before committees and EMA: one model, no average
        then = {"--ensemble_size": 1, "--ensemble_bootstrap": False, "--ema": False,
                "--freeze": None, "--scheduler ReduceLROnPlateau": False,
                "--pt_train_file (replay)": None, "--swa (first epoch of stage two)": None,
                # plain Adam before mace-torch's optimizer was the default
                "--amsgrad": False, "--clip_grad": 0.0, "--weight_decay": 0.0,
                "--model": "MACE", **json.load(f)}   # MACE alone before NequIP
    changed = [f"{k} (then {then[k]!r}, now {v!r})" if k.startswith("--") else k
               for k, v in setup.items() if k in then and then[k] != v]
    if changed:
        run_dir = os.path.dirname(os.path.dirname(record))
        raise DataError(f"--restart_latest continues the run in {run_dir!r}, "
                        f"which was started otherwise: {'; '.join(changed)}. A resumed run must "
                        f"train the same model on the same data and split: resume with that "
                        f"run's flags, or start a new run in another --results_dir.")


def check_ranks_agree(strategy, setup: dict) -> None:
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


def restore(trainer, earlier: list[str]) -> None:
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
