"""InterleaveTrainers: force matching and relative entropy on one parameter
set (tests/_support/fused_systems.py), and force matching with DiffTRe. One fused epoch equals the turns run
by hand; resume is bitwise; incomplete or foreign checkpoints are refused;
mpirun -np 2 equals one process and
its checkpoint continues in one process."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

import mp
from chemtrain.checkpoint import CheckpointError
from fused_systems import fused


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def host(params):
    return {k: np.asarray(v) for k, v in params.items()}


def test_one_fused_epoch_equals_the_turns_by_hand(tmp_path):
    together, fm, re_trainer = fused(str(tmp_path / "a"), log_file=str(tmp_path / "f.jsonl"),
                                     plot_file=str(tmp_path / "f.png"))
    together.train(1)
    _, fm2, re2 = fused(str(tmp_path / "b"))
    fm2.train(1)
    re2.params = fm2.params
    re2.train(2)
    for k, v in host(re2.params).items():
        np.testing.assert_allclose(host(together.params)[k], v, rtol=1e-12, atol=0)
    assert host(fm.params) != host(together.params)   # RE moved them after FM
    lines = [json.loads(x) for x in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["trainer"]) for r in lines] == [(0, "FM"), (0, "RE")]
    assert (tmp_path / "f.png").stat().st_size > 0
    with pytest.raises(ValueError, match="unique"):
        together.add_trainer(fm, name="FM")
    from fused_systems import ex
    nested, _ = ex.bond_trainer(0, frames=10, prior=True, initialize=False, progress=False,
                                checkpoint_path=str(tmp_path / "nested"))
    with pytest.raises(ValueError, match="another structure"):
        together.add_trainer(nested, name="nested")


def test_resume_is_bitwise(tmp_path):
    full, _, _ = fused(str(tmp_path / "a"))
    full.train(3, checkpoint_freq=1)
    resumed, fm, re_trainer = fused(str(tmp_path / "b"))
    resumed.restore(os.path.join(str(tmp_path / "a"), "fused", "epoch_00001"))
    assert resumed.epoch == 1 and fm.epoch == 1 and re_trainer.epoch == 2
    resumed.train(2)
    for k, v in host(full.params).items():
        assert host(resumed.params)[k].tobytes() == v.tobytes()
    def numbers(history):
        return [{k: v for k, v in r.items() if k != "time_s"} for r in history]
    assert numbers(resumed.history) == numbers(full.history)

    incomplete = str(tmp_path / "incomplete")
    shutil.copytree(os.path.join(str(tmp_path / "a"), "fused", "epoch_00002"), incomplete)
    os.remove(os.path.join(incomplete, "fused.npz"))
    other, _, _ = fused(str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match="fused.npz is missing"):
        other.restore(incomplete)
    swapped, fm3, re3 = fused(str(tmp_path / "d"))
    swapped.parts.reverse()
    with pytest.raises(CheckpointError, match=r"was written for the trainers \[\['FM', 1\]"):
        swapped.restore(os.path.join(str(tmp_path / "a"), "fused", "epoch_00001"))


def test_two_ranks_equal_one_process(tmp_path):
    together, _, _ = fused(str(tmp_path / "single"), kTs=(2.56, 3.0))
    together.train(2)
    want = host(together.params)
    out = tmp_path / "mpi"
    out.mkdir()
    rc, log, _ = mp.mpirun(2, [os.path.join(mp.HERE, "mp_fused.py"), "--out", str(out)],
                           timeout=600)
    assert rc == 0, log[-4000:]
    for rank in range(2):
        got = json.loads((out / f"fused_{rank}.json").read_text())
        for k, v in want.items():
            assert abs(got[k] - float(v)) <= 1e-6 * abs(float(v)), (rank, k, got[k], v)
    # elastic resume: epoch 1 of the 2 ranks continues in this process with
    # the epoch 2 the ranks trained
    resumed, fm, re_trainer = fused(str(tmp_path / "resumed"), kTs=(2.56, 3.0))
    resumed.restore(str(out / "run" / "fused" / "epoch_00001"))
    assert (resumed.epoch, fm.epoch, re_trainer.epoch) == (1, 1, 2)
    resumed.train(1)
    for k, v in host(resumed.params).items():
        assert abs(got[k] - float(v)) <= 1e-9 * abs(got[k]), (k, got[k], v)


def fm_and_difftre(folder):
    """(InterleaveTrainers, force matching, DiffTRe) on the bonded pair of
    tests/_support/difftre_systems.py: force labels of an imperfect bond
    (r_0 0.37 nm, scaled_b 2.0), DiffTRe on the exact RDF and energy."""
    import jax.numpy as jnp
    import optax
    from difftre_systems import bonded_pair_args
    from chemtrain.simulate.langevin import label_frames
    from chemtrain.trainers import DifftreParallel, ForceMatching, InterleaveTrainers, RunOptions
    args = bonded_pair_args(1, checkpoint_path=os.path.join(folder, "difftre"))
    difftre = DifftreParallel(**args)
    difftre.initialize_trajstates()
    rng = np.random.default_rng(0)
    d = rng.normal(size=(16, 3))
    d *= (0.3 + 0.1 * rng.random((16, 1))) / np.linalg.norm(d, axis=1, keepdims=True)
    R = np.stack([np.full((16, 3), 0.5), 0.5 + d], axis=1)
    template = args["energy_fn_template"]
    data = label_frames(template({"r_0": jnp.asarray(0.37), "scaled_b": jnp.asarray(2.0)}),
                        args["neighbor_fn"], R)
    fm = ForceMatching(args["init_params"], optax.adam(0.01), template,
                       args["neighbor_fn"].allocate(jnp.asarray(R[0])), batch=8,
                       checkpoint_path=os.path.join(folder, "fm"),
                       options=RunOptions(progress=False))
    fm.set_dataset(data, "training")
    together = InterleaveTrainers(os.path.join(folder, "fused"), options=RunOptions(progress=False))
    together.add_trainer(fm, num_updates=1, name="FM")
    together.add_trainer(difftre, num_updates=1, name="DiffTRe")
    return together, fm, difftre


def test_force_matching_and_difftre_epoch_equals_the_turns_by_hand(tmp_path):
    """As the first test, with DiffTRe in relative entropy's place."""
    together, fm, difftre = fm_and_difftre(str(tmp_path / "a"))
    together.train(1)
    _, fm2, difftre2 = fm_and_difftre(str(tmp_path / "b"))
    fm2.train(1)
    difftre2.params = fm2.params
    difftre2.train(1)
    for k, v in host(difftre2.params).items():
        np.testing.assert_allclose(host(together.params)[k], v, rtol=1e-12, atol=0)
    assert host(fm.params) != host(together.params)   # DiffTRe moved them after FM
    assert float(host(fm2.params)["r_0"]) != 0.3                # FM trained (from 0.3)
