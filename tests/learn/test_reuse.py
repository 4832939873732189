"""chemtrain.learn.reuse: the statistical inefficiency against a process
whose value is known in closed form, the reuse distance against the exact
Kullback-Leibler divergence of two Gaussians, and the recompute rules."""
import math

import numpy as np
import pytest

from chemtrain.learn import reweighting as dt
from chemtrain.learn import reuse


def ar1(phi, n, seed):
    rng = np.random.default_rng(seed)
    x = np.zeros(n)
    noise = rng.normal(size=n)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + noise[i]
    return x


@pytest.mark.parametrize("phi", [0.5, 0.9])
def test_statistical_inefficiency_of_an_ar1_process(phi):
    # g = 1 + 2 sum_t phi^t = (1 + phi) / (1 - phi) for x_t = phi x_(t-1) + noise
    g = reuse.statistical_inefficiency(ar1(phi, 200_000, 1))
    assert abs(g / ((1 + phi) / (1 - phi)) - 1) < 0.1, g


def test_statistical_inefficiency_edge_cases():
    rng = np.random.default_rng(0)
    assert reuse.statistical_inefficiency(rng.normal(size=20_000)) == pytest.approx(1.0, abs=0.1)
    assert reuse.statistical_inefficiency(np.full(50, 3.0)) == 1.0   # no variance
    assert reuse.statistical_inefficiency([1.0, 2.0, 3.0]) == 1.0   # too short
    assert reuse.statistical_inefficiency(np.ones(100) * np.nan) == 1.0
    # never more than the series' length
    assert reuse.statistical_inefficiency(np.linspace(0, 1, 40)) <= 40


def test_independent_samples_sum_over_chains():
    a, b = ar1(0.9, 50_000, 2), np.random.default_rng(3).normal(size=10_000)
    n = reuse.independent_samples([a, b])
    assert abs(n - (50_000 / 19 + 10_000)) < 0.05 * (50_000 / 19 + 10_000), n
    assert dt.independent_samples is reuse.independent_samples   # re-exported


@pytest.mark.parametrize("a", [0.8, 0.95, 1.1])
def test_reuse_distance_is_the_kl_divergence_in_standard_errors(a):
    # snapshots x ~ N(0, 1) reweighted to N(0, 1/a): w ~ exp(-(a - 1) x^2 / 2)
    x = np.random.default_rng(4).normal(size=400_000)
    log_w = -(a - 1) * x ** 2 / 2
    w = np.exp(log_w - log_w.max())
    w /= w.sum()
    n_eff = float(dt.effective_sample_size(w))
    kl = 0.5 * (1 / a - 1 + math.log(a))   # KL(N(0, 1/a) || N(0, 1))
    n_indep = 150.0
    got = reuse.reuse_distance(n_eff, len(x), n_indep)
    assert abs(got / math.sqrt(2 * n_indep * kl) - 1) < 0.02, (got, kl)


def test_needs_recompute_rules():
    # overlap rule alone (issue 31's "before")
    assert dt.needs_recompute(89.0, 100, 0.9) and not dt.needs_recompute(91.0, 100, 0.9)
    # resolution rule: N_eff 99.9 of 100 is a distance sqrt(2 * 200 * ln(100/99.9)) = 0.63
    d = math.sqrt(2 * 200 * math.log(100 / 99.9))
    assert reuse.reuse_distance(99.9, 100, 200) == pytest.approx(d)
    assert dt.needs_recompute(99.9, 100, 0.9, n_independent=200, max_reuse_se=0.5)
    assert not dt.needs_recompute(99.9, 100, 0.9, n_independent=200, max_reuse_se=0.7)
    assert not dt.needs_recompute(99.9, 100, 0.9, n_independent=200, max_reuse_se=None)
    # fewer decorrelated samples resolve less, so the same N_eff may be reused
    assert not dt.needs_recompute(99.9, 100, 0.9, n_independent=50, max_reuse_se=0.5)
    assert reuse.reuse_distance(100.0, 100, 200) == 0.0
    assert reuse.reuse_distance(0.0, 100, 200) == math.inf
