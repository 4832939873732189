"""The active-learning loop as phases of one folder.

Round 0 trains the first committee on the seed labels. Every later round:
``md`` (runs with the committee, watched, :mod:`chemtrain.active.md`),
``pick`` (a diverse subset of the uncertain frames and the last sane frames
of runs that exploded), ``label`` (the oracle, one file per structure),
``train`` (``chemtrain-finetune`` from the members' current parameters) and
``assess`` (test errors, the next threshold, calibration, plots). Each phase
writes its results whole and then records in ``state.json`` that it is
done, so a restart repeats at most the phase that was cut short; MD and
picks follow from the seed and the round, training resumes from its last
epoch's checkpoint, labels already written are not asked for again.
"""
from __future__ import annotations

import glob
import os
import shutil

import numpy as np

from . import files as F
from . import md as MD
from . import pick as P
from . import report as R
from ..finetune.family import committee_of
from .folder import Paths, locked, start
from .settings import Settings

PHASES = ("md", "pick", "label", "train", "assess")


def run(folder: str, oracle=None, seeds=None, labelled=None, settings: Settings | None = None,
        test=None, calibration=None, say=print) -> dict:
    """Run (or continue) the loop in ``folder`` to its last round.

    Args:
      folder: the run's folder (created; a restart names the same folder).
      oracle: the reference method, an ASE calculator or a function of no
        arguments returning one; needed while labels remain to be made.
      seeds: the structures MD starts from (``ase.Atoms`` or a file); new runs only.
      labelled: the seed labels (``REF_energy``/``REF_forces`` or a
        calculator's results); new runs only.
      settings: :class:`~chemtrain.active.Settings`; a restart may only raise ``rounds``.
      test, calibration: optional labelled sets: the test force RMSE of
        each round's committee, and the spread's scale (uncertainty.fit_scale).
      say: where progress lines go.

    Raises:
      chemtrain.active.folder.FolderInUse: another process is working in
        ``folder`` (a RuntimeError).

    Returns:
      A dict: ``rounds``, each round's summary (``round_NNN/summary.json``);
      ``members``, the final committee's member files; ``labelled``, the
      path of all labels.
    """
    with locked(folder):
        return _run(start(folder, seeds, labelled, settings, test, calibration), oracle, say)


def _run(paths: Paths, oracle, say) -> dict:
    s = Settings.from_json(F.read_json(paths.settings))
    while True:
        state = F.read_json(paths.state)
        r, phase = state["round"], state["phase"]
        if phase == "done" and s.rounds > state.get("rounds", r):   # given more rounds
            F.write_json(paths.state, {"round": r + 1, "phase": "md"})
            continue
        if phase == "done":
            break
        say(f"round {r}: {phase}")
        nxt = PHASE_FUNCTIONS[phase](paths, s, r, oracle, say)
        F.write_json(paths.state, nxt)
    summaries = [F.read_json(paths.round(k, "summary.json"))
                 for k in range(s.rounds + 1) if os.path.exists(paths.round(k, "summary.json"))]
    return {"rounds": summaries, "members": paths.members(last_trained(paths, s.rounds)),
            "labelled": paths.labelled, "stopped": F.read_json(paths.state).get("stopped")}


def last_trained(paths: Paths, r: int) -> int:
    while r > 0 and not paths.members(r):
        r -= 1
    return r


def quiet_rounds(paths: Paths, r: int) -> int:
    """Rounds in a row, up to ``r``, whose MD runs found no uncertain frame
    and did not explode."""
    n = 0
    for k in range(r, 0, -1):
        records = F.read_json(paths.round(k, "md.json"))
        if records is None or any(rec["uncertain"] or rec["sane"] for rec in records):
            break
        n += 1
    return n


def _next_round(paths: Paths, r: int, s: Settings, say) -> dict:
    """The state after round ``r``: the next round's MD, or done after the
    last round or after ``Settings.stop_when_quiet`` quiet rounds."""
    if r >= s.rounds:
        return {"round": r, "phase": "done", "rounds": s.rounds}
    quiet = quiet_rounds(paths, r)
    if s.stop_when_quiet is not None and s.selection != "random" and quiet >= s.stop_when_quiet:
        why = (f"{quiet} rounds in a row without an uncertain frame (stop_when_quiet="
               f"{s.stop_when_quiet})")
        F.append_log(paths.folder, {"event": "stop", "round": r, "why": why})
        say(f"  stopping: {why}")
        return {"round": r, "phase": "done", "rounds": s.rounds, "stopped": why}
    return {"round": r + 1, "phase": "md"}


def phase_md(paths: Paths, s: Settings, r: int, oracle, say) -> dict:
    prev = F.read_json(paths.round(r - 1, "summary.json"))
    committee = committee_of(paths.members(last_trained(paths, r - 1)))
    seeds = F.read_frames(paths.seeds)
    runs = [(k, t) for k in range(len(seeds)) for t in s.temperatures_K]
    records = []
    for j, (k, t) in enumerate(runs):
        before = F.read_frames(paths.round(r - 1, f"md_{j}.extxyz"))
        was = (F.read_json(paths.round(r - 1, "md.json"), [{}] * len(runs))[j])
        start_from = before[-1] if before and not was.get("end", "").startswith("exploded") \
            else seeds[k]
        out = MD.run(start_from, committee, temperature_K=t, steps=s.md_steps,
                     timestep_fs=s.timestep_fs, friction_per_fs=s.friction_per_fs,
                     record_every=s.record_every, threshold=prev["next_threshold"],
                     scale=prev["scale"], stop_after=s.uncertain_per_run,
                     max_force=s.max_force, min_distance=F.read_json(paths.guards)[
                         "min_distance"],
                     keep_sane=s.keep_sane, seed=s.seed * 100003 + r * 1009 + j)
        F.write_frames(paths.round(r, f"md_{j}.extxyz"), out["frames"])
        records.append({"seed": k, "temperature_K": t, "end": out["end"], "steps": out["steps"],
                        "uncertain": out["uncertain"], "sane": out["sane"],
                        "scores": [f.info["score"] for f in out["frames"]]})
        say(f"  MD run {j} ({t:g} K): {out['steps']} steps, {len(out['uncertain'])} uncertain "
            f"frames, end: {out['end']}")
    F.write_json(paths.round(r, "md.json"), records)
    R.plot_spread(paths.round(r, "spread.png"), records, prev["next_threshold"], s.record_every)
    F.append_log(paths.folder, {"event": "md", "round": r,
                                "runs": [{k: v for k, v in rec.items() if k != "scores"}
                                         for rec in records]})
    return {"round": r, "phase": "pick"}


def choose(s: Settings, r: int, records: list, frames: dict, known: list) -> list[dict]:
    """The picks of round ``r``: the last sane frames of runs that exploded
    first, then ``Settings.selection`` among the rest, up to
    ``labels_per_round``; each with why it was picked."""
    forced = [(j, i) for j, rec in enumerate(records) for i in rec["sane"]][:s.labels_per_round]
    room = s.labels_per_round - len(forced)
    if s.selection == "random":
        pool = [(j, i) for j, rec in enumerate(records) for i in range(len(rec["scores"]))
                if (j, i) not in forced]
    else:
        pool = [(j, i) for j, rec in enumerate(records) for i in rec["uncertain"]
                if (j, i) not in forced]
    scores = [records[j]["scores"][i] for j, i in pool]
    if s.selection == "diverse" and pool:
        pairs = P.pairs_of(known + [frames[j][i] for j, i in pool])
        chosen = P.diverse(scores, P.fingerprints([frames[j][i] for j, i in pool], pairs), room,
                           P.fingerprints(known, pairs))
    elif s.selection == "random":
        rng = np.random.default_rng([s.seed, r])
        chosen = sorted(rng.choice(len(pool), min(room, len(pool)), replace=False).tolist())
    else:
        chosen = np.argsort(-np.asarray(scores), kind="stable")[:room].tolist()
    why = {"diverse": "diverse uncertain", "top": "highest score", "random": "random"}
    return ([{"run": j, "frame": i, "why": "last sane frame before an explosion"}
             for j, i in forced]
            + [{"run": pool[c][0], "frame": pool[c][1], "score": scores[c],
                "why": why[s.selection]} for c in chosen])


def phase_pick(paths: Paths, s: Settings, r: int, oracle, say) -> dict:
    records = F.read_json(paths.round(r, "md.json"))
    frames = {j: F.read_frames(paths.round(r, f"md_{j}.extxyz")) for j in range(len(records))}
    picked = choose(s, r, records, frames, F.read_frames(paths.labelled))
    uncertain = sum(len(rec["uncertain"]) for rec in records)
    F.write_json(paths.round(r, "picked.json"), picked)
    F.append_log(paths.folder, {"event": "pick", "round": r, "uncertain": uncertain,
                                "picked": picked})
    say(f"  picked {len(picked)} frames ({uncertain} uncertain)")
    if not picked:
        _summary(paths, r, prev=F.read_json(paths.round(r - 1, "summary.json")), new=0)
        return _next_round(paths, r, s, say)
    return {"round": r, "phase": "label"}


def _oracle(oracle):
    from ase.calculators.calculator import BaseCalculator
    if oracle is None:
        raise ValueError("Labels remain to be made: give the oracle (an ASE calculator, or a "
                         "function returning one).")
    return oracle if isinstance(oracle, BaseCalculator) else oracle()


def label_one(atoms, calc) -> tuple:
    """(labelled copy, None) or (None, why it failed): the oracle's energy and
    forces, refused when it raises or gives non-finite or misshapen values."""
    a = atoms.copy()
    a.calc = calc
    try:
        e, f = a.get_potential_energy(), np.asarray(a.get_forces(), float)
    except Exception as err:  # noqa: BLE001 - any failure of the reference method is reported
        return None, f"the oracle failed: {type(err).__name__}: {err}"
    if f.shape != (len(a), 3) or not (np.isfinite(e) and np.all(np.isfinite(f))):
        return None, f"the oracle gave energy {e!r} and forces of shape {f.shape} with " \
                     f"non-finite values"
    return F.labelled_copy(atoms, e, f), None


def phase_label(paths: Paths, s: Settings, r: int, oracle, say) -> dict:
    picked = F.read_json(paths.round(r, "picked.json"))
    folder = paths.round(r, "labels")
    os.makedirs(folder, exist_ok=True)
    calc, frames = None, {}
    for n, p in enumerate(picked):
        done = os.path.join(folder, f"{n:04d}.json")
        if os.path.exists(done):
            continue   # labelled (or refused) before a restart
        if p["run"] not in frames:
            frames[p["run"]] = F.read_frames(paths.round(r, f"md_{p['run']}.extxyz"))
        if calc is None:
            calc = _oracle(oracle)
        atoms, why = label_one(frames[p["run"]][p["frame"]], calc)
        if atoms is not None:
            F.write_frames(os.path.join(folder, f"{n:04d}.extxyz"), [atoms])
        F.write_json(done, {"pick": n, "ok": atoms is not None, "why": why})
        if why:
            say(f"  pick {n}: skipped, {why}")
    return _merge_labels(paths, s, r, picked, say)


def absurd(known: list, new: list) -> dict:
    """``{index in new: [reasons]}``: the new labels that ``chemtrain-finetune``
    would refuse as absurd outliers among ``known + new`` (labelled
    ``ase.Atoms``), e.g. a failed calculation or overlapping atoms."""
    import tempfile
    from ..finetune import data as D
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "labels.extxyz")
        F.write_frames(path, list(known) + list(new))
        rows = D.outlier_rows(D.read(path, F.ENERGY_KEY, F.FORCES_KEY))
    return {row - len(known): why for row, why in rows.items() if row >= len(known)}


def _merge_labels(paths, s, r, picked, say) -> dict:
    folder = paths.round(r, "labels")
    known = F.read_frames(paths.labelled)
    new, refused = [], []
    for n in range(len(picked)):
        rec = F.read_json(os.path.join(folder, f"{n:04d}.json"))
        if rec["ok"]:
            new += [(n, F.read_frames(os.path.join(folder, f"{n:04d}.extxyz"))[0])]
        else:
            refused.append(rec)
    if new:
        bad = absurd(known, [a for _, a in new])
        for k in sorted(bad, reverse=True):
            n, _ = new.pop(k)
            refused.append({"pick": n, "ok": False,
                            "why": "an absurd label: " + "; ".join(bad[k])})
            say(f"  pick {n}: skipped, an absurd label ({'; '.join(bad[k])})")
    F.write_json(paths.round(r, "refused.json"), sorted(refused, key=lambda x: x["pick"]))
    F.append_log(paths.folder, {"event": "label", "round": r, "labelled": [n for n, _ in new],
                                "refused": refused})
    if not new:
        _summary(paths, r, prev=F.read_json(paths.round(r - 1, "summary.json")), new=0)
        return _next_round(paths, r, s, say)
    F.write_frames(paths.labelled, known + [a for _, a in new])
    say(f"  {len(new)} new labels ({len(known) + len(new)} in all)")
    return {"round": r, "phase": "train"}


def phase_train(paths: Paths, s: Settings, r: int, oracle, say) -> dict:
    from .. import finetune
    out = paths.round(r, "train")
    resume = bool(glob.glob(os.path.join(out, "checkpoints", "epoch_*.npz")))
    if os.path.isdir(out) and not resume:
        shutil.rmtree(out)   # cut short before its first epoch: nothing to keep
    argv = ["--train_file", paths.labelled, "--results_dir", out, "--seed", str(s.seed + r),
            "--no_torch_export", "--checkpoint_every", "1", *s.finetune_args]
    if r == 0:
        argv += ["--ensemble_size", str(s.ensemble_size), "--max_num_epochs", str(s.epochs_first)]
    else:
        argv += ["--member_models", *paths.members(last_trained(paths, r - 1)),
                 "--max_num_epochs", str(s.epochs_per_round)]
        if not any(a.startswith("--E0s") for a in s.finetune_args):
            argv += ["--E0s", "foundation"]
    if os.path.exists(paths.test):
        argv += ["--test_file", paths.test]
    result = finetune.run(argv + (["--restart_latest"] if resume else []))
    F.write_json(paths.round(r, "trained.json"),
                 {k: result[k] for k in ("before", "after", "epoch", "test_set", "n_test")})
    return {"round": r, "phase": "assess"}


def phase_assess(paths: Paths, s: Settings, r: int, oracle, say) -> dict:
    from .. import uncertainty as U
    members = paths.members(r)
    committee = committee_of(members)
    known = F.read_frames(paths.labelled)
    median = float(np.median(U.scores(committee, known)))
    scale, calibration = 1.0, None
    if os.path.exists(paths.calibration):
        cal = F.read_frames(paths.calibration)
        predictions = U.committee_forces(committee, cal)
        reference = [a.arrays[F.FORCES_KEY] for a in cal]
        scale = U.fit_scale(predictions, reference)
        calibration = U.calibration(predictions, reference, scale)
    held_out = None
    if r > 0:   # this round's new labels, for the committee that picked them
        new = known[len(known) - _new_count(paths, r, len(known)):]
        if new:
            before = committee_of(paths.members(last_trained(paths, r - 1)))
            held_out = U.calibration(U.committee_forces(before, new),
                                     [a.arrays[F.FORCES_KEY] for a in new], scale)
    # MD compares scale x spread: a relative threshold is scaled alike
    threshold = s.threshold * median * scale if s.threshold_mode == "relative" else s.threshold
    trained = F.read_json(paths.round(r, "trained.json"))
    _summary(paths, r, prev=None, new=_new_count(paths, r, len(known)), labels=len(known),
             median_score=median, next_threshold=threshold, scale=scale,
             calibration=calibration, held_out=held_out, trained=trained)
    R.plot_rounds(os.path.join(paths.folder, "rounds.png"),
                  [F.read_json(paths.round(k, "summary.json")) for k in range(r + 1)
                   if os.path.exists(paths.round(k, "summary.json"))])
    F.append_log(paths.folder, {"event": "assess", "round": r, "labels": len(known),
                                "next_threshold": threshold, "scale": scale,
                                "test_force_rmse": R.test_rmse(trained)})
    say(f"  {len(known)} labels; next threshold {threshold:.4g} eV/Å"
        + (f"; test force RMSE {R.test_rmse(trained):.4g} eV/Å" if R.test_rmse(trained) else ""))
    return _next_round(paths, r, s, say)


def _new_count(paths, r, total) -> int:
    """Labels added in round ``r`` (all of them in round 0)."""
    return total - (_labels_before(paths, r) if r > 0 else 0)


def _labels_before(paths, r) -> int:
    for k in range(r - 1, -1, -1):
        summary = F.read_json(paths.round(k, "summary.json"))
        if summary is not None:
            return summary["labels"]
    return 0


def _summary(paths, r, prev=None, new=0, **fields) -> None:
    if prev is not None:   # a round without labels: the committee and threshold carry over
        fields = {k: prev.get(k) for k in ("labels", "median_score", "next_threshold", "scale",
                                           "calibration", "trained")}
        fields["carried_over"] = True
    F.write_json(paths.round(r, "summary.json"), {"round": r, "new_labels": new, **fields})


PHASE_FUNCTIONS = {"md": phase_md, "pick": phase_pick, "label": phase_label,
                   "train": phase_train, "assess": phase_assess}
