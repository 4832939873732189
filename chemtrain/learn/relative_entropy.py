"""Relative-entropy minimisation as pure functions of one state point.

The relative entropy of the model ensemble p_theta (canonical, NVT, at
beta = 1/kT) from the mapped reference ensemble is

    S_rel(theta) = beta <U_theta>_ref + ln Z_theta + const,

so its gradient is ``beta (<dU/dtheta>_ref - <dU/dtheta>_theta)``. The
model average comes from stored snapshots of a trajectory, reweighted to
theta with the DiffTRe weights of :mod:`chemtrain.learn.difftre`; the
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

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..ensemble import energy_kwargs
from . import difftre as dt


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

        return dt.map_in_chunks(one, R, vmap_batch)
    return energies


def make_loss(energy_fn_template: Callable, vmap_batch: int | None = 10) -> Callable:
    """Return ``loss(params, chains, U_ref, R_batch, nbrs_data, state_kwargs)
    -> (value, aux)`` whose gradient is the relative-entropy gradient of one
    state point: ``chains`` are its trajectories (``(snapshots, nbrs)`` per
    chain, as in :mod:`chemtrain.learn.difftre`), ``U_ref`` their energies
    under the parameters that generated them, ``R_batch`` reference
    configurations and ``nbrs_data`` the neighbor list updated to each of
    them. ``value`` is ``beta (<U>_ref - <U>_theta)``; ``aux`` holds
    ``weights``, ``n_eff``, ``nbr_overflow`` (snapshots), ``data_overflow``
    (per reference frame) and the energies ``U`` (snapshots), all without
    gradient."""
    evaluate = dt.make_snapshot_evaluator(energy_fn_template, None, vmap_batch)
    reference = reference_energies_fn(energy_fn_template, vmap_batch)

    def loss(params, chains, U_ref, R_batch, nbrs_data, state_kwargs):
        beta = 1.0 / state_kwargs["kT"]
        U, _, n_overflow = evaluate(params, chains, state_kwargs)
        U_data, data_overflow = reference(params, R_batch, nbrs_data, state_kwargs)
        weights = jax.lax.stop_gradient(dt.reweighting_weights(U, U_ref, state_kwargs["kT"]))
        value = beta * (jnp.mean(U_data) - jnp.sum(weights * U))
        aux = {"weights": weights, "n_eff": dt.effective_sample_size(weights),
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
    evaluate = dt.make_snapshot_evaluator(energy_fn_template, None, vmap_batch)
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
