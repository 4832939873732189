"""Trainers: thin stateful shells over the pure functions in chemtrain.learn,
composed of the shared services in :mod:`chemtrain.trainers.services`."""
from .difftre import Difftre, DifftreParallel
from .ensemble import EnsembleOfModels
from .force_matching import ForceMatching
from .interleave import InterleaveTrainers
from .options import RunOptions
from .relative_entropy import RelativeEntropy
from .reweighting import Reweighting
from .errors import TrainingError
from .state import DifftreState, FMState, ReweightingState, TrainerState  # noqa: F401
from ..learn.statepoint import StatePoint  # noqa: F401  (documented as chemtrain.learn.StatePoint)

__all__ = ["ForceMatching", "EnsembleOfModels", "Difftre", "DifftreParallel", "RelativeEntropy", "Reweighting",
           "InterleaveTrainers", "RunOptions",
           "TrainingError",
           "TrainerState", "FMState", "ReweightingState"]
