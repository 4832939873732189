"""Relative-entropy minimisation as pure functions of one state point.

The relative entropy of the model ensemble p_theta (canonical, NVT, at
beta = 1/kT) from the mapped reference ensemble is

    S_rel(theta) = beta <U_theta>_ref + ln Z_theta + const,

so its gradient is ``beta (<dU/dtheta>_ref - <dU/dtheta>_theta)``. The
model average comes from stored snapshots of a trajectory, reweighted to
theta with the DiffTRe weights of :mod:`chemtrain.learn.reweighting`; the
reference average from a batch of reference configurations. Differentiating

    beta mean_b U_theta(R_b) - beta sum_i stop_gradient(w_i) U_theta(R_i)

gives exactly that gradient (:func:`make_loss`).

The change of S_rel between two parameter sets follows from free-energy
perturbation over the same samples (:func:`change`):

    S(new) - S(old) = beta <U_new - U_old>_ref
                      + ln sum_i w_i(old) exp(-beta (U_new_i - U_old_i)),

the second term through a log-sum-exp, so large energy differences neither
overflow nor vanish. Its derivative with respect to ``new`` at ``new ==
old`` is the gradient above, which is what the finite-difference test
checks.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import energy_kwargs, is_npt
from . import reweighting as reweight
from .difftre_objective import check_first_configuration
from .objective import Objective
from .update import chains_of, energies_of, global_norm


def reference_energies_fn(energy_fn_template: Callable, vmap_batch: int | None = 10) -> Callable:
    """Return ``energies(params, R, nbrs0, state_kwargs) -> (U, overflow)``:
    the potential energy of every reference configuration in ``R`` (frames,
    N, dim), each with the neighbor list ``nbrs0`` updated to it, and per
    frame whether that list overflowed (its energy is then invalid: grow
    the list and evaluate again). ``vmap_batch`` frames at once (None:
    all)."""
    def energies(params, R, nbrs0, state_kwargs):
        energy_fn = energy_fn_template(params)
        kw = energy_kwargs(None, state_kwargs)  # fixed box: NVT only

        def one(r):
            nbrs = nbrs0.update(r)
            return energy_fn(r, neighbor=nbrs, **kw), nbrs.did_buffer_overflow

        return reweight.map_in_chunks(one, R, vmap_batch)
    return energies


def make_loss(energy_fn_template: Callable, vmap_batch: int | None = 10) -> Callable:
    """Return ``loss(params, chains, U_ref, R_batch, nbrs_data, state_kwargs)
    -> (value, aux)`` whose gradient is the relative-entropy gradient of one
    state point: ``chains`` are its trajectories (``(snapshots, nbrs)`` per
    chain, as in :mod:`chemtrain.learn.reweighting`), ``U_ref`` their energies
    under the parameters that generated them, ``R_batch`` reference
    configurations and ``nbrs_data`` the neighbor list updated to each of
    them. ``value`` is ``beta (<U>_ref - <U>_theta)``; ``aux`` holds
    ``weights``, ``n_eff``, ``nbr_overflow`` (snapshots), ``data_overflow``
    (per reference frame) and the energies ``U`` (snapshots), all without
    gradient."""
    evaluate = reweight.make_snapshot_evaluator(energy_fn_template, None, vmap_batch)
    reference = reference_energies_fn(energy_fn_template, vmap_batch)

    def loss(params, chains, U_ref, R_batch, nbrs_data, state_kwargs):
        beta = 1.0 / state_kwargs["kT"]
        U, _, n_overflow = evaluate(params, chains, state_kwargs)
        U_data, data_overflow = reference(params, R_batch, nbrs_data, state_kwargs)
        weights = jax.lax.stop_gradient(reweight.reweighting_weights(U, U_ref, state_kwargs["kT"]))
        value = beta * (jnp.mean(U_data) - jnp.sum(weights * U))
        aux = {"weights": weights, "n_eff": reweight.effective_sample_size(weights),
               "nbr_overflow": n_overflow, "data_overflow": data_overflow,
               "U": jax.lax.stop_gradient(U)}
        return value, aux

    return loss


def change(U_old, U_new, U_data_old, U_data_new, weights_old, kT):
    """Estimated ``S_rel(new) - S_rel(old)`` from the energies of the same
    snapshots (``U_*``, with the old parameters' normalised weights
    ``weights_old``) and reference configurations (``U_data_*``) under both
    parameter sets (free-energy perturbation, in a log-sum-exp)."""
    beta = 1.0 / kT
    data = beta * jnp.mean(U_data_new - U_data_old)
    model = jax.scipy.special.logsumexp(-beta * (U_new - U_old), b=weights_old)
    return data + model


def make_change(energy_fn_template: Callable, vmap_batch: int | None = 10) -> Callable:
    """Return ``fn(params_old, params_new, chains, U_old, weights_old,
    R_batch, nbrs_data, state_kwargs) -> (S_rel(new) - S_rel(old),
    data_overflow)``: :func:`change` on the snapshots whose old energies and
    weights :func:`make_loss` gave and on the reference batch ``R_batch``
    (best one drawn independently of the gradient's: a step taken on a batch
    looks better on that batch than it is)."""
    evaluate = reweight.make_snapshot_evaluator(energy_fn_template, None, vmap_batch)
    reference = reference_energies_fn(energy_fn_template, vmap_batch)

    def fn(params_old, params_new, chains, U_old, weights_old, R_batch, nbrs_data, state_kwargs):
        U_new, _, _ = evaluate(params_new, chains, state_kwargs)
        U_data_old, overflow = reference(params_old, R_batch, nbrs_data, state_kwargs)
        U_data_new, _ = reference(params_new, R_batch, nbrs_data, state_kwargs)
        return (change(U_old, U_new, U_data_old, U_data_new, weights_old, state_kwargs["kT"]),
                overflow)

    return fn


def reference_batch_indices(key, n_frames: int, batch_size: int) -> np.ndarray:
    """Rows of one update's reference batch: ``batch_size`` distinct frames
    of ``n_frames``, drawn with ``key`` (all frames, in order, when the
    batch is the whole set)."""
    if batch_size >= n_frames:
        return np.arange(n_frames)
    return np.sort(np.asarray(jax.random.choice(key, n_frames, (batch_size,), replace=False)))


@dataclasses.dataclass(frozen=True)
class RelEntropyFunctions:
    """The compiled relative-entropy functions of state points that share a
    potential (build them with :func:`relative_entropy_functions`).

    Attributes:
      loss_and_grad: :func:`make_loss`'s value and gradient.
      change: :func:`make_change`, the estimated change of the relative
        entropy between two parameter sets.
      reference_energies: :func:`reference_energies_fn` over all frames at
        once.
    """

    loss_and_grad: Callable
    change: Callable
    reference_energies: Callable


def relative_entropy_functions(energy_fn_template: Callable,
                               vmap_batch: int | None = 10) -> RelEntropyFunctions:
    """The compiled relative-entropy functions of a potential.

    Args:
      energy_fn_template: ``params -> energy_fn(R, neighbor, **kwargs)``
        (kJ/mol).
      vmap_batch: snapshots or frames evaluated at once (None: all).

    Returns:
      A :class:`RelEntropyFunctions`, jitted.
    """
    return RelEntropyFunctions(
        jax.jit(jax.value_and_grad(make_loss(energy_fn_template, vmap_batch), has_aux=True)),
        jax.jit(make_change(energy_fn_template, vmap_batch)),
        jax.jit(reference_energies_fn(energy_fn_template, None)))


#: the random streams of the reference batches (0 and 1 are the loop's trajectories)
GRADIENT_STREAM, CHANGE_STREAM = 2, 3


def _no_overflow(sp, overflow) -> None:
    if np.any(np.asarray(overflow)):   # sp.data.nbrs holds every frame: a bug if it does not
        raise RuntimeError(f"State point {sp.name}: the neighbor list of the reference frames "
                           f"overflowed although it was built to hold every frame.")


def _inputs(sp, key):
    """This update's reference batches of ``sp``: one for the gradient and an
    independent one for the change estimate (a step taken on a batch looks
    better on that batch than it is); ``key(stream)`` gives the update's key
    of a random stream."""
    return {name: sp.data.take(reference_batch_indices(key(stream), sp.data.n,
                                                       sp.data.batch_size))
            for name, stream in (("gradient", GRADIENT_STREAM), ("change", CHANGE_STREAM))}


def _result(sp, params, trajs, derived, inputs):
    (value, aux), grad = sp.functions.loss_and_grad(
        params, chains_of(trajs), energies_of(trajs), inputs["gradient"], sp.data.nbrs,
        sp.state_kwargs)
    _no_overflow(sp, aux["data_overflow"])
    return {"loss": value, "aux": dict(aux, predictions={}, parts={}), "grad": grad}


def _contributions(batch, statepoints, results) -> dict:
    return {"grad_norm": np.array([global_norm(results[i]["grad"]) if i in results else 0.0
                                   for i in batch])}


def _after(sp, params, new_params, trajs, result, inputs) -> float:
    """The estimated change of the relative entropy by the applied step."""
    aux, R = result["aux"], inputs["change"]
    value, overflow = sp.functions.change(params, new_params, chains_of(trajs), aux["U"],
                                           aux["weights"], R, sp.data.nbrs, sp.state_kwargs)
    _no_overflow(sp, overflow)
    return float(value)


def _init(sp, params) -> dict:
    return {"s_rel": 0.0}


def _records(states, summed, after, batch, statepoints):
    """The running sum of the change per state point (``s_rel``, its state)
    is the state point's loss; the update's loss is its mean over the
    batch."""
    states, records = list(states), {}
    for j, i in enumerate(batch):
        states[i] = {"s_rel": states[i]["s_rel"] + float(after[j])}
        records[i] = {"loss": states[i]["s_rel"], "delta_s_rel": float(after[j]),
                      "grad_norm": float(summed["grad_norm"][j])}
    return states, float(np.mean([states[i]["s_rel"] for i in batch])), records


def reference_frame_energies(sp, params, chunk: int = 256) -> np.ndarray:
    """The energy under ``params`` of every reference frame of ``sp``, in
    chunks of one compiled size."""
    size = min(chunk, sp.data.n)
    out = []
    for start in range(0, sp.data.n, size):
        rows = np.arange(start, min(start + size, sp.data.n))
        R = sp.data.take(np.concatenate([rows, np.full(size - len(rows), rows[0])]))
        U, overflow = sp.functions.reference_energies(params, R, sp.data.nbrs, sp.state_kwargs)
        _no_overflow(sp, overflow)
        out.append(np.asarray(U, np.float64)[:len(rows)])
    return np.concatenate(out)


def _check(sp, params, trajs) -> None:
    """NVT only, every reference frame at a plausible energy, then DiffTRe's
    first-configuration checks."""
    # the simulator's state: before the first run a trajectory has no
    # snapshots yet (checking those let NPT through, issue 37)
    if is_npt(trajs[0].sim_state):
        raise ValueError(f"State point {sp.name}: RelativeEntropy assumes a fixed box (NVT); the "
                         f"simulator gives NPT states. Use an NVT simulator such as "
                         f"jax_md.simulate.nvt_langevin.")
    check_reference_energies(sp.name, reference_frame_energies(sp, params),
                             float(np.asarray(sp.state_kwargs["kT"])))
    check_first_configuration(sp, params, trajs)


def check_reference_energies(name, U: np.ndarray, kT: float) -> None:
    """Refuse reference frames whose energy under the initial model is not
    finite, or so far above the others (more than 1,000 kT and 50 robust
    standard deviations above the median) that they cannot belong to an
    equilibrium ensemble: one frame with overlapping particles gives a
    gradient that overflows the optimizer's moments, after which training
    silently stops moving (issue 37)."""
    bad = np.flatnonzero(~np.isfinite(U))
    if len(bad):
        raise ValueError(f"State point {name}: the energy of reference frame(s) "
                         f"{bad[:5].tolist()} is {U[bad[0]]}; check that reference_data uses the "
                         f"model's units (nm) and box, and remove broken frames.")
    med = float(np.median(U))
    spread = 1.4826 * float(np.median(np.abs(U - med)))
    high = np.flatnonzero(U - med > max(50.0 * spread, 1000.0 * kT))
    if len(high):
        shown = ", ".join(f"{int(i)} ({U[i]:.4g})" for i in high[:5])
        raise ValueError(f"State point {name}: reference frame(s) {shown} have energies (kJ/mol) "
                         f"far above the others (median {med:.4g}, kT {kT:.4g}): overlapping "
                         f"particles or a broken frame? Such a frame's gradient overflows the "
                         f"optimizer. Remove it from reference_data.")


def plot_history(statepoints, history, predictions, plot_x, path: str) -> None:
    """Three panels over the updates of ``history``: each state point's
    relative-entropy change, the norm of the mean gradient, N_eff / N."""
    from matplotlib.figure import Figure
    if not history:
        raise RuntimeError("Nothing to plot yet: train first.")
    fig = Figure(figsize=(12.0, 3.2), constrained_layout=True)
    ax_s, ax_g, ax_n = fig.subplots(1, 3)
    by_sp: dict = {}
    for epoch in history:
        for r in epoch["statepoints"]:
            by_sp.setdefault(r["statepoint"], []).append(r)
    for i, rows in sorted(by_sp.items()):
        x = [r["update"] for r in rows]
        ax_s.plot(x, [r["loss"] for r in rows], label=f"state point {i}")
        ax_n.plot(x, [r["n_eff"] / r["n_snapshots"] for r in rows], label=f"state point {i}")
    norms = [n for epoch in history for n in epoch.get("grad_norms", [])]
    ax_g.semilogy(range(len(norms)), norms)
    for ax, label in ((ax_s, "S_rel - S_rel(initial)"), (ax_g, "gradient norm"),
                      (ax_n, "N_eff / N")):
        ax.set_xlabel("update")
        ax.set_ylabel(label)
    ax_s.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def relative_entropy_objective() -> Objective:
    """Relative entropy's :class:`~chemtrain.learn.objective.Objective`: per
    state point the gradient ``beta (<dU/dtheta>_ref - <dU/dtheta>_theta)``
    from its stored snapshots and a batch of its reference frames
    (``sp.data``, a :class:`~chemtrain.learn.reference_frames.ReferenceFrames`),
    and after each step the change of the relative entropy estimated on an
    independent batch, whose running sum (``s_rel``) is the state point's
    loss. Its ``spec`` is ``{"vmap_batch": n}``, from which it prepares
    :func:`relative_entropy_functions`."""
    return Objective("relative entropy", _result, _records,
                     prepare=lambda fns, spec: relative_entropy_functions(
                         fns.energy_fn_template, (spec or {}).get("vmap_batch", 10)),
                     init=_init, contributions=_contributions, inputs=_inputs, after=_after,
                     check=_check, plot=plot_history)
