"""The pieces of benchmarks/finetune_vs_mace_torch.py that need no training:
the error function both sides share, mace-torch's flags, the replay set
size that matches chemtrain's step count, the step count read from
mace-torch's log, and the goals."""
import json
import os
import sys
import types

import numpy as np
import pytest

from paths import BENCHMARKS  # noqa: E402

sys.path.insert(0, BENCHMARKS)
import finetune_vs_mace_torch as fb  # noqa: E402


def frame(n, energy, forces):
    from ase import Atoms
    a = Atoms("Cu" * n, positions=np.arange(3 * n, dtype=float).reshape(n, 3))
    a.info["REF_energy"] = energy
    a.arrays["REF_forces"] = np.asarray(forces, float)
    return a


def test_errors_by_hand():
    f1 = frame(2, 1.0, np.zeros((2, 3)))
    f2 = frame(4, -2.0, np.ones((4, 3)))
    # energy errors per atom: (1.2 - 1.0) / 2 = 0.1, (-2.0 + 2.0) / 4 = 0
    # force errors: 0.3 on each of f1's 6 components, 0 on f2's 12
    e = fb.errors([f1, f2], [1.2, -2.0], [np.full((2, 3), 0.3), np.ones((4, 3))])
    assert e["energy_meV_per_atom"] == pytest.approx(1e3 * np.sqrt(0.1 ** 2 / 2))
    assert e["force_meV_per_A"] == pytest.approx(1e3 * np.sqrt(6 * 0.09 / 18))


def args(**kw):
    base = dict(work="/w", epochs=3, lr=0.01, batch=4, seed=7, replay_pt_frames=None,
                mace_replay_ema=0.0, torch_threads=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_mace_flags():
    a = args()
    naive = fb.mace_command(a, "/d", "/f/model.model", "/w/n", "naive", 18, weights=(1.0, 10.0))
    replay = fb.mace_command(a, "/d", "/f/model.model", "/w/r", "replay", 3, "/d/A_train.xyz",
                             weights=(1.0, 10.0))
    flag = lambda cmd, k: cmd[cmd.index(k) + 1]
    for cmd in (naive, replay):
        assert flag(cmd, "--lr") == "0.01" and flag(cmd, "--batch_size") == "4"
        assert flag(cmd, "--seed") == "7"
        assert flag(cmd, "--energy_weight") == "1.0" and flag(cmd, "--forces_weight") == "10.0"
        assert flag(cmd, "--E0s") == "foundation"          # 'average' is refused in multi-head mode
        assert flag(cmd, "--foundation_model") == "/f/model.model"
        assert flag(cmd, "--foundation_model_elements") == "True"
        assert flag(cmd, "--default_dtype") == fb.DTYPE
        assert flag(cmd, "--scheduler") == "ExponentialLR"      # constant learning rate
        assert flag(cmd, "--lr_scheduler_gamma") == "1.0"
        assert "--save_all_checkpoints" not in cmd and "--ema" not in cmd   # best validation
    assert flag(naive, "--max_num_epochs") == "18" and flag(replay, "--max_num_epochs") == "3"
    assert flag(naive, "--multiheads_finetuning") == "False"
    assert flag(replay, "--multiheads_finetuning") == "True"
    assert flag(replay, "--force_mh_ft_lr") == "True"      # else lr 1e-4 and EMA
    assert flag(replay, "--pt_train_file") == "/d/A_train.xyz"
    assert flag(replay, "--pt_valid_file") == os.path.join("/d", "A_valid.xyz")
    assert flag(replay, "--loss") == "universal"
    ema = fb.mace_command(args(mace_replay_ema=0.99999), "/d", "/f", "/w", "replay", 3, "/p")
    assert flag(ema, "--ema_decay") == "0.99999"


def test_plan_matches_chemtrain_steps():
    a = args(epochs=20, batch=4)
    # alone: forgetting.py's replay of all of A_train: (24 + 168) // 4 = 48 steps per epoch
    p = fb.plan(a, 24, 168)
    assert (p["replay_pt_frames"], p["replay_steps"]) == (168, 960)
    assert (p["naive_epochs"], p["naive_steps"], p["notes"]) == (160, 960, [])
    # chemtrain's 960 replay steps: all 168 frames, without a note
    p = fb.plan(a, 24, 168, {"replay": {"steps": 960}, "naive": {"steps": 960}})
    assert (p["replay_pt_frames"], p["notes"]) == (168, [])
    assert fb.plan(args(replay_pt_frames=40), 24, 168)["replay_pt_frames"] == 40
    # with chemtrain's rows: the most A frames that give its steps per epoch
    p = fb.plan(a, 24, 168, {"replay": {"steps": 20 * 40}, "naive": {"steps": 804}})
    assert p["replay_pt_frames"] == 163 - 24 and p["replay_steps"] == 800
    assert (p["naive_epochs"], p["naive_steps"]) == (134, 804) and p["notes"] == []
    p = fb.plan(a, 24, 168, {"replay": {"steps": 20 * 100}, "naive": {"steps": 805}})
    assert p["replay_pt_frames"] == 168 and any("A_train holds 168" in n for n in p["notes"])
    assert any("naive: 810 steps" in n for n in p["notes"])
    p = fb.plan(a, 24, 168, {"replay": {"steps": 861}})
    assert any("whole number" in n for n in p["notes"])


def test_count_steps(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    lines = [{"mode": "opt", "epoch": 0}] * 5 + [{"mode": "eval", "epoch": 0}] + \
            [{"mode": "opt", "epoch": 1}] * 5
    (res / "mace_run-0_train.txt").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert fb.count_steps(str(tmp_path)) == 10


def row(a_f, b_f):
    return {"A": {"energy_meV_per_atom": 1.0, "force_meV_per_A": a_f},
            "B": {"energy_meV_per_atom": 1.0, "force_meV_per_A": b_f}, "steps": 1, "wall_s": 1.0}


def test_goals_and_ratios():
    ours = {"foundation": row(10, 100), "naive": row(50, 20), "naive + EMA + frozen": row(20, 30),
            "replay": row(14, 24)}
    theirs = {"foundation": row(10, 100), "naive": row(50, 20), "replay": row(14, 21)}
    g = fb.goals(ours, theirs)
    assert g["replay A force / foundation A force"]["value"] == pytest.approx(1.4)
    assert g["replay A force / foundation A force"]["met"]
    assert g["replay B force / naive B force"]["value"] == pytest.approx(1.2)
    assert not g["replay: max error ratio chemtrain / mace-torch"]["met"]   # 24 / 21 > 1.1
    assert g["naive: max error ratio chemtrain / mace-torch"]["met"]
    assert set(fb.ratios(ours, theirs)) == {"foundation", "naive", "replay"}
    text = fb.table("t", ours)
    assert "naive + EMA + frozen" in text and text.count("\n") == 6


def test_epoch_seconds_one_per_epoch():
    log = "\n".join([
        "2026-12-04 16:25:19.285 INFO: Initial: head: pt_head, loss=1",
        "2026-12-04 16:25:19.976 INFO: Initial: head: Default, loss=1",
        "2026-12-04 16:25:21.000 INFO: Epoch 0: head: pt_head, loss=1",
        "2026-12-04 16:25:21.476 INFO: Epoch 0: head: Default, loss=1",
        "2026-12-04 16:25:22.000 INFO: Epoch 1: head: pt_head, loss=1",
        "2026-12-04 16:25:22.976 INFO: Epoch 1: head: Default, loss=1"])
    assert fb.epoch_seconds(log) == pytest.approx([1.5, 1.5])


def test_last_epoch_and_epoch_used():
    cmd = fb.mace_command(args(mace_last=True), "/d", "/f", "/w", "naive", 5)
    assert "--save_all_checkpoints" in cmd
    log = "2026-12-04 16:40:42.534 INFO: Loaded Stage one model from epoch 143 for evaluation"
    assert fb.model_epoch(log) == 144 and fb.model_epoch("") is None
