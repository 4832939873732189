"""Reweighting from a pool of recent trajectories: the estimator and the pool
as pure functions (:class:`~chemtrain.learn.reuse.ReuseRule` sets its size).

One trajectory of ``n`` decorrelated samples places its own optimum of a
loss about one standard error (``~ n^-1/2``) from the true one; an
optimiser that reuses it settles there. Recomputing every few updates
averages that error away through the optimiser, at the price of a
simulation per update. A pool keeps the last ``K`` trajectories of a state
point and reweights each to the current parameters: each trajectory ``k``
gives its own self-normalised estimate (weights ``softmax(-(U_theta -
U_ref_k) / kT)`` over its snapshots, unbiased as one trajectory's), and the
pool's estimate is their mixture with coefficients ``c_k`` proportional to
each one's effective sample size ``N_eff,k`` under the current parameters
(held constant in the gradient). A stale trajectory thus fades by itself,
the error of the estimate falls as ``(sum_k N_eff,k)^-1/2``, and a
recompute adds a trajectory instead of replacing the only one.

Layout: a pooled chain is one :class:`~chemtrain.simulate.TrajState` whose
``snapshots`` are the ``K`` slots' snapshots one after another (oldest
first, ``K * n``) and whose ``U_ref`` has shape ``(K, n)``; the energies of
all chains are then ``(chains, K, n)`` (:func:`chemtrain.learn.update.energies_of`).
A slot not yet filled repeats the newest trajectory's snapshots with
reference energies ``+inf``: it gets no weight, and every shape stays the
same while the pool fills, so nothing is compiled twice.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def effective_sample_size(weights):
    """N_eff = exp(-sum_i w_i ln w_i) of normalised weights over the last
    axis (N for uniform weights, 1 when one snapshot carries all the
    weight); :mod:`chemtrain.learn.reweighting` re-exports it."""
    w = jnp.asarray(weights)
    safe = jnp.where(w > 0, w, 1.0)
    return jnp.exp(-jnp.sum(jnp.where(w > 0, w * jnp.log(safe), 0.0), axis=-1))


def pooled_weights(U_theta, U_ref, kT):
    """Weights of the snapshots of a pool, in the order of ``U_theta``.

    Args:
      U_theta: energies under the current parameters, flat (``chains * K *
        n``) or shaped like ``U_ref``.
      U_ref: ``(chains, K, n)`` reference energies of the ``K`` slots;
        ``+inf`` (any non-finite value) marks an empty slot.
      kT: the state point's temperature in kJ/mol.

    Returns:
      ``(weights, slot_n_eff)``: weights summing to 1 (flat, chain-major as
      ``U_theta``), the per-slot mixture of self-normalised Boltzmann
      weights (see the module's docstring); and each slot's own effective
      sample size (0 for an empty slot).
    """
    U_ref = jnp.asarray(U_ref)
    C, K, n = U_ref.shape
    U = jnp.reshape(U_theta, (C, K, n))
    filled = jnp.all(jnp.isfinite(U_ref), axis=(0, 2))                 # (K,)
    logits = jnp.where(filled[None, :, None], -(U - jnp.where(jnp.isfinite(U_ref), U_ref, U)) / kT,
                       0.0)
    logits = jnp.moveaxis(logits, 1, 0).reshape(K, C * n)              # slot-major
    own = jax.nn.softmax(logits, axis=-1)                              # per-slot weights
    slot_n_eff = jnp.where(filled, effective_sample_size(own), 0.0)
    c = jax.lax.stop_gradient(slot_n_eff)
    c = c / jnp.sum(c)
    w = (c[:, None] * own).reshape(K, C, n)
    return jnp.moveaxis(w, 0, 1).reshape(-1), slot_n_eff


def pooled_chain(slots, size: int):
    """One chain's pooled :class:`~chemtrain.simulate.TrajState` from its
    trajectories ``slots`` (oldest first, at most ``size``): the newest's
    state and neighbor list, all snapshots one after another, ``U_ref``
    ``(size, n)`` with ``+inf`` in the slots not yet filled (which repeat
    the newest's snapshots)."""
    newest = slots[-1]
    empty = size - len(slots)
    if empty < 0:
        raise ValueError(f"A pool of {size} trajectories was given {len(slots)}.")
    parts = [newest] * empty + list(slots)
    snapshots = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[t.snapshots for t in parts])
    U_ref = jnp.stack([jnp.full_like(newest.U_ref, jnp.inf)] * empty
                      + [jnp.ravel(t.U_ref) for t in slots])
    return newest._replace(snapshots=snapshots, U_ref=U_ref)


def pooled(older: list, newest: list, size: int) -> list:
    """The pooled chains of a state point: ``older`` (a list of earlier
    trajectories, each a list of per-chain states, oldest first) and
    ``newest`` (its current one) in a pool of ``size`` slots; the newest
    alone when ``size`` is 1."""
    if size == 1:
        return newest
    kept = older[-(size - 1):]
    return [pooled_chain([t[c] for t in kept] + [newest[c]], size) for c in range(len(newest))]
