"""chemtrain.simulate.restart: the restart policy's ranges. (Restarts of
real overflowing trajectories from their last valid positions are tested
in simulate/test_trajectory.py.)"""
import pytest

from chemtrain.simulate import RestartPolicy


def test_restart_policy_ranges():
    assert RestartPolicy() == RestartPolicy(1.5, 3)
    RestartPolicy(2, 0)
    for bad in (1.0, 0.5, True, "2"):
        with pytest.raises(ValueError, match="capacity_multiplier must be a number larger than 1"):
            RestartPolicy(bad)
    for bad in (-1, 1.5, False):
        with pytest.raises(ValueError, match="max_retries must be a whole number >= 0"):
            RestartPolicy(1.5, bad)
