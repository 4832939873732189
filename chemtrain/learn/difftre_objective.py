"""DiffTRe as an :class:`~chemtrain.learn.objective.Objective`: the loss of
observables reweighted from stored trajectories to the current parameters
(Thaler & Zavadlav 2021), per state point.

:func:`difftre_functions` builds a state point's compiled functions once:
the loss and gradient (:func:`chemtrain.learn.difftre_grad.make_value_and_grad`)
and the evaluation of the quantities that ignore the potential (RDF, ADF,
density), which the loop computes once per trajectory (``derive``). Which
quantities those are is found while the functions are traced
(:func:`chemtrain.learn.reweighting.potential_dependent`), so nothing is decided
or compiled before the first trajectory exists and nothing changes after.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..models.template import check_reach
from . import reweighting as reweight
from .difftre_checks import check_reference_span, check_statepoint
from .difftre_grad import make_value_and_grad
from .update import chains_of, energies_of
from .objective import Objective


@dataclasses.dataclass(frozen=True)
class DifftreFunctions:
    """The compiled DiffTRe functions of state points that share a potential,
    quantities, targets and observables.

    Attributes:
      loss_and_grad: ``(params, chains, U_ref, target_values, state_kwargs,
        fixed_values) -> ((loss, aux), grad)``.
      fixed_values: ``(params, chains, state_kwargs) -> (values,
        n_overflow)``: the quantities that ignore the potential.
      quantities: the per-snapshot quantities (checked on a state point's
        first configuration and named in diagnoses).
    """

    loss_and_grad: Callable
    fixed_values: Callable
    quantities: Mapping = dataclasses.field(default_factory=dict)


def difftre_functions(energy_fn_template: Callable, quantities: Mapping, targets: Mapping,
                      observables: Mapping | None, loss_fn: Callable | None,
                      vmap_batch: int | None) -> DifftreFunctions:
    """The compiled DiffTRe functions of state points that share them.

    Args:
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``
        (kJ/mol).
      quantities: ``{name: fn(state, neighbor=, energy_fn=, **state_kwargs)}``
        per snapshot.
      targets: the target specs, ``{name: {'gamma': w, 'loss_fn': optional
        fn(pred, target)}}`` (without the target values).
      observables: ``{name: fn(quantity_trajs, weights)}``, or None (a
        target named like a quantity is its weighted mean).
      loss_fn: ``fn(predictions, targets) -> loss`` replacing the
        gamma-weighted sum, or None.
      vmap_batch: snapshots evaluated at once (None: all).

    Returns:
      A :class:`DifftreFunctions`, jitted; which quantities ignore the
      potential is found when they are traced.

    Raises:
      ValueError: a target has neither an observable nor a quantity of its
        name.
    """
    quantities = dict(quantities)
    reweight.resolve_observables(targets, quantities, observables, require_values=False)

    def fixed_names(chains, state_kwargs):
        snapshots, nbrs = chains[0]
        first = jax.tree.map(lambda x: x[0], snapshots)
        dependent = reweight.potential_dependent(quantities, first, nbrs, state_kwargs)
        return tuple(k for k in quantities if k not in dependent)

    def fixed_values(params, chains, state_kwargs):
        fixed = fixed_names(chains, state_kwargs)
        evaluate = reweight.make_snapshot_evaluator(None, {k: quantities[k] for k in fixed},
                                              vmap_batch)
        _, values, n_overflow = evaluate(params, chains, state_kwargs)
        return values, n_overflow

    def loss_and_grad(params, chains, U_ref, target_values, state_kwargs, fixed):
        # two passes: peak memory grows with vmap_batch, not with the snapshots
        value_and_grad = make_value_and_grad(
            energy_fn_template, quantities, targets, observables, loss_fn, vmap_batch,
            fixed=tuple(k for k in quantities if k in fixed))
        return value_and_grad(params, chains, U_ref, target_values, state_kwargs, fixed)

    return DifftreFunctions(jax.jit(loss_and_grad), jax.jit(fixed_values), quantities)


def _prepare(fns, spec: Mapping) -> DifftreFunctions:
    """DiffTRe's functions of state points with simulation functions ``fns``
    and ``spec`` = ``{quantities, targets, observables, loss_fn,
    vmap_batch}`` (the arguments of :func:`difftre_functions` after the
    energy template)."""
    return difftre_functions(fns.energy_fn_template, spec["quantities"], spec["targets"],
                             spec.get("observables"), spec.get("loss_fn"),
                             spec.get("vmap_batch"))


def fixed_quantities(sp, params, trajs):
    """``(values, n_overflow)``: the quantities of state point ``sp`` that
    ignore the potential, evaluated on ``trajs``, and how often their
    neighbor lists overflowed. Valid until the trajectories change."""
    return sp.functions.fixed_values(params, chains_of(trajs), sp.state_kwargs)


def pooled_fixed_quantities(sp, parts, size):
    """:func:`fixed_quantities` of a pool of ``size`` slots from those of
    its trajectories (``parts``, oldest first), laid out as
    :func:`chemtrain.learn.pool.pooled_chain` lays out the snapshots: per
    chain, the empty slots (the newest's again) then each slot in order."""
    slots = [parts[-1]] * (size - len(parts)) + list(parts)
    chains = sp.reference.shape[0]

    def join(*values):
        per_chain = [v.reshape(chains, -1, *v.shape[1:]) for v in values]
        return jnp.concatenate(per_chain, axis=1).reshape(-1, *values[0].shape[1:])
    return jax.tree.map(join, *[p[0] for p in slots]), sum(p[1] for p in slots)


def loss_and_grad(sp, params, trajs, fixed=None):
    """``(loss, aux), grad`` of state point ``sp`` reweighted from ``trajs``
    (one :class:`~chemtrain.simulate.TrajState` per chain) to ``params``.
    ``aux`` holds ``n_eff``, ``parts``, ``predictions``, ``weights`` and
    ``nbr_overflow``; ``fixed`` is :func:`fixed_quantities` of the same
    trajectories (computed here when None)."""
    values, n_overflow = fixed_quantities(sp, params, trajs) if fixed is None else fixed
    (loss, aux), grad = sp.functions.loss_and_grad(
        params, chains_of(trajs), energies_of(trajs), sp.target_values, sp.state_kwargs, values)
    return (loss, dict(aux, nbr_overflow=aux["nbr_overflow"] + n_overflow)), grad


def _result(sp, params, trajs, derived, inputs):
    (loss, aux), grad = loss_and_grad(sp, params, trajs, derived)
    return {"loss": loss, "aux": aux, "grad": grad}


def target_contributions(batch: Sequence[int], statepoints, results) -> dict:
    """Per state point, the loss parts (NaN without a part, e.g. under a
    custom ``loss_fn``) and the predictions."""
    names = list(statepoints[batch[0]].targets)
    out = {"parts": {k: np.zeros(len(batch)) for k in names}}
    out["pred"] = [{k: np.zeros(np.shape(statepoints[i].target_values[k])) for k in names}
                   for i in batch]
    for j, i in enumerate(batch):
        if i in results:
            aux = results[i]["aux"]
            for k in names:
                out["parts"][k][j] = aux["parts"].get(k, np.nan)
                out["pred"][j][k] = np.asarray(aux["predictions"][k]).reshape(
                    out["pred"][j][k].shape)
    return out


def target_records(states, summed, after, batch, statepoints):
    """State point -> its loss parts, predictions and targets; the update's
    loss is the batch mean."""
    names = list(statepoints[batch[0]].targets)
    records = {}
    for j, i in enumerate(batch):
        sp, pred = statepoints[i], summed["pred"][j]
        records[i] = {"parts": {k: float(summed["parts"][k][j]) for k in names
                                if not np.isnan(summed["parts"][k][j])},  # none with loss_fn
                      "predictions": {k: pred[k].tolist() for k in names},
                      "targets": {k: np.asarray(sp.target_values[k]).tolist() for k in names}}
    return states, float(np.sum(summed["loss"]) / len(batch)), records


def check_first_configuration(sp, params, trajs, quantities=None) -> None:
    """Refuse a state point on its first configuration: a reference state in
    other units than the box, a neighbor list shorter than the model's
    range, and the checks of :func:`chemtrain.learn.difftre_checks.check_statepoint`."""
    check_reference_span(sp, trajs[0].nbrs)
    check_reach(sp.fns.energy_fn_template, trajs[0].nbrs, f"State point {sp.name}",
                periodic_box="box" in sp.state_kwargs)
    check_statepoint(sp, params, trajs[0], quantities or {})


def plot_predictions(statepoints, history, predictions: dict, plot_x: dict, path: str) -> None:
    """Latest ``predictions`` (state point -> observables) against the
    targets of ``statepoints``: one row per state point, one panel per
    target (a curve for arrays, x from ``plot_x``; two bars for scalars)."""
    from matplotlib.figure import Figure
    if not predictions:
        raise RuntimeError("Nothing to plot yet: train first.")
    rows = sorted(predictions)
    names = list(statepoints[rows[0]].targets)
    fig = Figure(figsize=(4.0 * len(names), 2.8 * len(rows)), constrained_layout=True)
    axes = np.asarray(fig.subplots(len(rows), len(names), squeeze=False))
    for r, i in enumerate(rows):
        sp = statepoints[i]
        for c, name in enumerate(names):
            ax, pred = axes[r, c], np.asarray(predictions[i][name])
            target = np.asarray(sp.target_values[name])
            if pred.size > 1:
                x = np.asarray(plot_x.get(name, np.arange(pred.size)))
                ax.plot(x, target.ravel(), "k--", label="target")
                ax.plot(x, pred.ravel(), "C0-", label="predicted")
                ax.legend(fontsize=7)
            else:
                ax.bar([0, 1], [float(target), float(pred)], color=["0.5", "C0"])
                ax.set_xticks([0, 1], ["target", "predicted"])
            kT = float(np.ravel(np.asarray(sp.state_kwargs["kT"]))[0])
            ax.set_title(f"state point {sp.name} (kT={kT:.3g}): {name}", fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def difftre_objective() -> Objective:
    """DiffTRe's :class:`~chemtrain.learn.objective.Objective`: per state
    point the target loss of its reweighted observables; the update's loss
    is the mean over the batch's state points, reweighted from a pool of
    recent trajectories (:mod:`chemtrain.learn.pool`). Its ``spec`` (given
    to :meth:`~chemtrain.trainers.Reweighting.add`) is ``{quantities,
    targets, observables, loss_fn, vmap_batch}``, from which it prepares
    :func:`difftre_functions`."""
    return Objective("DiffTRe", _result, target_records, prepare=_prepare,
                     contributions=target_contributions, derive=fixed_quantities,
                     derive_pool=pooled_fixed_quantities,
                     check=lambda sp, params, trajs: check_first_configuration(
                         sp, params, trajs, sp.functions.quantities),
                     plot=plot_predictions, pools=True)
