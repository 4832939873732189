"""chemtrain-finetune's numeric flags on bad values (issue 37): a one-line
argparse error naming the flag and the accepted range (exit code 2), before
any file is read or written."""
import os

import numpy as np
import pytest

from chemtrain.finetune.cli import parse_args


@pytest.mark.parametrize("flag, value, expected", [
    ("--lr", "-0.01", "argument --lr: must be > 0.0, got -0.01"),
    ("--lr", "nan", "argument --lr: must be > 0.0, got nan"),
    ("--lr", "0", "argument --lr: must be > 0.0, got 0"),
    ("--max_num_epochs", "-3", "argument --max_num_epochs: must be >= 0, got -3"),
    ("--batch_size", "0", "argument --batch_size: must be >= 1, got 0"),
    ("--n_valid", "-3", "argument --n_valid: must be >= 0, got -3"),
    ("--n_train", "0", "argument --n_train: must be >= 1, got 0"),
    ("--valid_fraction", "1.5", "argument --valid_fraction: must be >= 0.0 and < 1.0, got 1.5"),
    ("--forces_weight", "-1", "argument --forces_weight: must be >= 0.0 (0 leaves that target "
                              "out), got -1"),
    ("--stress_weight", "inf", "argument --stress_weight: must be >= 0.0"),
    ("--r_max", "-4", "argument --r_max: must be > 0.0, got -4"),
    ("--checkpoint_every", "0", "argument --checkpoint_every: must be >= 1, got 0"),
    ("--batch_size", "two", "argument --batch_size: 'two' is not a whole number"),
])
def test_bad_numbers_name_the_flag_and_range(flag, value, expected, capsys, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        parse_args(["--train_file", "x.xyz", "--results_dir", str(out), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err and not out.exists()


def test_good_numbers_pass():
    args = parse_args(["--train_file", "x.xyz", "--lr", "1e-3", "--max_num_epochs", "0",
                       "--n_valid", "0", "--valid_fraction", "0", "--stress_weight", "0"])
    assert (args.lr, args.max_num_epochs, args.n_valid, args.stress_weight) == (1e-3, 0, 0, 0.0)


@pytest.mark.parametrize("flag, value, expected", [
    ("--radial_MLP", "[64, x]", "argument --radial_MLP: must be a list of whole numbers >= 1"),
    ("--radial_MLP", "[]", "argument --radial_MLP: must be a list of whole numbers >= 1"),
    ("--radial_MLP", "[8, 0]", "argument --radial_MLP: must be a list of whole numbers >= 1"),
    ("--MLP_irreps", "16x1o", "argument --MLP_irreps: must be scalar irreps 'Nx0e'"),
    ("--MLP_irreps", "sixteen", "argument --MLP_irreps: must be scalar irreps 'Nx0e'"),
    ("--name", "/tmp/models/cu", "argument --name: is the file name of the written models inside "
                                 "--results_dir"),
    ("--name", "runs/cu", "not a path; got 'runs/cu'"),
    ("--name", "", "argument --name: is the file name"),
])
def test_malformed_model_and_name_flags(flag, value, expected, capsys, tmp_path):
    """Before issue 37 these gave a traceback from deep in the model set-up
    (--radial_MLP, --MLP_irreps) or a misleading message (--name)."""
    with pytest.raises(SystemExit) as e:
        parse_args(["--train_file", "x.xyz", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


def test_well_formed_model_flags_parse_to_values():
    args = parse_args(["--train_file", "x.xyz", "--radial_MLP", "[8, 16]", "--MLP_irreps",
                       " 4x0e", "--name", "cu_mace"])
    assert (args.radial_MLP, args.MLP_irreps, args.name) == ([8, 16], "4x0e", "cu_mace")
    assert parse_args(["--train_file", "x.xyz"]).radial_MLP == [64, 64, 64]


# ------------------------------------------------ data and folders, before any work
@pytest.fixture(scope="module")
def cu(tmp_path_factory):
    from cu_data import cu_frames
    d = tmp_path_factory.mktemp("cu_inputs")
    path = str(d / "cu.xyz")
    frames = cu_frames(path, n=6)
    return {"path": path, "frames": frames, "dir": d}


def _run(*argv):
    from chemtrain.finetune import run
    return run(list(argv))


def _write(path, frames):
    import ase.io
    ase.io.write(path, frames, format="extxyz")
    return path


def _unwritable_folder():
    """A folder that even root cannot write to (sysfs), where there is one."""
    import tempfile
    try:
        tempfile.TemporaryFile(dir="/sys").close()
    except OSError:
        return "/sys"
    pytest.skip("no folder here refuses writes by root")


@pytest.mark.parametrize("case", ["file", "empty", "under_a_file", "unwritable"])
def test_results_dir_that_cannot_hold_a_run_is_refused_first(cu, tmp_path, case):
    """Before issue 37 these failed only after an epoch had trained."""
    from chemtrain.finetune import DataError
    afile = tmp_path / "results.txt"
    afile.write_text("mine")
    out, expected = {
        "file": (str(afile), "is a file, not a folder"),
        "empty": ("", "--results_dir is empty"),
        "under_a_file": (str(afile / "run"), "lies under the file"),
        "unwritable": (None, "cannot be written"),
    }[case]
    if case == "unwritable":
        out = os.path.join(_unwritable_folder(), "chemtrain_run")
    with pytest.raises(DataError, match=expected):
        _run("--train_file", cu["path"], "--results_dir", out)
    assert afile.read_text() == "mine"


def test_e0s_must_be_finite(cu, tmp_path):
    from chemtrain.finetune import DataError
    with pytest.raises(DataError, match=r"--E0s must give a finite energy .*\{29: nan\}"):
        _run("--train_file", cu["path"], "--E0s", "{29: 'nan'}", "--num_channels", "4",
             "--results_dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_r_max_in_nm_leaves_no_edges_and_says_the_unit(cu, tmp_path):
    """--r_max 0.4 (nm meant; the flag is Å) used to end as 'lower the learning rate'."""
    from chemtrain.finetune import DataError
    with pytest.raises(DataError, match=r"no edges\. --r_max is in Å .*multiplied by 10"):
        _run("--train_file", cu["path"], "--r_max", "0.4", "--results_dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_nan_force_component_is_named_as_nan_not_as_missing(cu, tmp_path):
    frames = [a.copy() for a in cu["frames"]]
    for a, b in zip(frames, cu["frames"]):
        a.info, a.arrays = dict(b.info), {k: v.copy() for k, v in b.arrays.items()}
    frames[2].arrays["REF_forces"][0, 0] = np.nan
    path = _write(str(tmp_path / "nan.xyz"), frames)
    from chemtrain.finetune import DataError
    with pytest.raises(DataError, match=r"structures \[2\] hold NaN or inf in forces"):
        _run("--train_file", path, "--results_dir", str(tmp_path / "run"))


def test_an_absurd_outlier_is_refused_by_name(cu, tmp_path):
    """Two atoms 0.05 Å apart (EMT energy ~1,000 eV) used to set E0 far off
    and wreck the run without a word."""
    from ase.calculators.emt import EMT
    from chemtrain.finetune import DataError
    frames = [a.copy() for a in cu["frames"]] * 2
    frames = [a.copy() for a in frames]
    for a in frames:
        a.calc = EMT()
        a.info["REF_energy"] = a.get_potential_energy()
        a.arrays["REF_forces"] = a.get_forces()
        a.calc = None
    bad = frames[5]
    bad.positions[1] = bad.positions[0] + [0.05, 0.0, 0.0]
    bad.calc = EMT()
    bad.info["REF_energy"], bad.arrays["REF_forces"] = bad.get_potential_energy(), bad.get_forces()
    bad.calc = None
    assert bad.info["REF_energy"] > 500
    path = _write(str(tmp_path / "outlier.xyz"), frames)
    with pytest.raises(DataError, match=r"1 structure\(s\) are absurd outliers .*'.*outlier.xyz' "
                                        r"structure 5 \(energy .* eV/atom from the median; a force "
                                        r"of .* eV/Å\).*--allow_outliers"):
        _run("--train_file", path, "--results_dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_forces_far_too_large_for_ev_per_angstrom_are_warned_about(cu, tmp_path, caplog):
    """Labels in kJ/mol (x96.5) trained silently to a force RMSE of 48 eV/Å."""
    frames = [a.copy() for a in cu["frames"]]
    for a, b in zip(frames, cu["frames"]):
        a.info = {"REF_energy": b.info["REF_energy"] * 96.485}
        a.arrays["REF_forces"] = b.arrays["REF_forces"] * 96.485
    path = _write(str(tmp_path / "kj.xyz"), frames)
    from chemtrain.finetune import DataError
    with caplog.at_level("WARNING", logger="chemtrain"), pytest.raises(DataError,
                                                                       match="does not exist"):
        _run("--train_file", path, "--foundation_model", str(tmp_path / "none.model"),
             "--results_dir", str(tmp_path / "run"))
    assert "RMS component of" in caplog.text and "kJ/mol (x96.5)" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="chemtrain"), pytest.raises(DataError):
        _run("--train_file", cu["path"], "--foundation_model", str(tmp_path / "none.model"),
             "--results_dir", str(tmp_path / "run"))
    assert "RMS component" not in caplog.text


def test_member_models_are_checked_before_anything_is_read(cu, tmp_path):
    """--member_models (a committee continued, chemtrain.active's retraining)."""
    import jax
    from chemtrain.finetune import DataError
    from chemtrain.finetune.model import random_config
    from chemtrain.models import mace
    for k, width in enumerate([4, 4, 8]):
        cfg = random_config([29], 10.0, 1.0, num_channels=width)
        mace.save(str(tmp_path / f"m{k}.npz"), cfg, mace.init_params(cfg, jax.random.PRNGKey(k)))
    m = [str(tmp_path / f"m{k}.npz") for k in range(3)]
    out = ["--train_file", cu["path"], "--results_dir", str(tmp_path / "run")]
    for argv, expected in [
        (["--member_models", m[0]], "names 1 file; a committee has at least two members"),
        (["--member_models", m[0], m[1], "--ensemble_size", "3"],
         "--ensemble_size 3 but --member_models names 2 files"),
        (["--member_models", m[0], m[1], "--foundation_model", m[0]],
         "--member_models and --foundation_model both name the starting model"),
        (["--member_models", m[0], m[2]], "is another architecture"),
        (["--member_models", m[0], str(tmp_path / "nothing.npz")], "existing chemtrain .npz"),
    ]:
        with pytest.raises(DataError, match=expected):
            _run(*out, *argv)
    assert not (tmp_path / "run").exists()
