"""Trainers: thin stateful shells over the pure functions in chemtrain.learn."""
from .force_matching import ForceMatching, TrainingError

__all__ = ["ForceMatching", "TrainingError"]
