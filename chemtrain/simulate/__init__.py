"""Trajectories on jax-md: Langevin sampling for labelled data sets, and the
DiffTRe trajectory generator with its neighbor-list overflow restart."""
from .langevin import label_frames, lj_fluid_dataset, sample_langevin
from .trajectory import (NeighborListOverflowError, SimulationError, Timings, TrajState,
                         allocate_with_capacity, make_trajectory, process_printouts,
                         restart_state, run_with_restart, state_box_kwargs)

__all__ = ["sample_langevin", "label_frames", "lj_fluid_dataset", "Timings", "TrajState",
           "process_printouts", "make_trajectory", "run_with_restart", "restart_state",
           "allocate_with_capacity", "state_box_kwargs", "NeighborListOverflowError",
           "SimulationError"]
