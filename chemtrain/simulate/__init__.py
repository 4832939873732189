"""Trajectories on jax-md."""
from .langevin import label_frames, lj_fluid_dataset, sample_langevin

__all__ = ["sample_langevin", "label_frames", "lj_fluid_dataset"]
