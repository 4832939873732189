"""chemtrain: training machine-learned interatomic potentials in JAX.

Importing this package is cheap: it imports no MPI module and initialises no
JAX backend. Submodules (``chemtrain.trainers``, ``chemtrain.data``,
``chemtrain.models``, ``chemtrain.parallel``) load on first use.
"""
import importlib

__version__ = "0.3.0.dev0"

_SUBMODULES = ("checkpoint", "data", "learn", "models", "neighbors", "parallel", "quantity",
               "simulate", "trainers", "units")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'chemtrain' has no attribute {name!r}")
