"""The strategy contract: every strategy implements every member of the
``Comm`` and ``Sharding`` interfaces, and each member does what its
docstring says, in one process and across two processes (mpirun ranks and
jax.distributed processes)."""
import json
import os

import numpy as np
import pytest

import mp
from contract import exercise, expected
from chemtrain.parallel.base import REQUIRED, Comm, Sharding, Strategy
from chemtrain.parallel.jax_mesh import JaxStrategy
from chemtrain.parallel.mpi import MpiStrategy
from chemtrain.parallel.single import SingleStrategy

CONCRETE = (SingleStrategy, JaxStrategy, MpiStrategy)


def test_required_members_are_the_interfaces_abstract_ones():
    assert set(REQUIRED) == set(Comm.__abstractmethods__) | set(Sharding.__abstractmethods__)
    assert {"host_sum", "local_rows", "select_rows", "abort", "mean_gradient",
            "scatters_from_root"} <= set(REQUIRED)
    assert not hasattr(Strategy, "barrier") and not hasattr(Strategy, "scatter_rows")


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.name)
def test_every_strategy_defines_every_member_itself(cls):
    """No member is inherited: a strategy that leaves one to a default fails."""
    assert cls.name not in ("", "abstract")
    missing = [m for m in REQUIRED if m not in cls.__dict__]
    assert not missing, f"{cls.__name__} inherits {missing}"
    assert not cls.__abstractmethods__


def check(record, n_shards, process_count, rank):
    want = expected(n_shards, process_count, rank)
    for key, value in want.items():
        if key in ("sum", "mean", "mean_gradient", "to_host_sharded", "select_rows"):
            assert np.allclose(record[key], value, rtol=1e-12, atol=0), key
        else:
            assert record[key] == value, key
    if process_count > 1:
        assert "disagree on the rank" in record["check_same"]
        assert "process 1: " in record["check_same"]
        assert "not divisible" in record["check_batch_error"]
    else:
        assert record["check_same"] is None
        assert record["check_batch_error"] is not None


@pytest.mark.parametrize("make", [SingleStrategy, JaxStrategy], ids=["single", "jax-4-devices"])
def test_one_process_contract(make):
    s = make()
    check(exercise(s), s.n_shards, 1, 0)


@pytest.mark.parametrize("launch", ["mpi", "jax"])
def test_two_process_contract(launch, tmp_path):
    """Every member across two processes; then process 1 calls ``abort``
    while process 0 waits in a collective, and both must end, failing."""
    script = os.path.join(mp.HERE, "contract.py")
    args = ["--parallelism", launch, "--out", str(tmp_path)]
    if launch == "mpi":
        rc, out, _ = mp.mpirun(2, [script, *args], timeout=120)
        codes = [rc]
    else:
        codes, out = mp.distributed(2, args, devices=1, timeout=120, script="contract.py")
    for rank in range(2):
        path = tmp_path / f"contract_{rank}.json"
        assert path.exists(), out[-3000:]
        check(json.loads(path.read_text()), 2, 2, rank)
        assert not (tmp_path / f"not_ended_{rank}").exists(), out[-3000:]
    assert all(c != 0 for c in codes), out[-3000:]
    assert "contract: process 1 ends the run" in out, out[-3000:]
