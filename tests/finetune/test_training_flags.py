"""chemtrain-finetune's fine-tuning flags (issue 35): --freeze, --ema,
--loss, --scheduler, --patience and --export_model on a small Cu job, and
their error cases (contradicting flags, a --freeze that names no block, a
resume that would change what the optimizer state holds)."""
import json
import os

import numpy as np
import pytest

from cu_data import cu_frames

TINY = ["--num_channels", "4", "--max_ell", "1", "--correlation", "2", "--r_max", "4.0",
        "--default_dtype", "float64", "--no_torch_export", "--parallelism", "single"]
# --seed 1: the test rows are 5 (an 8-atom cell) and 0 (one atom, no force)
SPLIT = ["--n_train", "4", "--n_valid", "2", "--n_test", "2", "--batch_size", "2", "--seed", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain 1-epoch run (the 'foundation'), then a fine-tuning of its model
    with frozen blocks, EMA, a Huber loss, a plateau schedule and patience."""
    from chemtrain.finetune import run
    d = tmp_path_factory.mktemp("finetuning")
    train = str(d / "cu.xyz")
    cu_frames(train, n=8)
    base = str(d / "base")
    run(["--train_file", train, "--results_dir", base, "--max_num_epochs", "1",
         "--checkpoint_every", "1", *SPLIT, *TINY])
    tuned = str(d / "tuned")
    results = run(["--train_file", train, "--results_dir", tuned, "--foundation_model",
                   os.path.join(base, "model.npz"), "--E0s", "foundation", "--max_num_epochs",
                   "4", "--freeze", "embedding,interactions.0,products.0", "--ema",
                   "--ema_decay", "0.5", "--loss", "huber", "--huber_delta", "0.05",
                   "--scheduler", "ReduceLROnPlateau", "--scheduler_patience", "0",
                   "--lr_factor", "0.5", "--checkpoint_every", "1", *SPLIT, *TINY])
    return {"train": train, "base": base, "tuned": tuned, "results": results, "dir": d}


def load(path):
    from chemtrain.models import mace
    return mace.load(path)


def test_frozen_blocks_are_exported_unchanged(runs):
    _, before = load(os.path.join(runs["base"], "model.npz"))
    _, after = load(os.path.join(runs["tuned"], "model.npz"))
    import jax
    same = lambda a, b: all(np.array_equal(x, y)  # noqa: E731
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert same(before["embedding"], after["embedding"])
    assert same(before["interactions"][0], after["interactions"][0])
    assert same(before["products"][0], after["products"][0])
    assert not same(before["interactions"][1], after["interactions"][1])
    assert not same(before["readouts"], after["readouts"])


def test_the_best_epoch_is_exported_and_recorded(runs):
    lines = [json.loads(x) for x in open(os.path.join(runs["tuned"], "metrics.jsonl"))]
    val = [r["val_loss"] for r in lines]
    res = runs["results"]
    assert res["exported_epoch"] == int(np.argmin(val))
    # the plateau factor is in the records: it can only stay or halve
    scales = [r["lr_scale"] for r in lines]
    assert all(b in (a, a / 2) for a, b in zip(scales, scales[1:]))
    with open(os.path.join(runs["tuned"], "results.json")) as f:
        assert json.load(f)["exported_epoch"] == res["exported_epoch"]


def test_exported_model_is_the_tested_one(runs):
    """The 'after' errors are those of the written model (the best epoch's
    moving average), evaluated here without the trainer."""
    import ase.io
    from chemtrain.calculator import ChemtrainCalculator
    frames = ase.io.read(runs["train"], ":")
    calc = ChemtrainCalculator.from_mace(os.path.join(runs["tuned"], "model.npz"))
    err = []
    for i in runs["results"]["test_rows"]:
        atoms = frames[i].copy()
        atoms.calc = calc
        err.append(atoms.get_forces() - frames[i].arrays["REF_forces"])
    rmse = float(np.sqrt(np.mean(np.concatenate(err) ** 2)))
    assert rmse > 1e-3
    assert rmse == pytest.approx(runs["results"]["after"]["force_eV_per_A"]["RMSE"], rel=1e-6)


def run_error(argv, capsys):
    from chemtrain.finetune import main
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("extra, expected", [
    (["--ema_decay", "0.9"], "--ema_decay is the decay of --ema; add --ema"),
    (["--huber_delta", "0.1"], "--huber_delta is the threshold of --loss huber or universal"),
    (["--lr_factor", "0.5"], "--lr_factor belongs to --scheduler ReduceLROnPlateau"),
    (["--scheduler", "ExponentialLR", "--scheduler_patience", "3"],
     "--scheduler_patience belongs to --scheduler ReduceLROnPlateau"),
    (["--lr_scheduler_gamma", "0.99"], "--lr_scheduler_gamma belongs to --scheduler ExponentialLR"),
    (["--swa_lr", "0.001"], "--swa_lr belongs to stage two; add --swa"),
    (["--swa", "--start_swa", "5", "--max_num_epochs", "5"],
     "stage two would start at epoch 5, but --max_num_epochs 5 ends the run before it"),
    (["--swa", "--max_num_epochs", "8", "--patience", "2"],
     "--patience with --swa is not supported"),
])
def test_contradicting_flags(runs, extra, expected, capsys, tmp_path):
    out = tmp_path / "out"
    err = run_error(["--train_file", runs["train"], "--results_dir", str(out), *SPLIT, *TINY,
                     *extra], capsys)
    assert "Contradicting flags" in err and expected in err, err
    assert not out.exists()


@pytest.mark.parametrize("freeze, expected", [
    ("embeding", r"--freeze names no block of this model: ['embeding']. Its blocks are "
                 r"['embedding', 'interactions', 'interactions.0'"),
    ("interactions.5", "names no block of this model: ['interactions.5']"),
    ("0", "--freeze 0 freezes no block (mace-torch's numbers"),
    ("embedding,interactions,products,readouts", "leaves nothing to train"),
])
def test_freeze_naming_no_block(runs, freeze, expected, capsys, tmp_path):
    out = tmp_path / "out"
    err = run_error(["--train_file", runs["train"], "--results_dir", str(out), "--freeze",
                     freeze, *SPLIT, *TINY], capsys)
    assert expected in err, err
    assert not out.exists()


def test_resume_must_keep_what_the_optimizer_state_holds(runs, capsys):
    """--ema on a run without EMA (and the other way round) is refused with
    the flag named, and nothing in the run's folder changes."""
    before = sorted(os.listdir(os.path.join(runs["base"], "checkpoints")))
    err = run_error(["--train_file", runs["train"], "--results_dir", runs["base"],
                     "--restart_latest", "--ema", "--max_num_epochs", "2", *SPLIT, *TINY], capsys)
    assert "--ema (then False, now True)" in err, err
    assert sorted(os.listdir(os.path.join(runs["base"], "checkpoints"))) == before
    err = run_error(["--train_file", runs["train"], "--results_dir", runs["tuned"],
                     "--restart_latest", "--foundation_model",
                     os.path.join(runs["base"], "model.npz"), "--E0s", "foundation",
                     "--max_num_epochs", "5", *SPLIT, *TINY], capsys)
    assert "--ema (then True, now False)" in err and "--freeze (then" in err, err


def test_estimated_e0s_correct_the_foundation_by_its_errors(runs, tmp_path):
    """--E0s estimated: the foundation's E0 plus the least-squares correction
    of its energy errors on the training rows, computed here with the ASE
    calculator (another code path) on the rows the documented split gives."""
    import ase.io
    from chemtrain.calculator import ChemtrainCalculator
    from chemtrain.finetune import run
    foundation = os.path.join(runs["base"], "model.npz")
    out = str(tmp_path / "estimated")
    run(["--train_file", runs["train"], "--results_dir", out, "--foundation_model", foundation,
         "--E0s", "estimated", "--max_num_epochs", "0", *SPLIT, *TINY])
    cfg0, _ = load(foundation)
    cfg, _ = load(os.path.join(out, "model.npz"))
    frames = ase.io.read(runs["train"], ":")
    train_rows = np.random.default_rng(1).permutation(len(frames))[4:8]   # after 2 test, 2 valid
    calc = ChemtrainCalculator.from_mace(foundation)
    n, err = [], []
    for i in train_rows:
        a = frames[i].copy()
        a.calc = calc
        err.append(frames[i].info["REF_energy"] - a.get_potential_energy())
        n.append(len(a))
    fix = np.linalg.lstsq(np.array(n, float)[:, None], np.array(err), rcond=None)[0][0]
    assert abs(fix) > 1e-3   # the foundation is off: the correction is not trivially zero
    assert cfg.atomic_energies[0] == pytest.approx(cfg0.atomic_energies[0] + fix, rel=1e-8)


def test_stage_two_resumed_at_its_start_equals_one_run(runs, tmp_path):
    """--swa: a run stopped at the first epoch of stage two and resumed gives
    bitwise the model of the uninterrupted run; stage two changes the
    training (its loss weights and learning rate)."""
    import jax
    from chemtrain.finetune import run
    job = ["--train_file", runs["train"], "--max_num_epochs", "2", "--swa", "--start_swa", "1",
           "--swa_lr", "0.002", "--checkpoint_every", "1", *SPLIT, *TINY]
    import shutil
    straight = run(["--results_dir", str(tmp_path / "straight"), *job])
    # a run killed after stage one's last checkpoint (epoch 1, where stage two starts)
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    os.remove(tmp_path / "split" / "checkpoints" / "epoch_00002.npz")
    resumed = run(["--results_dir", str(tmp_path / "split"), "--restart_latest", *job])
    _, a = load(straight["model_npz"])
    _, b = load(resumed["model_npz"])
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    run(["--results_dir", str(tmp_path / "plain"), "--train_file", runs["train"],
                 "--max_num_epochs", "2", *SPLIT, *TINY])
    lines = lambda d: [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]  # noqa
    two, one = lines(str(tmp_path / "straight")), lines(str(tmp_path / "plain"))
    assert two[0]["train_loss"] == one[0]["train_loss"]          # stage one: the same
    assert two[1]["train_loss"] > 10 * one[1]["train_loss"]      # weights 1000/100 instead of 1/1
    # the exported model is stage two's best: its validation loss is of stage two's weights
    assert straight["exported_epoch"] == 1


def test_replay_takes_a_huber_delta_for_its_universal_loss():
    """Replay switches to the 'universal' loss before the flags are checked,
    so --huber_delta is not refused as belonging to another loss."""
    from chemtrain.finetune import replay as P, training as T
    from chemtrain.finetune.cli import parse_args
    argv = ["--train_file", "b.xyz", "--foundation_model", "f.npz", "--pt_train_file", "a.xyz",
            "--E0s", "foundation", "--huber_delta", "0.02"]
    args = parse_args(argv)
    P.check_flags(args, argv)
    P.mace_torch_settings(args, argv)
    T.check_flags(args, argv)
    assert (args.loss, args.huber_delta, args.lr, args.ema) == ("universal", 0.02, 1e-4, True)
