"""RelativeEntropy: the gradient against finite differences and an
independent numpy computation, zero expected gradient at the truth, the
example's physics (examples/relative_entropy/cg_bond_and_lj.py), files and
bad input. MPI: tests/trainers/test_relative_entropy_mpi.py."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from chemtrain.checkpoint import CheckpointError
from chemtrain.learn.update import chains_of, energies_of
from chemtrain.trainers import TrainingError
from paths import EXAMPLES

sys.path.insert(0, os.path.join(EXAMPLES,
                                "relative_entropy"))
import cg_bond_and_lj as ex  # noqa: E402


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def bond_lengths(R, box=ex.BOND["box"]):
    d = R[..., 1::2, :] - R[..., 0::2, :]
    d -= box * np.round(d / box)
    return np.linalg.norm(d, axis=-1)


def dU(R, r_0, b):
    """Per configuration, dU/dr_0 and dU/db of U = sum 100 b / 2 (r - r_0)^2."""
    r = bond_lengths(np.asarray(R))
    return np.stack([np.sum(-100 * b * (r - r_0), -1), np.sum(50 * (r - r_0) ** 2, -1)], -1)


def U(R, r_0, b):
    return np.sum(50 * b * (bond_lengths(np.asarray(R)) - r_0) ** 2, -1)


def test_gradient_matches_finite_differences_and_numpy(tmp_path):
    tr, _ = ex.bond_trainer(0, frames=200, production=5.0, progress=False,
                            checkpoint_path=str(tmp_path))
    sp, trajs = tr.statepoints[0], tr.trajstates[0]
    chains, U_ref = chains_of(trajs), energies_of(trajs)
    R = sp.data.take(np.arange(100))
    nbrs = sp.neighbor_fn.allocate(R[0])
    theta = {"r_0": jnp.asarray(0.31), "b": jnp.asarray(1.6)}   # not the trajectory's
    (_, aux), grad = sp.functions.loss_and_grad(theta, chains, U_ref, R, nbrs, sp.state_kwargs)
    n = len(U_ref)
    assert float(aux["n_eff"]) < 0.99 * n   # the reweighting is exercised

    # independent: numpy weights and averages of the analytic derivatives
    snaps = np.asarray(trajs[0].snapshots.position)
    beta = 1 / ex.BOND["kT"]
    log_w = -beta * (U(snaps, 0.31, 1.6) - np.asarray(U_ref))
    w = np.exp(log_w - log_w.max())
    w /= w.sum()
    expected = beta * (dU(R, 0.31, 1.6).mean(0) - w @ dU(snaps, 0.31, 1.6))
    got = np.array([float(grad["r_0"]), float(grad["b"])])
    np.testing.assert_allclose(got, expected, rtol=1e-8)

    # the derivative of the relative-entropy change estimate at theta
    for j, k in enumerate(("r_0", "b")):
        h = 1e-5

        def change(sign):
            new = dict(theta, **{k: theta[k] + sign * h})
            return float(sp.functions.change(theta, new, chains, aux["U"], aux["weights"], R, nbrs,
                                       sp.state_kwargs)[0])
        fd = (change(1) - change(-1)) / (2 * h)
        assert abs(fd - got[j]) <= 1e-3 * abs(got[j]), (k, fd, got[j])


def block_se(x, blocks=10):
    """Standard error of the mean of correlated rows ``x`` by block averages."""
    means = np.array([b.mean(0) for b in np.array_split(x, blocks)])
    return means.std(0, ddof=1) / np.sqrt(blocks)


def test_gradient_is_zero_at_the_truth(tmp_path):
    truth = {"r_0": 0.35, "b": 2.5}
    tr, _ = ex.bond_trainer(1, frames=1000, production=20.0, progress=False,
                            checkpoint_path=str(tmp_path))
    tr.params = {k: jnp.asarray(v) for k, v in truth.items()}
    tr.initialize_trajstates(2)   # equilibrate, then sample at the truth
    sp, trajs = tr.statepoints[0], tr.trajstates[0]
    chains, U_ref = chains_of(trajs), energies_of(trajs)
    snaps = np.asarray(trajs[0].snapshots.position)
    beta = 1 / ex.BOND["kT"]

    def gradient_and_se(R):
        nbrs = sp.neighbor_fn.allocate(R[0])
        (_, aux), g = sp.functions.loss_and_grad(tr.params, chains, U_ref, R, nbrs, sp.state_kwargs)
        se = beta * np.hypot(dU(R, **truth).std(0, ddof=1) / np.sqrt(len(R)),
                             block_se(dU(snaps, **truth)))
        return np.array([float(g["r_0"]), float(g["b"])]), se

    g, se = gradient_and_se(sp.data.take(np.arange(sp.data.n)))
    assert np.all(np.abs(g) < 3 * se), (g, se)
    # the same test sees a reference of longer bonds (r_0 = 0.38)
    g, se = gradient_and_se(ex.exact_bond_frames(1000, 7, r_0=0.38))
    assert abs(g[0]) > 3 * se[0], (g, se)


@pytest.mark.parametrize("seed", [0, 1])
def test_example_bond_recovers_b0_and_kb(tmp_path, seed):
    tr, truth = ex.bond_trainer(seed, progress=False, checkpoint_path=str(tmp_path))
    tr.train(200)
    got = ex.recovered(tr)
    for k, v in truth.items():
        assert abs(got[k] / v - 1) < 0.05, (k, got[k], v)
    assert tr.epoch_losses[-1] < 0   # the estimated relative entropy fell
    assert any(r["recomputed"] for e in tr.history for r in e["statepoints"])


def test_example_lj_recovers_sigma_and_epsilon(tmp_path):
    tr, truth = ex.lj_trainer(0, progress=False, checkpoint_path=str(tmp_path),
                              plot_file=str(tmp_path / "re.png"), log_file=str(tmp_path / "m.jsonl"))
    tr.train(80)
    got = ex.recovered(tr)
    assert abs(got["sigma"] / truth["sigma"] - 1) < 0.02, got
    assert abs(got["epsilon"] / truth["epsilon"] - 1) < 0.05, got
    assert (tmp_path / "re.png").stat().st_size > 0
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 80


def small(tmp_path, **options):
    return ex.bond_trainer(0, updates=4, kTs=(2.56, 3.0), frames=50, production=2.0,
                           progress=False, checkpoint_path=str(tmp_path), sim_batch_size=-1,
                           **options)[0]


def test_resume_is_bitwise_and_foreign_files_are_refused(tmp_path):
    full = small(tmp_path / "a")
    full.train(3)
    first = small(tmp_path / "b")
    first.train(1, checkpoint_freq=1)
    resumed = small(tmp_path / "c")
    resumed.restore(first.store.epoch_path(1))
    resumed.train(2)
    for k in full.params:
        assert np.asarray(full.params[k]).tobytes() == np.asarray(resumed.params[k]).tobytes()
    assert full.s_rel == resumed.s_rel
    assert [e["loss"] for e in full.history] == [e["loss"] for e in resumed.history]

    nan = small(tmp_path / "d", optimizer=optax.scale(float("nan")))
    with pytest.raises(TrainingError, match="non-finite parameters"):
        nan.train(1)
    other = small(tmp_path / "e")
    with pytest.raises(CheckpointError, match="error_state written after a failure"):
        other.restore(str(tmp_path / "d" / "relentropy_error_state.npz"))


def test_bad_reference_data_is_refused(tmp_path):
    tr, _ = ex.bond_trainer(0, frames=20, production=1.0, progress=False,
                            checkpoint_path=str(tmp_path))
    sp = tr.statepoints[0]
    good = ex.exact_bond_frames(20, 3)

    def add(data, **kw):
        tr.add_statepoint(data, sp.fns.energy_fn_template, None, sp.neighbor_fn, None,
                          {"kT": 2.56}, good[0], initialize_traj=False, **kw)

    with pytest.raises(ValueError, match="30 particles in 3 dimensions.*32 in 3"):
        add(good[:, :30])
    with pytest.raises(ValueError, match="32 particles in 2 dimensions.*32 in 3"):
        add(good[..., :2])
    with pytest.raises(ValueError, match="empty"):
        add(good[:0])
    with pytest.raises(ValueError, match="reference_batch_size=21 is larger than the reference "
                                         "data \\(20 frames\\)"):
        add(good, reference_batch_size=21)
    bad = good.copy()
    bad[4, 3, 1] = np.nan
    with pytest.raises(ValueError, match=r"reference frame\(s\) \[4\] hold NaN"):
        add(bad)
    assert tr.n_statepoints == 1


def test_reference_frames_from_hdf5_equal_the_array(tmp_path):
    import h5py
    from chemtrain.data import HDF5ParallelDataLoader
    frames = ex.exact_bond_frames(40, 5)
    path = str(tmp_path / "ref.h5")
    with h5py.File(path, "w") as f:
        f["R"] = frames
    params = []
    for name, data in (("array", frames), ("file", HDF5ParallelDataLoader(path, keys=["R"]))):
        tr, _ = ex.bond_trainer(0, reference_data=data, production=1.0, progress=False,
                                checkpoint_path=str(tmp_path / name))
        tr.train(2)
        params.append({k: np.asarray(v).tobytes() for k, v in tr.params.items()})
    assert params[0] == params[1]
    with h5py.File(path, "a") as f:
        f["R"][7, 2, 0] = np.nan
    # refused where the state point is added: its frames are read once there
    with pytest.raises(ValueError, match=r"reference frame\(s\) \[7\] hold NaN"):
        ex.bond_trainer(0, reference_data=HDF5ParallelDataLoader(path, keys=["R"]),
                        production=1.0, progress=False, checkpoint_path=str(tmp_path / "n"),
                        initialize=False)
