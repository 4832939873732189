"""A third objective (tests/_support/mean_energy.py, under 60 lines) trains on
the reweighting loop without touching it, in one process and over
``mpirun -np 2`` ranks alike, to the answer its stored trajectories give."""
import json
import os

import jax
import numpy as np

import mp
from mp_objective import KTS, TARGETS, trainer

SCRIPT = os.path.join(mp.HERE, "mp_objective.py")


def known_shift(bond_energies):
    """The constant that makes the mean of (bond + shift) over both state
    points' stored snapshots equal their targets on average (uniform weights:
    a constant shift does not reweight): from the bond energies alone."""
    return float(np.mean([t - np.mean(u) for t, u in zip(TARGETS, bond_energies)]))


def test_mean_energy_objective_reaches_its_known_answer_in_one_process_and_two_ranks(tmp_path):
    with jax.enable_x64(True):
        tr, bond_energies = trainer(str(tmp_path / "single"))
        energies = [bond_energies(i) for i in range(len(KTS))]
    want = known_shift(energies)
    # equipartition for the stiff bond (one radial degree of freedom): <U> ~ kT/2
    assert abs(want - np.mean([t - k / 2 for t, k in zip(TARGETS, KTS)])) < 0.6, want
    # sgd(0.25) on (m + s - t)^2 halves the distance each update: 12 updates
    assert abs(float(tr.params["shift"]) - want) < 1e-3 * max(1.0, abs(want))
    # one shift for both: the loss left is the spread of target - <bond>
    d = np.array([t - np.mean(u) for t, u in zip(TARGETS, energies)])
    assert abs(tr.update_losses[-1] - np.mean((d - d.mean()) ** 2)) < 1e-4
    assert tr.update_losses[0] > 10 * tr.update_losses[-1]
    assert tr.history[-1]["statepoints"][0]["recomputed"] is False
    out = tmp_path / "mpi"
    out.mkdir()
    rc, log, _ = mp.mpirun(2, [SCRIPT, "--out", str(out)], timeout=600)
    assert rc == 0, log[-4000:]
    for rank in range(2):
        got = json.loads((out / f"result_{rank}.json").read_text())
        assert abs(got["shift"] - known_shift(got["bond"])) < 1e-3 * max(1.0, abs(want)), got
        # the keys derive from the state point, not the rank: the same run
        np.testing.assert_allclose(got["bond"], energies, rtol=1e-9)
        np.testing.assert_allclose(got["shift"], float(tr.params["shift"]), rtol=1e-9)
