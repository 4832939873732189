"""Pure functions under the trainers: predictions, losses, metrics, steps;
optimizer pieces for fine-tuning (a moving average of the weights, a
plateau schedule); the reweighting objectives (DiffTRe, relative entropy,
dynamics) as values, their state points and the step-size policy."""
from .losses import TargetLoss, conditional_huber, huber, squared
from .optimizers import averaged, ema, observe, reduce_on_plateau, update_scale
from .difftre_objective import DifftreFunctions, difftre_functions, difftre_objective
from .dynamics import make_segment
from .dynamics_objective import DynamicsFunctions, dynamics_objective
from .objective import Objective
from .reference_frames import ReferenceFrames
from .relative_entropy import (RelEntropyFunctions, relative_entropy_functions,
                               relative_entropy_objective)
from .statepoint import SimulationFunctions, StatePoint, make_statepoint, simulation_functions
from .reuse import ReuseRule
from .update import StepSizeSearch

__all__ = ["ema", "reduce_on_plateau", "observe", "averaged", "update_scale", "squared",
           "huber", "conditional_huber", "TargetLoss", "Objective", "difftre_objective",
           "relative_entropy_objective", "difftre_functions", "relative_entropy_functions",
           "DifftreFunctions", "RelEntropyFunctions", "StatePoint", "SimulationFunctions",
           "simulation_functions", "make_statepoint", "ReferenceFrames", "StepSizeSearch",
           "ReuseRule", "make_segment", "dynamics_objective", "DynamicsFunctions"]
