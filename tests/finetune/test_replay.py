"""Replay (multi-head) fine-tuning with chemtrain-finetune (issue 35): the
model gets mace-torch's heads, trains on both data sets in one step, goes
back to mace-torch with both heads, gives the same result under
``mpirun -np 2`` as in one process, and refuses bad flags by name."""
import json
import os

import ase.io
import numpy as np
import pytest

import mp
from cu_data import cu_frames

TINY = ["--num_channels", "4", "--max_ell", "1", "--correlation", "2", "--r_max", "4.0",
        "--default_dtype", "float64"]
SPLIT = ["--n_train", "4", "--n_valid", "2", "--n_test", "2", "--batch_size", "2",
         "--seed", "1"]
DRIVER = "import sys, json; from chemtrain.finetune import run; run(json.loads(sys.argv[1]))"


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """A 1-epoch 'foundation' on one Cu set, then replay fine-tunings of it on
    another Cu set: in this process and under mpirun -np 2."""
    from chemtrain.finetune import run
    d = tmp_path_factory.mktemp("replay")
    pt, new = str(d / "pt.xyz"), str(d / "new.xyz")
    cu_frames(pt, n=8, seed=3)
    cu_frames(new, n=8, seed=4)
    base = str(d / "base")
    run(["--train_file", pt, "--results_dir", base, "--max_num_epochs", "1", "--parallelism",
         "single", "--no_torch_export", *SPLIT, *TINY])
    job = ["--train_file", new, "--foundation_model", os.path.join(base, "model.npz"),
           "--pt_train_file", pt, "--E0s", "foundation", "--force_mh_ft_lr", "True",
           "--weight_pt_head", "0.5", "--max_num_epochs", "2", *SPLIT, *TINY]
    one = run(["--results_dir", str(d / "one"), "--parallelism", "single", *job])
    code, text, _ = mp.mpirun(2, ["-c", DRIVER, json.dumps(
        ["--results_dir", str(d / "mpi"), "--parallelism", "mpi", "--no_torch_export", *job])],
        devices=1, timeout=900)
    assert code == 0, text[-3000:]
    return {"dir": d, "pt": pt, "new": new, "base": base, "one": one, "job": job}


def test_replay_model_has_mace_torch_heads_and_loads_in_mace_torch(replay):
    import mace  # noqa: F401  (before e3nn)
    from mace.calculators import MACECalculator
    from chemtrain.calculator import ChemtrainCalculator
    from chemtrain.models import mace as cm
    cfg, _ = cm.load(replay["one"]["model_npz"])
    assert cfg.heads == ("pt_head", "Default")
    frames = ase.io.read(replay["new"], ":")[:3]
    for head in ("pt_head", "Default"):
        theirs = MACECalculator(model_paths=replay["one"]["model_torch"], head=head,
                                default_dtype="float64", device="cpu")
        ours = ChemtrainCalculator.from_mace(replay["one"]["model_npz"], head=head)
        for a in frames:
            a = a.copy()
            a.calc = theirs
            e_t, f_t = a.get_potential_energy(), a.get_forces()
            a.calc = ours
            assert a.get_potential_energy() == pytest.approx(e_t, rel=1e-8, abs=1e-8)
            np.testing.assert_allclose(a.get_forces(), f_t, rtol=1e-6, atol=1e-8)
    # the heads differ after training: the new head learnt the new data
    pt_e = ChemtrainCalculator.from_mace(replay["one"]["model_npz"], head="pt_head")
    ft_e = ChemtrainCalculator.from_mace(replay["one"]["model_npz"], head="Default")
    a, b = frames[1].copy(), frames[1].copy()
    a.calc, b.calc = pt_e, ft_e
    assert a.get_potential_energy() != pytest.approx(b.get_potential_energy(), rel=1e-6)


def test_calculators_default_to_the_fine_tuned_head(replay):
    """The load line chemtrain-finetune prints (from_mace without head=)
    evaluates the head that was tested and reported, 'Default', as
    mace-torch's MACECalculator does; committees take head=; a further
    fine-tuning starts from 'Default' too. Before, all three took head 0,
    the foundation's pt_head."""
    from chemtrain.calculator import ChemtrainCalculator, CommitteeCalculator
    from chemtrain.finetune.model import foundation_head
    from chemtrain.models import mace as cm
    npz = replay["one"]["model_npz"]
    atoms = ase.io.read(replay["new"], "1")
    energy = {}
    for head in (None, "Default", "pt_head"):
        a = atoms.copy()
        a.calc = ChemtrainCalculator.from_mace(npz, head=head)
        energy[head] = a.get_potential_energy()
    assert energy[None] == energy["Default"] != energy["pt_head"]
    assert ChemtrainCalculator.from_mace(npz).model.head == "Default"
    files = [npz, os.path.join(replay["dir"], "mpi", "model.npz")]
    for head in (None, "pt_head"):
        a = atoms.copy()
        a.calc = CommitteeCalculator.from_mace(files, head=head)
        a.get_potential_energy()
        want = energy["Default" if head is None else head]
        np.testing.assert_allclose(a.calc.results["member_energies"][0], want, rtol=1e-10)
    cfg, params = cm.load(npz)
    one, one_params, note = foundation_head(cfg, params, npz, None)
    assert one.heads == ("Default",) and "fine-tuning 'Default'" in note
    _, want = cm.select_head(cfg, params, "Default")
    import jax
    for x, y in zip(jax.tree.leaves(one_params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(x, y)
    assert foundation_head(cfg, params, npz, "pt_head")[0].heads == ("pt_head",)
    import dataclasses
    other = dataclasses.replace(cfg, heads=("pt_head", "water"))
    with pytest.raises(ValueError, match=r"several heads \['pt_head', 'water'\] and none is "
                                         r"named 'Default'"):
        ChemtrainCalculator.from_mace(other, params)


def test_the_steps_mix_both_sets(replay):
    """(4 new + 8 replayed structures: 8 less int(0.1 x 8) = 0 kept for
    validation, as mace-torch) / batch 2 = 6 steps per epoch."""
    lines = [json.loads(x) for x in open(os.path.join(replay["dir"], "one", "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [6, 12]


def test_mpirun_two_ranks_equal_one_process(replay):
    from chemtrain.models import mace as cm
    _, one = cm.load(os.path.join(replay["dir"], "one", "model.npz"))
    _, two = cm.load(os.path.join(replay["dir"], "mpi", "model.npz"))
    import jax
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12)
    _, start = cm.load(os.path.join(replay["base"], "model.npz"))
    moved = max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(
        jax.tree.map(lambda x, y: x - y, one["interactions"], start["interactions"])))
    assert moved > 1e-6   # training changed the shared layers: the comparison is not trivial


def run_error(argv, capsys):
    from chemtrain.finetune import main
    assert main(argv) == 2
    return capsys.readouterr().err


def test_replay_error_cases(replay, capsys, tmp_path):
    out = str(tmp_path / "out")
    base = ["--train_file", replay["new"], "--results_dir", out, *SPLIT, *TINY]
    foundation = ["--foundation_model", os.path.join(replay["base"], "model.npz")]
    # a pretraining file with an element the foundation model lacks
    frames = ase.io.read(replay["pt"], ":")
    frames[2].set_atomic_numbers([47] * len(frames[2]))
    ag = str(tmp_path / "pt_ag.xyz")
    ase.io.write(ag, frames, format="extxyz")
    err = run_error([*base, *foundation, "--pt_train_file", ag, "--E0s", "foundation"], capsys)
    assert "holds atomic numbers [47] that the foundation model does not know" in err, err
    err = run_error([*base, "--pt_train_file", replay["pt"]], capsys)
    assert "give --foundation_model too" in err, err
    err = run_error([*base, *foundation, "--pt_train_file", replay["pt"],
                     "--multiheads_finetuning", "False", "--E0s", "foundation"], capsys)
    assert "--multiheads_finetuning is False" in err, err
    err = run_error([*base, *foundation, "--weight_pt_head", "2"], capsys)
    assert "--weight_pt_head belong to replay fine-tuning" in err, err
    err = run_error([*base, *foundation, "--pt_train_file", replay["pt"]], capsys)
    assert "cannot use --E0s average" in err, err
    # 4 fine-tuning structures against 8 replayed: 1 + 200000 copies (it hung before)
    err = run_error([*base, *foundation, "--pt_train_file", replay["pt"], "--E0s", "foundation",
                     "--real_pt_data_ratio_threshold", "100000"], capsys)
    assert ("would repeat the 4 fine-tuning structures 200001 times against 8 replayed ones "
            "(800004 structures in every epoch); at most 1000 copies") in err, err
    assert "give a threshold below 500" in err, err
    err = run_error([*base, *foundation, "--foundation_head", "nope"], capsys)
    assert "--foundation_head 'nope': The MACE model has no head 'nope'" in err, err
    err = run_error([*base, "--foundation_head", "Default"], capsys)
    assert "--foundation_head picks a head of --foundation_model" in err, err
    assert not os.path.exists(out)
