"""Checkpoints and trajectory files written before the reweighting loop was
redesigned (main at 6bbc7dd, by ``tests/_support/files/legacy/generate.py`` run in a
worktree of that commit) restore on today's loop and continue bitwise: the
parameters after two more epochs equal the ones the old code reached from
the same files (saved beside them by the old code)."""
import os
import sys

import numpy as np

from paths import EXAMPLES, FILES  # noqa: E402

DATA = os.path.join(FILES, "legacy")
sys.path.insert(0, os.path.join(EXAMPLES,
                                "relative_entropy"))

import cg_bond_and_lj as ex  # noqa: E402
from difftre_systems import bonded_pair  # noqa: E402


def _expected(name):
    with np.load(os.path.join(DATA, name)) as f:
        return {k: f[k] for k in f.files}


def _same(params, expected):
    got = {k: np.asarray(v) for k, v in params.items()}
    assert sorted(got) == sorted(expected)
    for k in got:
        assert got[k].dtype == expected[k].dtype and got[k].tobytes() == expected[k].tobytes(), \
            (k, got[k], expected[k])


def test_old_difftre_checkpoint_continues_bitwise(tmp_path):
    tr = bonded_pair(2, sim_batch_size=1, checkpoint_path=str(tmp_path / "a"))
    tr.restore(os.path.join(DATA, "difftre_checkpoint.npz"))
    assert tr.epoch == 2 and tr.update_count == 4
    tr.train(2)
    _same(tr.params, _expected("difftre_continued.npz"))


def test_old_difftre_trajectory_file_loads(tmp_path):
    """The trajectory file alone, into a trainer restored without them."""
    tr = bonded_pair(2, sim_batch_size=1, checkpoint_path=str(tmp_path / "b"))
    tr.restore(os.path.join(DATA, "difftre_checkpoint.npz"), trajstates=False)
    assert not tr.trajstates
    tr.load_trajstates(os.path.join(DATA, "difftre_trajstates.npz"))
    tr.train(2)
    _same(tr.params, _expected("difftre_continued.npz"))


def test_old_relative_entropy_checkpoint_continues_bitwise(tmp_path):
    tr, _ = ex.bond_trainer(0, frames=200, production=1.0, progress=False,
                            checkpoint_path=str(tmp_path / "r"), initialize=False)
    tr.restore(os.path.join(DATA, "relentropy_checkpoint.npz"))
    assert tr.epoch == 2 and len(tr.s_rel) == 1
    tr.train(2)
    _same(tr.params, _expected("relentropy_continued.npz"))
