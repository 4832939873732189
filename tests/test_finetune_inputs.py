"""chemtrain-finetune's numeric flags on bad values (issue 37): a one-line
argparse error naming the flag and the accepted range (exit code 2), before
any file is read or written."""
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
