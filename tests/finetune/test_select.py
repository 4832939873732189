"""Committees on the command line: ``chemtrain-finetune --ensemble_size 2``
writes its members, ``chemtrain-select`` picks the pool's most uncertain
structures as the library does, and both refuse bad input by name."""
import json
import os

import ase.io
import numpy as np
import pytest

from cu_data import cu_frames

TINY = ["--num_channels", "4", "--max_ell", "1", "--correlation", "2", "--r_max", "4.0"]
SPLIT = ["--n_train", "4", "--n_valid", "1", "--n_test", "1", "--batch_size", "2",
         "--parallelism", "single"]


@pytest.fixture(scope="module")
def committee(tmp_path_factory):
    from chemtrain.finetune import run
    d = tmp_path_factory.mktemp("committee")
    train = str(d / "cu.xyz")
    cu_frames(train, n=6)
    pool = str(d / "pool.xyz")
    cu_frames(pool, n=5, seed=7)
    out = str(d / "run")
    results = run(["--train_file", train, "--results_dir", out, "--max_num_epochs", "1",
                   "--ensemble_size", "2", "--default_dtype", "float64", "--no_torch_export",
                   *SPLIT, *TINY])
    return {"results": results, "out": out, "pool": pool, "train": train, "dir": d}


def test_members_are_written_and_differ(committee):
    files = committee["results"]["members_npz"]
    assert [os.path.basename(f) for f in files] == ["model_member0.npz", "model_member1.npz"]
    from chemtrain.models import mace
    (_, a), (_, b) = mace.load(files[0]), mace.load(files[1])
    import jax
    assert any(not np.allclose(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    with open(os.path.join(committee["out"], "results.json")) as f:   # relative to the folder
        assert json.load(f)["members_npz"] == [os.path.basename(f) for f in files]


def test_select_picks_as_the_library_does(committee, tmp_path, capsys):
    from chemtrain.calculator import CommitteeCalculator
    from chemtrain.finetune.select import main
    from chemtrain.uncertainty import select
    out = str(tmp_path / "picked.xyz")
    assert main(["--model_dir", committee["out"], "--pool", committee["pool"], "--n", "2",
                 "--out", out]) == 0
    picked = ase.io.read(out, index=":")
    want = select(CommitteeCalculator.from_mace(committee["results"]["members_npz"]),
                  committee["pool"], 2)
    assert [a.info["pool_index"] for a in picked] == want.tolist()
    assert picked[0].info["committee_forces_std"] >= picked[1].info["committee_forces_std"] > 0
    assert "pool indices: " + " ".join(map(str, want)) in capsys.readouterr().out


def test_select_refuses_bad_input(committee, tmp_path, capsys):
    from chemtrain.finetune.select import main
    args = ["--pool", committee["pool"], "--out", str(tmp_path / "p.xyz")]
    assert main(["--model_dir", str(tmp_path), "--n", "1", *args]) == 2
    assert "holds no committee" in capsys.readouterr().err
    assert main(["--model_dir", committee["out"], "--n", "9", *args]) == 2
    assert "--n 9 is more than the pool's 5 structures" in capsys.readouterr().err
    empty = str(tmp_path / "empty.xyz")
    with open(empty, "w") as f:
        f.write("0\nLattice=\"3 0 0 0 3 0 0 0 3\" Properties=species:S:1:pos:R:3 pbc=\"T T T\"\n")
    assert main(["--model_dir", committee["out"], "--n", "1", "--pool", empty,
                 "--out", str(tmp_path / "q.xyz")]) == 2
    assert "has no positions" in capsys.readouterr().err
    one = committee["results"]["members_npz"][:1]
    assert main(["--models", *one, "--n", "1", *args]) == 2
    assert "at least 2 members" in capsys.readouterr().err


def test_a_copied_folder_reads_its_own_members(committee, tmp_path):
    """results.json names the members relative to the folder. A copy of an
    absolute --results_dir (round 1 archived, round 2 trained at the old
    path) read the old path's members before: another committee."""
    import shutil
    from chemtrain.finetune.select import members_of
    copy = str(tmp_path / "round1")
    shutil.copytree(committee["out"], copy)
    assert members_of(copy) == [os.path.join(copy, f"model_member{k}.npz") for k in range(2)]
    # a results.json of an older chemtrain (absolute paths) is read the same way
    record = os.path.join(copy, "results.json")
    with open(record) as f:
        old = dict(json.load(f), members_npz=committee["results"]["members_npz"])
    with open(record, "w") as f:
        json.dump(old, f)
    assert members_of(copy) == [os.path.join(copy, f"model_member{k}.npz") for k in range(2)]
    os.remove(os.path.join(copy, "model_member1.npz"))
    with pytest.raises(Exception, match=r"lists the members \['model_member1.npz'\], which are "
                                        r"not in --model_dir"):
        members_of(copy)


def test_select_refuses_a_committee_without_spread(committee, tmp_path, capsys):
    """One member file given twice: every score is 0, and the ranking would
    be the pool's first structures (returned before without a word)."""
    from chemtrain.finetune.select import main
    files = committee["results"]["members_npz"]
    args = ["--pool", committee["pool"], "--n", "1", "--out", str(tmp_path / "p.xyz")]
    assert main(["--models", files[0], files[0], *args]) == 2
    assert "holds the same file more than once" in capsys.readouterr().err
    copy = str(tmp_path / "copy.npz")
    import shutil
    shutil.copy(files[0], copy)
    assert main(["--models", files[0], copy, *args]) == 2
    assert "members agree on every structure (forces_std 0 on all 5)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "p.xyz")


def test_committee_flags_are_checked(committee, tmp_path):
    from chemtrain.finetune import DataError, run
    from chemtrain.data.convert import convert
    from mace_ref import small_standin
    h5 = str(tmp_path / "standin.h5")
    convert(small_standin(tmp_path), h5, progress=False)
    with pytest.raises(DataError, match="--ensemble_size trains from in-memory data"):
        run(["--train_file", h5, "--results_dir", str(tmp_path / "h"), "--ensemble_size", "2",
             *SPLIT, *TINY])
    with pytest.raises(SystemExit):
        run(["--train_file", committee["train"], "--ensemble_size", "0"])
    # a resumed run must keep the committee
    with pytest.raises(DataError, match=r"--ensemble_size \(then 2, now 3\)"):
        run(["--train_file", committee["train"], "--results_dir", committee["out"],
             "--restart_latest", "--ensemble_size", "3", "--default_dtype", "float64",
             "--no_torch_export", *SPLIT, *TINY])
    # ... and the loss, whose scale the best epoch and a plateau compare
    resume = ["--train_file", committee["train"], "--results_dir", committee["out"],
              "--restart_latest", "--ensemble_size", "2", "--default_dtype", "float64",
              "--no_torch_export", *SPLIT, *TINY]
    with pytest.raises(DataError, match=r"--loss \(then 'weighted', now 'huber'\)"):
        run([*resume, "--loss", "huber"])
    with pytest.raises(DataError, match=r"--forces_weight \(then 1\.0, now 10\.0\)"):
        run([*resume, "--forces_weight", "10"])
    # a bootstrap without a committee trained one model on the whole set (rc 0)
    with pytest.raises(DataError, match=r"--ensemble_bootstrap draws a bootstrap sample for "
                                        r"each member of a committee; add --ensemble_size"):
        run(["--train_file", committee["train"], "--results_dir", str(tmp_path / "b"),
             "--ensemble_bootstrap", *SPLIT, *TINY])
    assert not os.path.exists(tmp_path / "b")
