"""chemtrain: training machine-learned interatomic potentials in JAX.

Importing this package is cheap: it imports no MPI module and initialises no
JAX backend. Submodules (``chemtrain.trainers``, ``chemtrain.data``,
``chemtrain.models``, ``chemtrain.parallel``) load on first use.
"""
import importlib
import importlib.util
import os
import sys

__version__ = "0.3.0.dev0"

_SUBMODULES = ("checkpoint", "data", "learn", "models", "neighbors", "parallel", "quantity",
               "simulate", "trainers", "units")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'chemtrain' has no attribute {name!r}")


#: jax-md modules that only jax-md's package ``__init__`` imports, costly at
#: import and unused by most chemtrain processes (see :func:`_defer_jax_md_modules`)
_DEFERRED_JAX_MD = ("rigid_body", "energy", "nn")


def _defer_jax_md_modules():
    """Load some ``jax_md`` modules on first use instead of inside ``import jax_md``.

    jax-md's package ``__init__`` imports every module. ``rigid_body``'s
    module-level shape set-up compiles about 120 small XLA programs (4-7 s),
    and ``energy`` imports ``nn``, which imports e3nn-jax, scipy.signal and
    sympy (about 2 s): seconds of every process that imports jax-md (every
    MPI rank, every script), although no other jax-md module imports them
    and chemtrain uses ``energy`` only for its Lennard-Jones templates. If
    jax-md is not imported yet, this puts a stand-in for each into
    ``sys.modules``; the first attribute read on one runs the real module
    in place, so ``jax_md.energy.lennard_jones_pair`` etc. behave as before.
    """
    if "jax_md" in sys.modules:
        return
    try:
        package = importlib.util.find_spec("jax_md")   # locates it without importing it
    except (ImportError, ValueError):
        return
    if package is None or not package.origin:
        return
    for short in _DEFERRED_JAX_MD:
        name, path = f"jax_md.{short}", os.path.join(os.path.dirname(package.origin), f"{short}.py")
        if name in sys.modules or not os.path.exists(path):
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        module.__getattr__ = _loader(module, spec)
        sys.modules[name] = module


def _loader(module, spec):
    def load_on_first_use(attr):
        module.__dict__.pop("__getattr__", None)
        spec.loader.exec_module(module)
        return getattr(module, attr)
    return load_on_first_use


_defer_jax_md_modules()
