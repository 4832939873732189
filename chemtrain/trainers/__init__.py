"""Trainers: thin stateful shells over the pure functions in chemtrain.learn,
composed of the shared services in :mod:`chemtrain.trainers.services`."""
from .difftre import Difftre, DifftreParallel
from .force_matching import ForceMatching
from .interleave import InterleaveTrainers
from .relative_entropy import RelativeEntropy
from .services import TrainingError
from .state import DifftreState, FMState, RelEntropyState, TrainerState
from .statepoint import StatePoint

__all__ = ["ForceMatching", "Difftre", "DifftreParallel", "RelativeEntropy", "InterleaveTrainers",
           "TrainingError",
           "StatePoint", "TrainerState", "FMState", "DifftreState", "RelEntropyState"]
