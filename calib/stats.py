"""Small statistics used by evaluation: paired bootstrap CI of an accuracy difference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DiffCI:
    """``mean`` of (b - a) over paired items and its percentile-bootstrap ``(low, high)`` interval."""

    mean: float
    low: float
    high: float
    n: int


def paired_bootstrap_diff(a: np.ndarray, b: np.ndarray, *, resamples: int = 2000, level: float = 0.95,
                          seed: int = 0) -> DiffCI:
    """Percentile bootstrap of ``mean(b - a)`` resampling *pairs* (the same prompts both ways).

    a, b: ``[n]`` per-item scores (e.g. 0/1 exact match, dense and sparse). Pairing removes the
    prompt-difficulty variance that an unpaired comparison would carry.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired scores must be 1-D and equal length, got {a.shape} and {b.shape}")
    n = a.size
    if n == 0:
        return DiffCI(float("nan"), float("nan"), float("nan"), 0)
    d = b - a
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    means = d[idx].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return DiffCI(float(d.mean()), float(low), float(high), n)


def bootstrap_mean_ci(x: np.ndarray, *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> DiffCI:
    """Percentile bootstrap CI of ``mean(x)`` (e.g. a held-out reward)."""
    x = np.asarray(x, dtype=np.float64)
    return paired_bootstrap_diff(np.zeros_like(x), x, resamples=resamples, level=level, seed=seed)
