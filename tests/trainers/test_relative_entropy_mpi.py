"""RelativeEntropy over real ``mpirun -np 2`` ranks
(tests/_support/mp_relentropy.py): three state points split over two ranks
equal one process; resume under MPI is bitwise; a one-process checkpoint
continues on two ranks as the one process did."""
import json
import os

import jax
import numpy as np

import mp
from mp_relentropy import small, summary

SCRIPT = os.path.join(mp.HERE, "mp_relentropy.py")


def test_two_ranks_equal_one_process(tmp_path):
    with jax.enable_x64(True):
        single = small(str(tmp_path / "single"))
        single.train(2, checkpoint_freq=1)
        want = summary(single)
    out = tmp_path / "mpi"
    out.mkdir()
    rc, log, _ = mp.mpirun(2, [SCRIPT, "--out", str(out), "--single",
                               single.store.epoch_path(1)], timeout=600)
    assert rc == 0, log[-4000:]
    for rank in range(2):
        got = json.loads((out / f"full_{rank}.json").read_text())
        for k, v in want["params"].items():
            assert abs(got["params"][k] - v) <= 1e-6 * abs(v), (rank, k, got["params"][k], v)
        np.testing.assert_allclose(got["s_rel"], want["s_rel"], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6, atol=1e-9)
        resumed = json.loads((out / f"resumed_{rank}.json").read_text())
        assert resumed == got   # bitwise: the same floats
        # elastic resume: one process's epoch 1 continued on two ranks
        elastic = json.loads((out / f"from_single_{rank}.json").read_text())
        for k, v in want["params"].items():
            assert abs(elastic["params"][k] - v) <= 1e-9 * abs(v), (k, elastic["params"][k], v)
        np.testing.assert_allclose(elastic["losses"], want["losses"], rtol=1e-9)
