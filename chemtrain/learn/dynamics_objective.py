"""Learning from dynamics as an :class:`~chemtrain.learn.objective.Objective`
(issue 48): targets on dynamic observables (a diffusion coefficient, a
velocity autocorrelation curve), each the reweighted mean over a state
point's stored snapshots of a functional of the NVE segment started from
it (:mod:`chemtrain.learn.dynamics`), optionally with DiffTRe's static
targets (an RDF, a pressure) of the same state point in one loss.

``spec`` (given to :meth:`chemtrain.trainers.Reweighting.add`):

- ``segment``: :func:`chemtrain.learn.dynamics.make_segment` of the
  potential;
- ``functionals``: ``{name: fn(series, dt) -> value}``, the dynamic
  observables (e.g. ``{"D": dynamics.diffusion()}``); a target of each
  name is required;
- ``quantities`` and optionally ``observables``, ``vmap_batch``: DiffTRe's,
  for the static targets (every other target name); none: dynamic targets
  only;
- ``segment_batch``: start states whose segments run at once (default 1;
  tens on an accelerator: :func:`chemtrain.learn.dynamics.make_value_and_grad`).

The targets' specs ``{name: {'gamma': w}}`` weigh each target's squared
error. The loss is the static (DiffTRe) loss plus ``sum gamma x
mean((O - target)^2)`` over the dynamic targets. The objective reweights
one trajectory per state point (no pool): every segment starts from its
newest snapshots.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax

from . import dynamics
from .difftre_objective import (DifftreFunctions, check_first_configuration,
                                difftre_functions, plot_predictions, target_contributions,
                                target_records)
from .objective import Objective
from .update import chains_of, energies_of


@dataclasses.dataclass(frozen=True)
class DynamicsFunctions:
    """The compiled functions of state points that share a segment,
    functionals and static quantities.

    Attributes:
      dynamic: :func:`chemtrain.learn.dynamics.make_value_and_grad`, jitted.
      names: the dynamic targets' names.
      static: DiffTRe's functions of the static targets, or None.
      quantities: the static per-snapshot quantities (checked on a state
        point's first configuration).
    """

    dynamic: Callable
    names: tuple
    static: DifftreFunctions | None = None
    quantities: Mapping = dataclasses.field(default_factory=dict)


def _prepare(fns, spec: Mapping) -> DynamicsFunctions:
    missing = [k for k in ("segment", "functionals", "targets") if k not in spec]
    if missing:
        raise ValueError(f"The dynamics objective's spec needs {missing} (segment: "
                         f"chemtrain.learn.dynamics.make_segment(...), functionals: e.g. "
                         f"{{'D': dynamics.diffusion()}}, targets: {{name: {{'gamma': w}}}}).")
    functionals, targets = dict(spec["functionals"]), dict(spec["targets"])
    absent = [k for k in functionals if k not in targets]
    if absent:
        raise ValueError(f"The dynamic observable(s) {absent} have no target; targets: "
                         f"{sorted(targets)}.")
    gammas = {k: float(targets[k].get("gamma", 1.0)) for k in functionals}
    dynamic = dynamics.make_value_and_grad(fns.energy_fn_template, spec["segment"], functionals,
                                           dynamics.squared_error(gammas),
                                           spec.get("vmap_batch", 10),
                                           spec.get("segment_batch", 1))
    static_targets = {k: v for k, v in targets.items() if k not in functionals}
    static, quantities = None, dict(spec.get("quantities") or {})
    if static_targets:
        static = difftre_functions(fns.energy_fn_template, quantities, static_targets,
                                   spec.get("observables"), None, spec.get("vmap_batch", 10))
    return DynamicsFunctions(jax.jit(dynamic), tuple(functionals), static, quantities)


def _result(sp, params, trajs, derived, inputs):
    f = sp.functions
    names = f.names
    dyn_targets = {k: sp.target_values[k] for k in names}
    (loss, aux), grad = f.dynamic(params, chains_of(trajs), energies_of(trajs), dyn_targets,
                                  sp.state_kwargs)
    parts = dict(aux["parts"])
    predictions = dict(aux["predictions"])
    overflow = aux["nbr_overflow"]
    if f.static is not None:
        static_values = {k: v for k, v in sp.target_values.items() if k not in names}
        fixed, n_fixed = f.static.fixed_values(params, chains_of(trajs), sp.state_kwargs)
        (s_loss, s_aux), s_grad = f.static.loss_and_grad(
            params, chains_of(trajs), energies_of(trajs), static_values, sp.state_kwargs, fixed)
        loss = loss + s_loss
        grad = jax.tree.map(lambda a, b: a + b, grad, s_grad)
        parts.update(s_aux["parts"])
        predictions.update(s_aux["predictions"])
        overflow = overflow + s_aux["nbr_overflow"] + n_fixed
    return {"loss": loss, "grad": grad,
            "aux": {"n_eff": aux["n_eff"], "nbr_overflow": overflow, "parts": parts,
                    "predictions": predictions, "weights": aux["weights"]}}


def dynamics_objective() -> Objective:
    """Learning from dynamics (see the module's docstring for ``spec``):
    per state point the loss of its dynamic (and static) targets, with the
    exact gradient through the start states' weights and the segments (the
    segments' part truncated if the segment was made with
    ``backprop_steps``)."""
    return Objective("dynamics", _result, target_records, prepare=_prepare,
                     contributions=target_contributions,
                     check=lambda sp, params, trajs: check_first_configuration(
                         sp, params, trajs, sp.functions.quantities),
                     plot=plot_predictions)
