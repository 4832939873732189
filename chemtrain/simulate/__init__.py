"""Trajectories on jax-md: Langevin sampling for labelled data sets, and the
DiffTRe trajectory generator with its neighbor-list overflow restart."""
from .langevin import label_frames, lj_fluid_dataset, sample_langevin
from .restart import RestartPolicy, allocate_with_capacity, restart_state, run_with_restart
from .trajectory import (NeighborListOverflowError, SimulationError, Timings, TrajState,
                         make_trajectory, process_printouts, state_box_kwargs)

__all__ = ["sample_langevin", "label_frames", "lj_fluid_dataset", "Timings", "TrajState",
           "process_printouts", "make_trajectory", "run_with_restart", "RestartPolicy",
           "restart_state", "allocate_with_capacity", "state_box_kwargs", "NeighborListOverflowError",
           "SimulationError"]
