"""What the simulator and energy templates say about themselves, checked
before anything runs.

A simulator template is usually ``functools.partial(simulate.nvt_langevin,
shift_fn=..., dt=..., kT=..., gamma=...)``. jax-md's simulators take
unknown keywords into ``**sim_kwargs`` and ignore them: ``mass=10`` in the
partial (upstream chemtrain's own DiffTRe test does this) leaves every
particle at mass 1, and a misspelled ``gama=`` leaves the default friction.
:func:`simulator_settings` reads the partial's bound arguments so that the
trajectory generator can use ``mass`` and refuse the others, and
:func:`check_time_step` refuses a time step that disagrees with the
timings (a trajectory shorter or longer than declared).
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import jax
import numpy as np


class SimulatorSettings(NamedTuple):
    """``dt`` and ``mass`` bound in a simulator partial (None when not
    bound or not readable), and the name of the simulator."""
    dt: float | None
    mass: object | None
    name: str


def _bound(simulator_template):
    """(name, bound arguments, name of the ** parameter) of a partial, or None."""
    if not isinstance(simulator_template, functools.partial):
        return None
    fn = simulator_template.func
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        sig = inspect.signature(fn)
        bound = sig.bind_partial(None, *simulator_template.args, **simulator_template.keywords)
    except (TypeError, ValueError):
        return None
    var_kw = next((p.name for p in sig.parameters.values()
                   if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    return name, bound.arguments, var_kw


def simulator_settings(simulator_template) -> SimulatorSettings:
    """The time step and mass bound in ``simulator_template`` (a
    ``functools.partial`` of a jax-md simulator).

    Keywords that the simulator does not name land in its ``**sim_kwargs``,
    which jax-md ignores: ``mass`` there is returned (the trajectory
    generator passes it to the simulator's init, where jax-md reads masses),
    any other is refused with a ValueError naming the simulator's own
    parameters."""
    found = _bound(simulator_template)
    if found is None:
        return SimulatorSettings(None, None, type(simulator_template).__name__)
    name, arguments, var_kw = found
    extra = dict(arguments.get(var_kw, {})) if var_kw else {}
    mass = extra.pop("mass", None)
    if extra:
        named = [p for p in inspect.signature(simulator_template.func).parameters
                 if p not in (var_kw,)][1:]
        raise ValueError(
            f"The simulator template passes {sorted(extra)} to {name}, which does not take "
            f"them (they would land in its **{var_kw} and be ignored). Its parameters are "
            f"{named}; per-state-point values such as kT, mass or pressure go in "
            f"state_kwargs.")
    dt = arguments.get("dt")
    try:
        dt = None if dt is None else float(dt)
    except (TypeError, ValueError):
        dt = None
    return SimulatorSettings(dt, mass, name)


def check_time_step(settings: SimulatorSettings, time_step: float) -> None:
    """Refuse a simulator time step that differs from the timings' one: the
    trajectory would cover another time span than ``process_printouts``
    declared (its step counts are computed from ``time_step``)."""
    if settings.dt is None or math.isclose(settings.dt, time_step, rel_tol=1e-9, abs_tol=0.0):
        return
    raise ValueError(
        f"The simulator template integrates with dt={settings.dt:g} ps, but the timings were "
        f"made for time_step={time_step:g} ps (process_printouts(time_step, ...)): every "
        f"trajectory would last {settings.dt / time_step:g} times as long as declared. Use the "
        f"same time step in both.")


def initial_mass(state_kwargs, settings: SimulatorSettings):
    """The mass for the simulator's init: ``state_kwargs['mass']``, else the
    ``mass`` bound in the simulator partial, else 1. Both given and
    different is an error."""
    if "mass" in state_kwargs:
        if settings.mass is not None and not np.array_equal(np.asarray(settings.mass),
                                                            np.asarray(state_kwargs["mass"])):
            raise ValueError(
                f"The mass is given twice, differently: mass={settings.mass!r} in the simulator "
                f"template ({settings.name}) and {np.asarray(state_kwargs['mass']).tolist()!r} "
                f"in state_kwargs. Give it in one place (state_kwargs, per state point).")
        return state_kwargs["mass"]
    return 1.0 if settings.mass is None else settings.mass


def check_energy(energy_fn_template, params, R0, nbrs, **energy_kwargs) -> None:
    """Refuse an energy template that does not give one number per
    configuration: a template returning jax-md's ``(neighbor_fn,
    energy_fn)`` pair, something not callable, or an energy of another
    shape (checked by tracing, nothing is computed)."""
    energy_fn = energy_fn_template(params)
    if isinstance(energy_fn, tuple):
        raise TypeError(
            "energy_fn_template(params) returned a tuple, not an energy function. jax-md's "
            "energy.*_neighbor_list(...) return (neighbor_fn, energy_fn): return only the "
            "energy function, e.g. `return energy.lennard_jones_neighbor_list(...)[1]`, and "
            "pass the neighbor_fn to the trainer.")
    if not callable(energy_fn):
        raise TypeError(f"energy_fn_template(params) must return an energy function "
                        f"energy_fn(R, neighbor, **kwargs), got {type(energy_fn).__name__}.")
    shape = jax.eval_shape(lambda r, nb: energy_fn(r, neighbor=nb, **energy_kwargs), R0, nbrs).shape
    if shape != ():
        raise ValueError(f"The energy function returns an array of shape {shape} for one "
                         f"configuration; it must return the total potential energy, one "
                         f"number (sum per-particle or per-pair energies).")
