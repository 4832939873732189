"""DifftreParallel over MPI: real ``mpirun -np 2`` (and 3) ranks running
tests/mp_difftre.py, compared with the same training in this process.

The system is two bonded particles at 4 (or 5) temperatures
(tests/difftre_systems.py): every update reweights, some recompute their
trajectories on one rank and send them to the other, so the checks cover
the split of state points, the gradient sum and the trajectory exchange.
"""
import json
import re
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mp
from chemtrain.learn import ReuseRule
from chemtrain.learn.difftre_objective import loss_and_grad
from difftre_systems import bonded_pair, update_recorder

SCRIPT = os.path.join(mp.HERE, "mp_difftre.py")


def read(folder, name, n=2):
    return [json.loads((folder / f"{name}_{r}.json").read_text()) for r in range(n)]


def launch(tmp_path_factory, case, n=2, devices=1, timeout=600):
    out = tmp_path_factory.mktemp(case)
    rc, log, _ = mp.mpirun(n, [SCRIPT, "--case", case, "--out", str(out)], devices=devices,
                           timeout=timeout)
    assert rc == 0, log[-4000:]
    return out


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    return launch(tmp_path_factory, "main")


def single_run(folder, n_statepoints, sim_batch_size, epochs, **kwargs):
    records, on_update = update_recorder()
    tr = bonded_pair(n_statepoints, sim_batch_size=sim_batch_size, parallelism="single",
                     checkpoint_path=str(folder), on_update=on_update, **kwargs)
    tr.initialize_trajstates()
    tr.train(epochs)
    return tr, records


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The runs of tests/mp_difftre.py in this one process."""
    folder = tmp_path_factory.mktemp("single")
    return {"eq2": single_run(folder / "a", 4, 2, 3), "eq-1": single_run(folder / "b", 4, -1, 3),
            "fold": single_run(folder / "c", 5, 2, 2, optimizer=optax.sgd(1e-3),
                               reuse=ReuseRule(pool=1, max_reuse_se=None,
                                               max_reuses=None))}


def params_of(tr):
    return {k: float(v) for k, v in tr.params.items()}


def assert_close(a, b, rtol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= rtol * abs(b[k]), (k, a[k], b[k])


def recomputed(tr):
    return [[r["recomputed"] for r in e["statepoints"]] for e in tr.history]


def check_replicas(ranks):
    """Every rank ends with the same parameters and all trajectory states."""
    first = ranks[0]
    for other in ranks[1:]:
        assert other["params"] == first["params"]
        assert other["trajstates"] == first["trajstates"]
        assert other["trajstates_crc"] == first["trajstates_crc"]
    assert first["trajstates"] == list(range(len(first["recomputed"][0])))


@pytest.mark.parametrize("sim_batch_size", [2, -1])
def test_two_ranks_train_like_one_process(main_run, single, sim_batch_size):
    ranks = read(main_run, f"eq{sim_batch_size}")
    check_replicas(ranks)
    tr, _ = single[f"eq{sim_batch_size}"]
    assert ranks[0]["update_count"] == tr.update_count == 3 * (2 if sim_batch_size == 2 else 1)
    assert_close(ranks[0]["params"], params_of(tr))
    # the same trajectories were recomputed, some on each rank (so each rank
    # received states from the other)
    assert ranks[0]["recomputed"] == recomputed(tr)
    flags = np.array(recomputed(tr))
    batch = 4 if sim_batch_size == -1 else 2
    rank_of = [(sp % batch) * 2 // batch for sp in range(4)]  # blocks of each batch
    assert {rank_of[sp] for sp in np.nonzero(flags)[1]} == {0, 1} and not flags.all()


@pytest.fixture(scope="module")
def three_run(tmp_path_factory):
    return launch(tmp_path_factory, "three", n=3)


def test_three_ranks_split_four_statepoints(three_run, single):
    """sim_batch_size=-1 on 3 ranks: 2, 1 and 1 state points per rank."""
    out = three_run
    ranks = read(out, "eq-1", 3)
    check_replicas(ranks)
    assert_close(ranks[0]["params"], params_of(single["eq-1"][0]))
    for name, pattern in (("batch_below_ranks", "sim_batch_size=2 is smaller than the number of "
                                                "MPI ranks \\(3\\)"),
                          ("all_below_ranks", "over the 3 MPI ranks, but there are only 2 state")):
        errors = read(out, name, 3)
        assert all(e == errors[0] for e in errors), errors
        assert errors[0]["type"] == "ValueError", errors[0]
        assert re.search(pattern, errors[0]["message"]), errors[0]


def test_remainder_is_folded_and_gradient_is_the_true_batch_mean(main_run, single):
    ranks = read(main_run, "fold")
    check_replicas(ranks)
    tr, records = single["fold"]
    # every state point exactly once per epoch: updates [0, 1] and [2, 3, 4]
    for epoch, used in enumerate(ranks[0]["used"]):
        assert sorted(sp for sp, _ in used) == [0, 1, 2, 3, 4]
        assert {sp: u for sp, u in used} == {0: 2 * epoch, 1: 2 * epoch, 2: 2 * epoch + 1,
                                             3: 2 * epoch + 1, 4: 2 * epoch + 1}
    assert [r["batch"] for r in ranks[0]["updates"]] == [[0, 1], [2, 3, 4]] * 2
    # SGD: the step is -lr x the gradient; each equals the single process's
    assert len(ranks[0]["updates"]) == len(records) == 4  # 2 epochs of 2 updates
    for mpi, one in zip(ranks[0]["updates"], records):
        assert mpi["batch"] == one["batch"]
        assert_close(mpi["before"], one["before"])
        assert_close(mpi["after"], one["after"])
    # ... and the mean over the 3 state points of the folded batch, computed
    # here one state point at a time (no trajectory was recomputed)
    assert not np.array(ranks[0]["recomputed"]).any()
    last = ranks[0]["updates"][-1]
    params = {k: jnp.asarray(v) for k, v in last["before"].items()}
    grads = [loss_and_grad(tr.statepoints[i], params, tr.trajstates[i])[1] for i in [2, 3, 4]]
    for k in params:
        mean = float(np.mean([float(g[k]) for g in grads]))
        step = (last["after"][k] - last["before"][k]) / -1e-3
        assert abs(step - mean) <= 1e-6 * abs(mean), (k, step, mean)


def test_resume_under_mpi_equals_uninterrupted(main_run):
    resumed, straight = read(main_run, "resumed"), read(main_run, "eq2")
    check_replicas(resumed)
    assert resumed[0]["params"] == straight[0]["params"]
    assert resumed[0]["epoch"] == 3 and resumed[0]["recomputed"] == straight[0]["recomputed"]


def test_seven_statepoints_of_three_ranks_resume_on_two_ranks_and_one_process(three_run):
    """Elastic resume: a checkpoint written on 3 ranks after epoch 1 (7 state
    points, 2 updates per epoch) continues on 2 ranks and in this process
    with the updates the uninterrupted 3-rank run made."""
    straight = read(three_run, "seven", 3)
    check_replicas(straight)
    rc, log, _ = mp.mpirun(2, [SCRIPT, "--case", "seven_on_two", "--out", str(three_run)])
    assert rc == 0, log[-4000:]
    on_two = read(three_run, "seven_on_two")
    check_replicas(on_two)
    records, on_update = update_recorder()
    tr = bonded_pair(7, sim_batch_size=3, parallelism="single", on_update=on_update,
                     checkpoint_path=str(three_run / "seven_on_one"))
    tr.restore(str(three_run / "seven.npz"))
    tr.train(2)
    want = straight[0]["updates"][2:]
    assert len(want) == 4 and [u["batch"] for u in want] == [[0, 1, 2], [3, 4, 5, 6]] * 2
    for got in (on_two[0]["updates"], records):
        assert [u["batch"] for u in got] == [u["batch"] for u in want]
        for g, w in zip(got, want):
            assert_close(g["after"], w["after"], rtol=1e-9)
    assert on_two[0]["recomputed"] == recomputed(tr) == straight[0]["recomputed"]
    assert tr.epoch == on_two[0]["epoch"] == 3


def same_error(folder, name, cls, pattern):
    errors = read(folder, name)
    assert errors[0] == errors[1], errors
    assert errors[0]["type"] == cls, errors[0]
    assert re.search(pattern, errors[0]["message"]), errors[0]


def test_file_errors_reach_every_rank(main_run):
    # /sys refuses new files even to root: the root's write fails
    with pytest.raises(OSError):
        open("/sys/chemtrain_probe.npz", "w")
    for name in ("readonly_checkpoint", "readonly_trajstates"):
        same_error(main_run, name, "CheckpointError", "/sys/chemtrain_.*failed on the root process")
    same_error(main_run, "nan_target", "TrainingError",
               "loss is nan.*state point\\(s\\) \\[2\\].*pair_error_state.npz holds it")
    same_error(main_run, "restore_error_state", "CheckpointError",
               "error_state written after a failure.*for diagnosis, not for resuming")


def test_bad_input_is_an_error_on_every_rank(main_run, tmp_path_factory):
    same_error(main_run, "batch_below_ranks", "ValueError",
               "sim_batch_size=1 is smaller than the number of MPI ranks \\(2\\)")
    same_error(main_run, "jax", "ValueError", "DifftreParallel does not support JAX sharding")
    same_error(main_run, "different_statepoints", "ValueError",
               "disagree on the state points \\(construction.*process 0: .*\"n_statepoints\": 4"
               ".*process 1: .*\"n_statepoints\": 3")
    out = launch(tmp_path_factory, "devices", devices=2)
    for name in ("devices", "devices_auto"):
        errors = read(out, name)
        for rank, e in enumerate(errors):
            assert e["type"] == "RuntimeError", e
            assert f"rank {rank} sees 2 JAX devices" in e["message"]
            assert "CUDA_VISIBLE_DEVICES" in e["message"]


def test_a_failing_rank_ends_or_fails_every_rank(tmp_path):
    rc, out, _ = mp.mpirun(2, [SCRIPT, "--case", "fail", "--out", str(tmp_path)], timeout=300)
    seconds = time.time() - float((tmp_path / "fail_time_1.txt").read_text())
    assert rc != 0
    assert "DONE" not in out
    assert "RuntimeError: injected failure on rank 1 in update 2" in out
    assert 'File "' in out and "in failing" in out  # rank 1's traceback
    assert "raised by process 1 while computing update 2" in out  # what rank 0 reports
    assert seconds < 60, seconds
    # before that, state point 1 overflowed on rank 1: both ranks raised its error
    errors = read(tmp_path, "overflow")
    for rank, e in enumerate(errors):
        assert e["type"] == "NeighborListOverflowError", e
        assert "state point 1" in e["message"] and "max_neighbor_retries=0" in e["message"], e
    assert "raised by process 1" in errors[0]["message"]
