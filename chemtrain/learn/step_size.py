"""The step-size search of the reweighting loop as pure functions: candidate
scales of an optimizer step, the parameters at a scale, and the choice of the
largest scale that keeps every state point's effective sample size
(:class:`chemtrain.learn.update.StepSizeSearch` is the policy;
:mod:`chemtrain.learn.reweighting` re-exports these)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def step_size_candidates(n: int = 10) -> np.ndarray:
    """Scales of the optimizer's step tried by the search, largest first:
    1, 1/2, 1/4, ... (``n`` values)."""
    if n < 1:
        raise ValueError(f"The step-size search needs at least one candidate, got n={n}.")
    return 0.5 ** np.arange(n)


def scaled_params(params, updates, scale):
    """``params + scale * updates`` (leaf-wise)."""
    return jax.tree.map(lambda p, u: p + jnp.asarray(scale, jnp.result_type(p)) * u,
                        params, updates)


def step_size_violations(n_eff_candidates, n_eff_now, allowed_reduction):
    """Per candidate scale, how many state points would lose too much of
    their effective sample size: ``n_eff_candidates`` has shape
    (state points, candidates), ``n_eff_now`` (state points,). A candidate
    is allowed when ``N_eff(candidate) >= allowed_reduction * N_eff(now)``
    for every state point. Sum these counts over processes before choosing."""
    cand = np.asarray(n_eff_candidates, np.float64).reshape(len(np.atleast_1d(n_eff_now)), -1)
    now = np.asarray(n_eff_now, np.float64).reshape(-1, 1)
    return np.sum(~(cand >= allowed_reduction * now), axis=0).astype(np.int64)


def choose_step_size(candidates, violations) -> tuple[float, bool]:
    """The largest candidate without violations; (scale, found). When every
    candidate violates the bound the smallest is returned with found=False."""
    candidates, violations = np.asarray(candidates), np.asarray(violations)
    order = np.argsort(-candidates)
    for i in order:
        if violations[i] == 0:
            return float(candidates[i]), True
    return float(candidates[order[-1]]), False
