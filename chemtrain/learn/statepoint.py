"""A state point of the reweighting trainers (DiffTRe, relative entropy):
what is fixed about it (:class:`StatePoint`) and the compiled functions of
its simulation (:class:`SimulationFunctions`). Both are frozen values,
built once when the state point is added: nothing here is compiled or
changed later (jax.jit compiles on the first call, as everywhere)."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..checksum import crc
from ..simulate.trajectory import make_trajectory
from ..units import BOLTZMANN_KJ_PER_MOL_K
from . import reweighting as reweight

#: kT above this (kJ/mol, about 3,000 K) is warned about: likely a temperature in kelvin
KT_PLAUSIBLE = 25.0


@dataclasses.dataclass(frozen=True)
class SimulationFunctions:
    """The compiled functions of state points that share a potential,
    simulator and neighbor list (build them with
    :func:`simulation_functions`).

    Attributes:
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``
        (kJ/mol).
      neighbor_fn: the jax-md neighbor-list functions of the simulation.
      init_fn, run_fn: the trajectory pair of
        :func:`chemtrain.simulate.make_trajectory`.
      energy: ``(params, R, nbrs, kwargs) -> U`` of one configuration, jitted.
      n_eff_candidates: ``(params, updates, scales, chains, U_ref,
        state_kwargs) -> N_eff`` per scaled step (the step-size search).
      timings: the :class:`~chemtrain.simulate.Timings` of one trajectory
        (they size a pool: :meth:`chemtrain.learn.reuse.ReuseRule.pool_size`).
    """

    energy_fn_template: Callable
    neighbor_fn: Any
    init_fn: Callable
    run_fn: Callable
    energy: Callable
    n_eff_candidates: Callable
    timings: Any = None


def simulation_functions(energy_fn_template, simulator_template, neighbor_fn, timings,
                         vmap_batch: int | None) -> SimulationFunctions:
    """The compiled simulation functions of state points that share them.

    Args:
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``
        (kJ/mol).
      simulator_template: ``energy_fn -> (init, apply)``, a partial of a
        jax-md simulator.
      neighbor_fn: jax-md neighbor-list functions.
      timings: :func:`chemtrain.simulate.process_printouts` of one trajectory.
      vmap_batch: snapshots evaluated at once in the step-size search (None:
        all).

    Returns:
      A :class:`SimulationFunctions` (an objective prepares its own
      functions from it: :attr:`chemtrain.learn.Objective.prepare`).

    Raises:
      ValueError: ``vmap_batch`` is neither None nor a positive whole number;
        the errors of :func:`chemtrain.simulate.make_trajectory`.
    """
    if vmap_batch is not None and (isinstance(vmap_batch, bool) or not isinstance(
            vmap_batch, (int, np.integer)) or vmap_batch < 1):
        raise ValueError(f"vmap_batch must be a positive whole number (snapshots evaluated "
                         f"at once) or None (all at once), got {vmap_batch!r}.")
    init_fn, run_fn = make_trajectory(simulator_template, energy_fn_template, neighbor_fn,
                                      timings)
    n_eff = reweight.make_neff_fn(energy_fn_template, vmap_batch)

    def candidates(params, updates, scales, chains, U_ref, state_kwargs):
        return jax.lax.map(lambda a: n_eff(reweight.scaled_params(params, updates, a), chains,
                                           U_ref, state_kwargs), scales)
    return SimulationFunctions(
        energy_fn_template, neighbor_fn, init_fn, run_fn,
        jax.jit(lambda p, R, nbrs, kw: energy_fn_template(p)(R, neighbor=nbrs, **kw)),
        jax.jit(candidates), timings=timings)


@dataclasses.dataclass(frozen=True)
class StatePoint:
    """Everything fixed about one state point of a DiffTRe or relative-entropy trainer.

    A frozen dataclass that trainers build when a state point is added
    (``add_statepoint``, or :class:`DifftreParallel`'s constructor); what
    changes during training (trajectories, predictions) is kept by the
    trainer. Units are chemtrain's: nm, kJ/mol, ps, amu.

    Attributes:
      index: the state point's position in the trainer's ``statepoints``.
      name: its name in messages (by default ``str(index)``).
      fns: the compiled functions it shares with state points of the same
        potential, simulator and objective (:class:`SimulationFunctions`).
      state_kwargs: keyword arguments of the simulator and energy function,
        as jnp arrays: ``kT`` (thermal energy, kJ/mol) always; ``mass``
        (amu), ``box`` (nm), ``pressure`` (kJ/mol/nm^3, NPT) and per-atom
        inputs such as ``species`` where used.
      reference: the reference positions of its chains, (chains, N, dim), nm.
      targets: the target specs, ``{name: {'gamma': weight, 'loss_fn':
        optional fn(pred, target)}}`` (empty for relative entropy).
      target_values: ``{name: target array}``, as jnp arrays.
      n_snapshots: the number of snapshots of all its chains together.
      data: what a trainer learns from besides the targets (relative
        entropy: its reference configurations); None for DiffTRe.
      functions: the objective's compiled functions of this state point,
        as its :attr:`~chemtrain.learn.Objective.prepare` made them (shared
        by state points added alike), or None.
    """

    index: int
    name: str
    fns: SimulationFunctions
    state_kwargs: dict
    reference: Any
    targets: dict
    target_values: dict
    n_snapshots: int
    data: Any = None
    functions: Any = None

    init_fn = property(lambda self: self.fns.init_fn)
    run_fn = property(lambda self: self.fns.run_fn)
    neighbor_fn = property(lambda self: self.fns.neighbor_fn)


def make_statepoint(index: int, fns: SimulationFunctions, state_kwargs, reference, targets,
                    target_values, n_snapshots: int, name: str | None = None,
                    data=None, functions=None) -> StatePoint:
    """A state point, checked.

    Args:
      index: its position in the trainer's ``statepoints``.
      fns: its :class:`SimulationFunctions`.
      state_kwargs: the simulator's and energy function's keyword arguments;
        ``kT`` (kJ/mol) required.
      reference: the reference positions, (N, dim) or (chains, N, dim), nm.
      targets: target specs (empty for relative entropy).
      target_values: ``{name: target array}``.
      n_snapshots: snapshots per chain.
      name: its name in messages (None: ``str(index)``).
      data: what the objective learns from besides targets, or None.
      functions: the objective's prepared functions, or None.

    Returns:
      The frozen :class:`StatePoint`; ``n_snapshots`` counts all chains.

    Raises:
      ValueError: ``kT`` missing, not one positive finite number, or
        reference positions of another shape; the model's own check of its
        inputs (e.g. MACE's species).
      TypeError: reference positions not floating point, or float32 under
        ``jax_enable_x64``.
    """
    if "kT" not in state_kwargs:
        raise ValueError(f"State point {index}: state_kwargs must contain 'kT' (thermal energy "
                         f"in kJ/mol, e.g. chemtrain.units.kT(300.0)); got keys "
                         f"{sorted(state_kwargs)}.")
    try:
        kT = np.asarray(state_kwargs["kT"], dtype=float)
    except (TypeError, ValueError):
        kT = None
    if kT is None or kT.size != 1 or not (np.isfinite(kT).all() and (kT > 0).all()):
        raise ValueError(f"State point {index}: state_kwargs['kT'] must be one positive, finite "
                         f"number (the thermal energy in kJ/mol, e.g. chemtrain.units.kT(300.0) "
                         f"= 2.494), got {state_kwargs['kT']!r}.")
    if float(kT.ravel()[0]) > KT_PLAUSIBLE:
        kelvin = float(kT.ravel()[0]) / BOLTZMANN_KJ_PER_MOL_K
        warnings.warn(f"State point {index}: kT = {float(kT.ravel()[0]):g} kJ/mol is "
                      f"{kelvin:,.0f} K. kT is the thermal energy in kJ/mol, not a temperature: "
                      f"for {float(kT.ravel()[0]):g} K pass chemtrain.units.kT("
                      f"{float(kT.ravel()[0]):g}) = "
                      f"{float(kT.ravel()[0]) * BOLTZMANN_KJ_PER_MOL_K:.4g}.", UserWarning,
                      stacklevel=3)
    reference = jnp.asarray(reference)
    if not jnp.issubdtype(reference.dtype, jnp.floating):
        raise TypeError(f"State point {index}: the reference positions must be floating point, "
                        f"got {reference.dtype}.")
    if jax.config.jax_enable_x64 and reference.dtype != jnp.float64:
        raise TypeError(f"State point {index}: the reference positions are {reference.dtype}, but "
                        f"JAX runs in float64 (jax_enable_x64), where jax-md's simulators need "
                        f"float64 positions. Pass np.asarray(positions, np.float64).")
    if reference.ndim == 2:
        reference = reference[None]
    if reference.ndim != 3:
        raise ValueError(f"State point {index}: the reference state must be positions of shape "
                         f"(N, dim) or (chains, N, dim), got shape {reference.shape}.")
    check_model_inputs(index, fns.energy_fn_template, state_kwargs, reference)
    return StatePoint(index, name if name is not None else f"{index}", fns,
                      {k: jnp.asarray(v) for k, v in state_kwargs.items()}, reference, targets,
                      {k: jnp.asarray(v) for k, v in target_values.items()},
                      n_snapshots * reference.shape[0], data, functions)  # all chains


def check_model_inputs(index: int, energy_fn_template, state_kwargs, reference) -> None:
    """The model's own check of what the simulation will give it (e.g.
    MACE: ``species`` known to it), as for a force-matching dataset, with
    the state point named and where per-atom inputs go."""
    validate = getattr(energy_fn_template, "validate_dataset", None)
    if validate is None:
        return
    per_atom = {}
    for k in ("species", "mask"):
        if k in state_kwargs:
            value = np.asarray(state_kwargs[k])
            try:
                per_atom[k] = np.broadcast_to(value, reference.shape[:2])
            except ValueError:
                n = reference.shape[1]
                raise ValueError(f"State point {index}: state_kwargs[{k!r}] has shape "
                                 f"{value.shape}, but the reference state has {n} particles; "
                                 f"give one value per particle, shape ({n},).") from None
    try:
        validate({"R": np.asarray(reference), **per_atom})
    except ValueError as e:
        text = (f"State point {index}: {e} In DiffTRe and relative entropy, per-atom inputs of "
                f"the energy function (species, mask) come in state_kwargs, one row (N,) per "
                f"state point.")
        try:
            error = type(e)(text)          # keep the model's error class where it allows
        except TypeError:
            error = ValueError(text)
        raise error from None


def fingerprint(statepoints) -> tuple[list, int]:
    """(shapes, checksum) of the state points' ``state_kwargs``, reference
    states, targets and data (arrays, or an object's ``fingerprint()``):
    equal on processes that were given the same."""
    total, shapes = 0, []
    for sp in statepoints:
        arrays = [*(sp.state_kwargs[k] for k in sorted(sp.state_kwargs)), sp.reference,
                  *(sp.target_values[k] for k in sorted(sp.target_values))]
        if sp.data is not None:
            arrays.append(sp.data.fingerprint() if hasattr(sp.data, "fingerprint") else sp.data)
        shapes.append([list(np.shape(a)) for a in arrays])
        total = crc(*arrays, start=total)
    return shapes, total


def check_plot_x(plot_x, sp: StatePoint) -> None:
    """``plot_x`` (target name -> x values of its plot) must name targets of
    ``sp`` and give one x per target value."""
    for key, x in plot_x.items():
        if key not in sp.targets:
            raise ValueError(f"plot_x names {key!r}, which is not a target; targets: "
                             f"{sorted(sp.targets)}.")
        if np.size(x) != np.size(sp.target_values[key]):
            raise ValueError(f"plot_x[{key!r}] has {np.size(x)} values, but the target {key!r} "
                             f"has {np.size(sp.target_values[key])} (one x per value, e.g. the "
                             f"RDF's bin_centers).")


def statepoint_inputs(state_kwargs, reference_state):
    """``add_statepoint``'s ``state_kwargs`` as a dict (a number is kT) and
    its ``reference_state`` as positions (upstream's ``(simulator_state,
    nbrs)`` gives its positions)."""
    if isinstance(state_kwargs, (int, float, np.floating)):
        state_kwargs = {"kT": float(state_kwargs)}
    if not isinstance(state_kwargs, Mapping):
        raise TypeError(f"state_kwargs must be a dict (with 'kT') or the number kT, got "
                        f"{type(state_kwargs).__name__}.")
    if isinstance(reference_state, tuple) and hasattr(reference_state[0], "position"):
        reference_state = reference_state[0].position
    return state_kwargs, reference_state
