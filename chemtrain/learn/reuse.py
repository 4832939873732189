"""When a stored trajectory may be reused by reweighting, and when it must
be recomputed: pure functions of its effective sample size, its number of
decorrelated samples and the parameters' distance from those that sampled
it (:mod:`chemtrain.learn.reweighting` re-exports them).

Three rules, any of which forces a recompute:

- overlap: ``N_eff < reweight_ratio * N`` (upstream chemtrain's rule);
- resolution: the parameters have moved more than ``max_reuse_se`` standard
  errors of the trajectory's own estimate (:func:`reuse_distance`);
- count: the trajectory has served ``max_reuses`` updates after the one it
  was sampled for.

Why the second rule: a trajectory of ``n`` decorrelated samples places its
own optimum of any loss about one standard error (``~ n^-1/2``) from the
true one. An optimiser that keeps reusing it settles there, and Adam's
normalised steps follow that frozen error at full speed, whatever its size.
The overlap rule alone cannot see this: N_eff counts correlated snapshots as
independent, and in a system of few degrees of freedom it stays near N over
parameter changes far larger than the trajectory can resolve.

Why the count: the error of a reused trajectory is the same in every update
that reuses it, so ``k`` reuses act on the optimiser like gradient noise
correlated over ``k`` updates, and multiply the variance that the learning
rate schedule must anneal by about ``k``. Bounded by the resolution rule
alone, ``k`` grows without limit as the steps shrink (a small step moves
little), so a decaying learning rate stops annealing the noise: measured on
the two-bead bond of ``benchmarks/reweighting_known_answers.py``, kb then
wanders by 1.8-4.3 % over the last 200 of 800 updates; with ``max_reuses=4``
by 0.9-1.8 %.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


def statistical_inefficiency(series) -> float:
    """``g = 1 + 2 sum_t rho(t)`` of one time series (e.g. the energies of a
    chain's snapshots in order): how many consecutive snapshots carry the
    information of one independent sample. The autocorrelation ``rho`` is
    summed up to the first lag ``t >= 5 tau`` (Sokal's window), where ``tau``
    is the running sum; 1 for series shorter than 4 or without variance."""
    x = np.asarray(series, np.float64).ravel()
    n = len(x)
    x = x - x.mean()
    if n < 4 or not np.all(np.isfinite(x)) or float(np.dot(x, x)) <= 1e-300:
        return 1.0
    f = np.fft.rfft(x, 2 * n)
    acf = np.fft.irfft(f * np.conj(f))[:n]
    acf /= acf[0]
    tau = 0.5
    for lag in range(1, n):
        tau += acf[lag]
        if lag >= 5 * tau:
            break
    return float(min(max(2.0 * tau, 1.0), n))


def independent_samples(chain_series) -> float:
    """The number of independent samples in a trajectory of several chains:
    ``sum_c n_c / g_c`` over each chain's time series (its energies per
    snapshot), with ``g_c`` the :func:`statistical_inefficiency`."""
    return float(sum(len(np.ravel(s)) / statistical_inefficiency(s) for s in chain_series))


def reuse_distance(n_eff, n_snapshots, n_independent) -> float:
    """How far the parameters have moved from those that sampled a
    trajectory, in standard errors of what the trajectory itself can tell:
    ``sqrt(2 n_independent ln(N / N_eff))``.

    ``ln(N / N_eff)`` of the entropy-based N_eff (:func:`effective_sample_size`)
    is the sample estimate of the Kullback-Leibler divergence of the new
    ensemble from the sampled one, ``KL ~ delta^T F delta / 2`` for a small
    parameter change ``delta`` (``F`` the Fisher information per sample);
    an estimate from ``n_independent`` decorrelated samples has the
    covariance ``F^-1 / n_independent``, so this is the Mahalanobis length
    of ``delta`` in that covariance."""
    n_eff, n = float(n_eff), float(n_snapshots)
    kl = max(math.log(n / n_eff), 0.0) if n_eff > 0 else math.inf
    return math.sqrt(2.0 * float(n_independent) * kl)


def needs_recompute(n_eff, n_snapshots, reweight_ratio, n_independent=None,
                    max_reuse_se=None, reuses=None, max_reuses=None) -> bool:
    """True when a trajectory may not be reused: its snapshots are too
    unevenly weighted (``N_eff < reweight_ratio * N``) or, given
    ``n_independent`` and ``max_reuse_se``, the parameters have moved more
    than ``max_reuse_se`` standard errors of the trajectory's own estimate
    since it was sampled (:func:`reuse_distance`). The second rule stops an
    optimiser from settling on one trajectory's sampling noise: a trajectory
    of ``n_independent`` decorrelated samples places its own optimum about
    one standard error away from the true one. Given ``reuses`` (updates
    that have reused the trajectory so far) and ``max_reuses``, a trajectory
    that has served ``max_reuses`` reuses is recomputed too (see
    :mod:`chemtrain.learn.reuse` on why the count matters)."""
    if float(n_eff) < float(reweight_ratio) * float(n_snapshots):
        return True
    if max_reuses is not None and reuses is not None and int(reuses) >= int(max_reuses):
        return True
    if max_reuse_se is None or n_independent is None:
        return False
    return reuse_distance(n_eff, n_snapshots, n_independent) > float(max_reuse_se)


def check_reuse(reweight_ratio, max_reuse_se, max_reuses) -> None:
    """Range checks of the trajectory-reuse rule's three numbers."""
    if not (isinstance(reweight_ratio, (int, float)) and 0.0 <= reweight_ratio <= 1.0):
        raise ValueError(f"reweight_ratio must be a number in [0, 1] (recompute when "
                         f"N_eff < reweight_ratio * N), got {reweight_ratio!r}.")
    if max_reuse_se is not None and not (
            isinstance(max_reuse_se, (int, float)) and not isinstance(max_reuse_se, bool)
            and 0.0 < max_reuse_se < math.inf):
        raise ValueError(f"max_reuse_se must be a positive number (recompute once the "
                         f"parameters moved that many standard errors of the trajectory's "
                         f"own estimate) or None (only the reweight_ratio rule), got "
                         f"{max_reuse_se!r}.")
    if max_reuses is not None and (isinstance(max_reuses, bool) or not isinstance(
            max_reuses, (int, np.integer)) or max_reuses < 0):
        raise ValueError(f"max_reuses must be a whole number >= 0 (updates a trajectory may "
                         f"serve after the one it was sampled for; 0 recomputes every update) "
                         f"or None (no limit), got {max_reuses!r}.")


MIN_AUTO_POOL, MAX_AUTO_POOL = 4, 20


@dataclasses.dataclass(frozen=True)
class ReuseRule:
    """When the reweighting trainers reuse a state point's trajectories and
    from how many they reweight.

    Attributes:
      reweight_ratio: recompute when N_eff < ratio x N (with a pool, for
        every trajectory of it). :class:`~chemtrain.trainers.Difftre`,
        :class:`~chemtrain.trainers.DifftreParallel` and
        :class:`~chemtrain.trainers.RelativeEntropy` also take it as
        upstream chemtrain's keyword ``reweight_ratio``.
      pool: the number of recent trajectories per state point reweighted
        together (:mod:`chemtrain.learn.pool`); None chooses it from the
        state point's step counts (:meth:`pool_size`): as many as cost
        about half a recompute per update, at most 20, and 1 when that is
        fewer than 4 (few steps per snapshot). Relative entropy uses 1.
      max_reuses: recompute a trajectory that has served this many updates
        after the one it was sampled for (None: no limit).
      max_reuse_se: with one trajectory (a pool of 1), also recompute once
        the parameters have moved more than this many standard errors of
        its own estimate (:func:`reuse_distance`; None: no limit). A pool
        averages that error instead, so it is not applied to pools.

    With a pool, a trajectory is recomputed when no trajectory of the pool
    keeps ``N_eff >= reweight_ratio * N`` under the current parameters or
    by ``max_reuses``; with one, when it loses that overlap, by
    ``max_reuse_se`` or by ``max_reuses`` (:func:`needs_recompute`).
    """

    pool: int | None = None
    max_reuses: int | None = 4
    max_reuse_se: float | None = 0.2
    reweight_ratio: float = 0.9

    def __post_init__(self):
        check_reuse(self.reweight_ratio, self.max_reuse_se, self.max_reuses)
        if self.pool is not None and (isinstance(self.pool, bool) or not isinstance(
                self.pool, (int, np.integer)) or self.pool < 1):
            raise ValueError(f"ReuseRule: pool must be a whole number >= 1 (trajectories per "
                             f"state point reweighted together) or None (chosen from the "
                             f"step counts), got {self.pool!r}.")

    def pool_size(self, timings) -> int:
        """The pool of a state point with these
        :class:`~chemtrain.simulate.Timings`: ``pool``, or when None
        ``total steps // (6 * snapshots)``, at most 20. Reweighting a
        snapshot costs about three energy evaluations (forward pass, then
        forward and backward again in the gradient's second pass) and a
        step one force evaluation, so this many trajectories cost about half
        a recompute per update. Below 4 it is 1, with the resolution rule:
        a pool of 2 or 3 divides a trajectory's error by only 1.4-1.7,
        less than that rule removes (on the bond of
        ``benchmarks/reweighting_problems.py``, whose trajectories give 3,
        kb still moved 2.3 % over the last 200 of 800 updates)."""
        if self.pool is not None:
            return int(self.pool)
        steps = int(timings.n_equilibration_steps) + int(timings.n_production_steps)
        pool = min(MAX_AUTO_POOL, steps // (6 * max(1, int(timings.n_snapshots))))
        return int(pool) if pool >= MIN_AUTO_POOL else 1

    def recompute(self, n_eff, n_snapshots, reweight_ratio, n_independent, reuses,
                  pool: int = 1) -> bool:
        """Whether a state point's trajectory must be recomputed: ``n_eff``
        is its trajectory's N_eff under the current parameters, or with a
        pool (``pool > 1``) the largest N_eff of the pool's trajectories;
        ``n_snapshots`` per trajectory; ``reuses`` of the newest."""
        if pool > 1:
            return needs_recompute(n_eff, n_snapshots, reweight_ratio, reuses=reuses,
                                   max_reuses=self.max_reuses)
        return needs_recompute(n_eff, n_snapshots, reweight_ratio, n_independent,
                               self.max_reuse_se, reuses, self.max_reuses)
