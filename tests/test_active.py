"""chemtrain.active: the on-the-fly loop (MD with a committee, picks, EMT
labels, retraining), its guards, and restarts after SIGKILL during MD,
labelling and training."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from active_run import cu, emt, inputs, settings


def _state(folder):
    try:
        with open(os.path.join(folder, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _killed_when(folder, ready, timeout=600.0):
    """Run (or continue) the test run in its own process and SIGKILL its
    process group once ``ready()``; the state it was killed in."""
    import mp
    log = folder + ".log"   # a file, not a pipe that a chatty process could fill
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, os.path.join(mp.HERE, "active_run.py"), folder],
                                env=mp.env(devices=4), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        started = time.monotonic()
        try:
            while not ready():
                assert proc.poll() is None, f"the run ended before the kill:\n{open(log).read()}"
                assert time.monotonic() - started < timeout, "the run never got there"
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)   # a failed assertion leaves no process
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return _state(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run twice: once straight through in this process, once in
    processes of its own, each killed by SIGKILL, during MD, while labelling
    and while training, and the last one left to finish."""
    from ase.calculators.emt import EMT
    from chemtrain import active
    root = tmp_path_factory.mktemp("active")
    ref = active.run(str(root / "ref"), oracle=EMT, say=lambda line: None, **inputs())
    folder = str(root / "killed")
    r1 = os.path.join(folder, "round_001")
    at, evidence = {}, {}

    # MD of the test run takes well under a second: killed as soon as it starts
    at["md"] = _killed_when(folder, lambda: _state(folder) == {"round": 1, "phase": "md"})
    evidence["md"] = os.path.exists(os.path.join(r1, "md.json"))
    at["label"] = _killed_when(folder, lambda: _state(folder) == {"round": 1, "phase": "label"}
                               and glob.glob(os.path.join(r1, "labels", "*.json")))
    evidence["label"] = sorted(os.listdir(os.path.join(r1, "labels")))
    at["train"] = _killed_when(folder, lambda: _state(folder) == {"round": 1, "phase": "train"}
                               and glob.glob(os.path.join(r1, "train", "checkpoints",
                                                          "epoch_*.npz")))
    evidence["train"] = os.path.exists(os.path.join(r1, "trained.json"))
    resumed = active.run(folder, oracle=EMT, say=lambda line: None)
    return {"root": root, "ref": ref, "resumed": resumed, "at": at, "evidence": evidence,
            "n_seed": len(inputs()["labelled"])}


def test_loop_labels_uncertain_frames_with_the_oracle(runs):
    import ase.io
    folder = runs["root"] / "ref"
    picked = json.load(open(folder / "round_001" / "picked.json"))
    md = json.load(open(folder / "round_001" / "md.json"))
    assert 2 <= len(picked) <= 3
    for p in picked:   # an uncertain frame, or one of the last before an explosion
        run = md[p["run"]]
        if p["why"] == "diverse uncertain":
            assert p["frame"] in run["uncertain"]
        else:
            assert p["why"] == "last sane frame before an explosion"
            assert run["end"].startswith("exploded: ") and p["frame"] in run["sane"]
    refused = {r["pick"] for r in json.load(open(folder / "round_001" / "refused.json"))}
    kept = [p for n, p in enumerate(picked) if n not in refused]
    labelled = ase.io.read(folder / "labelled.extxyz", ":")
    assert kept and len(labelled) == runs["n_seed"] + len(kept)
    frames = ase.io.read(folder / "round_001" / "md_0.extxyz", ":")
    for p, got in zip(kept, labelled[runs["n_seed"]:]):
        want = emt(frames[p["frame"]])   # EMT evaluated here on the recorded frame
        np.testing.assert_allclose(got.positions, want.positions, atol=1e-8)
        np.testing.assert_allclose(got.info["REF_energy"], want.info["REF_energy"], rtol=1e-10)
        np.testing.assert_allclose(got.arrays["REF_forces"], want.arrays["REF_forces"],
                                   atol=1e-8)
    rounds = runs["ref"]["rounds"]
    assert [r["labels"] for r in rounds] == [runs["n_seed"], runs["n_seed"] + len(kept)]
    # round 1 continues round 0's members: its starting test errors are round 0's final ones
    assert rounds[1]["trained"]["before"] == rounds[0]["trained"]["after"]
    assert rounds[1]["held_out"] is not None and 0 <= rounds[1]["held_out"]["within"]["1"] <= 1
    for r in rounds:   # the spread's scale from the calibration set scales the threshold too
        assert r["scale"] == r["calibration"]["scale"] != 1.0
        assert r["next_threshold"] == pytest.approx(r["median_score"] * r["scale"])
    for name in ("rounds.png", "round_001/spread.png", "log.jsonl"):
        assert os.path.getsize(folder / name) > 0
    events = [json.loads(line)["event"] for line in open(folder / "log.jsonl")]
    assert events == ["start", "assess", "md", "pick", "label", "assess"]


def test_sigkill_in_md_labelling_and_training_loses_nothing_and_resumes_exactly(runs):
    """Killed in each phase, the run continues to bitwise the labels and
    members of the run that was never killed."""
    import ase.io
    at, evidence = runs["at"], runs["evidence"]
    assert at == {"md": {"round": 1, "phase": "md"}, "label": {"round": 1, "phase": "label"},
                  "train": {"round": 1, "phase": "train"}}
    assert evidence["md"] is False          # killed before MD had written its runs
    picked = json.load(open(runs["root"] / "ref" / "round_001" / "picked.json"))
    labels = [n for n in evidence["label"] if n.endswith(".json")]
    assert 1 <= len(labels) < len(picked)   # killed between two labels, the first kept
    assert evidence["train"] is False       # killed after an epoch, before the end
    a, b = runs["root"] / "ref", runs["root"] / "killed"
    ref = ase.io.read(a / "labelled.extxyz", ":")
    got = ase.io.read(b / "labelled.extxyz", ":")
    assert len(ref) == len(got)
    for x, y in zip(ref, got):
        assert np.array_equal(x.positions, y.positions)
        assert np.array_equal(x.arrays["REF_forces"], y.arrays["REF_forces"])
    assert len(runs["ref"]["members"]) == len(runs["resumed"]["members"]) == 2
    for p, q in zip(runs["ref"]["members"], runs["resumed"]["members"]):
        with np.load(p) as x, np.load(q) as y:
            assert sorted(x.files) == sorted(y.files)
            for k in x.files:
                assert np.array_equal(x[k], y[k]), k


def test_a_restart_with_other_settings_is_refused(runs):
    from chemtrain import active
    ref = str(runs["root"] / "ref")
    with pytest.raises(ValueError, match=r"other settings \(md_steps: 150 -> 10\)"):
        active.run(ref, settings=settings(md_steps=10))
    same = dict(seeds=[cu(0, 0.0)], labelled=[emt(cu(k)) for k in range(1, 9)],
                test=[emt(cu(k, 0.1)) for k in range(20, 24)], settings=settings())
    active.run(ref, say=lambda line: None, **same)   # the same data named again: fine
    for key, other, match in (("seeds", [cu(5)], "other seed structures"),
                              ("labelled", [emt(cu(k)) for k in range(2, 10)],
                               "other seed labels"),
                              ("test", [emt(cu(k, 0.1)) for k in range(20, 23)], "other test set")):
        with pytest.raises(ValueError, match=match):
            active.run(ref, say=lambda line: None, **{**same, key: other})
    done = active.run(str(runs["root"] / "ref"), say=lambda line: None)   # finished: nothing to do
    assert [r["round"] for r in done["rounds"]] == [0, 1]
    with pytest.raises(ValueError, match="Labels remain to be made: give the oracle"):
        more = runs["root"] / "more"   # a copy given one more round, without its oracle
        shutil.copytree(runs["root"] / "ref", more)
        active.run(str(more), settings=settings(rounds=2), say=lambda line: None)
    with open(more / "state.json") as f:
        assert json.load(f) == {"round": 2, "phase": "label"}


def test_a_run_ends_after_rounds_without_uncertain_frames(runs):
    """A committee sure of every frame its MD visits ends the run after
    stop_when_quiet (2) quiet rounds instead of running all of them; no
    oracle is asked. A finished run given more rounds continues, and stops
    again. (The test's committee is not that good: round 1's next threshold
    is raised to 1e9 eV/A, and the guard's shortest distance lowered to
    0.5 A, below which its MD at 900 K would otherwise go.)"""
    from chemtrain import active
    quiet = runs["root"] / "quiet"
    shutil.copytree(runs["root"] / "ref", quiet)
    for name, key, value in (("round_001/summary.json", "next_threshold", 1e9),
                             ("guards.json", "min_distance", 0.5)):
        rec = json.loads((quiet / name).read_text())
        (quiet / name).write_text(json.dumps({**rec, key: value}))
    said = []
    out = active.run(str(quiet), settings=settings(rounds=5), say=said.append)
    assert [r["round"] for r in out["rounds"]] == [0, 1, 2, 3]
    assert out["stopped"].startswith("2 rounds in a row without an uncertain frame"), said
    for k in (2, 3):
        md = json.loads((quiet / f"round_{k:03d}" / "md.json").read_text())
        assert all(r["uncertain"] == [] and r["end"] for r in md)
        assert not (quiet / f"round_{k:03d}" / "labels").exists()
    log = [json.loads(line) for line in (quiet / "log.jsonl").read_text().splitlines()]
    assert [e["round"] for e in log if e["event"] == "stop"] == [3]
    again = active.run(str(quiet), settings=settings(rounds=5), say=lambda line: None)
    assert [r["round"] for r in again["rounds"]] == [0, 1, 2, 3]   # nothing left to do
    more = active.run(str(quiet), settings=settings(rounds=6), say=lambda line: None)
    assert [r["round"] for r in more["rounds"]] == [0, 1, 2, 3, 4]
    assert more["stopped"].startswith("3 rounds in a row")


def test_a_folder_in_use_is_refused_and_freed_when_its_process_ends(runs, tmp_path):
    """Another process holding the run's lock is named in the refusal; once
    it is killed the folder is free again. A refused start leaves neither
    a folder nor a lock file behind."""
    from chemtrain import active
    folder = runs["root"] / "ref"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.pwrite(fd, b'pid 4242 on node7', 0)\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"), str(folder / "run.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=r"in use by another process \(pid 4242 on node7\)"):
            active.run(str(folder), say=lambda line: None)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    done = active.run(str(folder), say=lambda line: None)   # freed by the holder's end
    assert [r["round"] for r in done["rounds"]] == [0, 1]
    with pytest.raises(ValueError, match="give the seed structures"):
        active.run(str(tmp_path / "never"), seeds=[cu(0)])
    assert not (tmp_path / "never").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        active.run(str(tmp_path / "mine"), seeds=[cu(0)], labelled=[emt(cu(1))] * 3)
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_md_stops_an_explosion_and_keeps_the_frames_before_it(runs):
    from chemtrain.active import md
    from chemtrain.finetune.family import committee_of
    committee = committee_of(runs["ref"]["members"])
    out = md.run(cu(0), committee, temperature_K=3e5, steps=400, timestep_fs=2.0,
                 friction_per_fs=0.02, record_every=1, threshold=1e9, scale=1.0, stop_after=5,
                 max_force=50.0, min_distance=1.6, keep_sane=3, seed=0)
    assert out["end"].startswith("exploded: ") and out["steps"] < 400
    assert len(out["frames"]) == out["steps"] >= 3 and out["uncertain"] == []
    assert out["sane"] == [len(out["frames"]) - 3 + k for k in range(3)]
    for i in out["sane"]:
        assert md.shortest_distance(out["frames"][i]) >= 1.6


def test_cli_continues_and_refuses_by_name(runs):
    cmd = [sys.executable, "-m", "chemtrain.active", "--folder", str(runs["root"] / "ref")]
    ok = subprocess.run(cmd + ["--oracle", "emt"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "Done: 2 rounds" in ok.stdout
    bad = subprocess.run(cmd + ["--oracle", "nowhere"], capture_output=True, text=True)
    assert bad.returncode == 2 and "give 'emt' or 'module:function'" in bad.stderr
    other = subprocess.run(cmd + ["--record_every", "7"], capture_output=True, text=True)
    assert other.returncode == 2 and "record_every: 5 -> 7" in other.stderr
    new = [sys.executable, "-m", "chemtrain.active", "--folder", str(runs["root"] / "new"),
           "--seeds", "start.xyz", "--labelled", "labels.xyz"]
    for extra, expected in ((["--labels_per_round", "0"], "labels_per_round must be an integer"),
                            (["--", "--seed", "3"], "finetune_args must not contain --seed")):
        out = subprocess.run(new + extra, capture_output=True, text=True)
        assert out.returncode == 2 and expected in out.stderr, out.stderr
    assert not (runs["root"] / "new").exists()


def test_diverse_picks_skip_near_duplicates():
    from ase.build import fcc111
    from chemtrain.active import diverse, fingerprints
    bursts = [cu(0, 0.01 + 0.001 * k) for k in range(5)]   # one configuration, five times
    slab = fcc111("Cu", size=(2, 2, 4), vacuum=6.0, a=3.61)
    squeezed = cu(1, 0.01, a=3.3)
    frames = bursts + [slab, squeezed]
    scores = [1.0, 0.99, 0.98, 0.97, 0.96, 0.5, 0.4]
    f = fingerprints(frames)
    near, far = np.linalg.norm(f[0] - f[1]), np.linalg.norm(f[0] - f[5])
    assert near < 0.1 * far
    picks = diverse(scores, f, 3)
    assert picks[0] == 0 and sorted(picks) == [0, 5, 6]   # not the five near-duplicates
    # a candidate like a training structure counts as covered
    assert diverse(scores[5:], f[5:], 1, covered=f[5:6]) == [0]
    assert diverse(scores[5:], f[5:], 2, covered=f[5:6]) == [0, 1]
    assert diverse([0.3, 0.2], f[5:], 2, covered=None) == [0, 1]
    assert diverse([], np.zeros((0, 3)), 2) == []


def test_label_one_reports_oracle_failures():
    from ase.calculators.calculator import Calculator
    from ase.calculators.emt import EMT
    from chemtrain.active import label_one

    class Broken(Calculator):
        implemented_properties = ["energy", "forces"]

        def calculate(self, atoms=None, properties=("energy",), system_changes=()):
            raise RuntimeError("SCF did not converge")

    class NotFinite(EMT):
        def calculate(self, *args, **kwargs):
            super().calculate(*args, **kwargs)
            self.results["forces"][3, 1] = np.nan

    atoms = cu(3)
    got, why = label_one(atoms, EMT())
    want = emt(atoms)
    assert why is None and got.info["REF_energy"] == want.info["REF_energy"]
    assert label_one(atoms, Broken()) == (None, "the oracle failed: RuntimeError: SCF did not "
                                                "converge")
    none, why = label_one(atoms, NotFinite())
    assert none is None and "non-finite" in why


def test_absurd_labels_are_refused():
    from chemtrain.active import absurd
    known = [emt(cu(k)) for k in range(6)]
    good, bad = emt(cu(10)), emt(cu(11))
    bad.info["REF_energy"] += 50.0 * len(bad)   # a failed calculation's energy
    found = absurd(known, [good, bad])
    assert list(found) == [1] and "eV/atom from the median" in found[1][0]
    assert absurd(known, [good]) == {}


@pytest.mark.parametrize("kw, match", [
    (dict(rounds=-1), "rounds must be an integer >= 0"),
    (dict(ensemble_size=1), "ensemble_size must be an integer >= 2"),
    (dict(threshold=0.0), "threshold must be a positive number"),
    (dict(threshold_mode="sigma"), "threshold_mode must be one of"),
    (dict(selection="best"), "selection must be one of"),
    (dict(temperatures_K=()), "temperatures_K must be positive"),
    (dict(finetune_args=("--seed", "3")), "must not contain --seed"),
    (dict(stop_when_quiet=0), "stop_when_quiet must be None or an integer >= 1"),
])
def test_settings_refuse_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        settings(**kw)


def test_a_new_run_needs_its_data(tmp_path):
    from chemtrain import active
    with pytest.raises(ValueError, match="give the seed structures and the seed labels"):
        active.run(str(tmp_path / "new"), seeds=[cu(0)])
    with pytest.raises(ValueError, match="Structure 0 of the seed labels has no energy"):
        active.run(str(tmp_path / "new"), seeds=[cu(0)], labelled=[cu(1)] * 3)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="is not empty"):
        active.run(str(tmp_path / "full"), seeds=[cu(0)], labelled=[emt(cu(1))] * 3)


def test_a_start_cut_short_can_start_again(tmp_path):
    """A crash inside start (before state.json) leaves only start's own files;
    the next start proceeds, anything else in the folder is refused."""
    from chemtrain.active.folder import start
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "settings.json").write_text("{")   # cut short while writing
    (folder / "seeds.extxyz").write_text("")
    paths = start(str(folder), [cu(0)], [emt(cu(k)) for k in range(3)], settings())
    assert json.load(open(paths.state)) == {"round": 0, "phase": "train"}
    assert json.load(open(paths.settings))["md_steps"] == 150
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        start(str(other), [cu(0)], [emt(cu(k)) for k in range(3)], settings())
    assert (other / "notes.txt").read_text() == "mine"
