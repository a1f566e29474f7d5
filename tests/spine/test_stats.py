"""Paired bootstrap against cases worked out by hand and the normal approximation."""

from __future__ import annotations

import numpy as np
import pytest

from calib.stats import bootstrap_mean_ci, paired_bootstrap_diff


def test_identical_scores_give_a_zero_interval():
    a = np.array([1, 0, 1, 1, 0])
    ci = paired_bootstrap_diff(a, a)
    assert (ci.mean, ci.low, ci.high, ci.n) == (0.0, 0.0, 0.0, 5)


def test_constant_difference_is_exact():
    a = np.zeros(10)
    b = np.ones(10)
    ci = paired_bootstrap_diff(a, b)
    assert ci.mean == ci.low == ci.high == 1.0


def test_interval_matches_normal_approximation():
    # d = b - a takes -1 w.p. 0.1, 0 w.p. 0.8, +1 w.p. 0.1 (n = 1000): mean 0, sd = sqrt(0.2)
    d = np.array([-1] * 100 + [0] * 800 + [1] * 100)
    a = np.where(d < 0, 1, 0)
    b = a + d
    ci = paired_bootstrap_diff(a, b, resamples=4000, seed=1)
    half = 1.96 * np.sqrt(0.2 / 1000)
    assert ci.mean == 0.0
    assert ci.low == pytest.approx(-half, abs=0.006) and ci.high == pytest.approx(half, abs=0.006)


def test_pairing_narrows_the_interval():
    rng = np.random.default_rng(0)
    a = (rng.random(400) < 0.5).astype(float)   # hard/easy prompts
    b = a.copy()
    b[:8] = 1 - b[:8]                             # the sparse method flips 8 answers
    paired = paired_bootstrap_diff(a, b)
    unpaired_sd = np.sqrt(a.var() / a.size + b.var() / b.size)
    assert (paired.high - paired.low) < 2 * 1.96 * unpaired_sd / 3


def test_mean_ci_and_bad_shapes():
    ci = bootstrap_mean_ci(np.array([0.5] * 20))
    assert ci.low == ci.high == 0.5
    with pytest.raises(ValueError):
        paired_bootstrap_diff(np.zeros(3), np.zeros(4))
