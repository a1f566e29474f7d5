"""The pruned per-bucket search against an exhaustive grid on monotone tables, and its tie rules."""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calib.sampleattention.tuning import (
    PointResult,
    build_bucket_table,
    lengths_by_bucket,
    tune_length_bucket,
)
from runtime_kernels.sampleattention.buckets import BucketRow
from runtime_kernels.sampleattention.reference import cumulative_residual_attention, sampleattention_select

Table = dict[tuple[float, float, int], PointResult]


def monotone_table(rng: np.random.Generator, alphas_c, alphas_s, chunk_ns, timed: bool, decimals: int) -> Table:
    """Per chunk_n: score non-decreasing and sparsity non-increasing in each alpha, time non-decreasing.
    Rounding to ``decimals`` creates exact ties."""
    table: Table = {}
    m, n = len(alphas_c), len(alphas_s)
    for chunk_n in chunk_ns:
        score = np.maximum.accumulate(np.maximum.accumulate(rng.random((m, n)), 0), 1)
        dense_part = np.maximum.accumulate(np.maximum.accumulate(rng.random((m, n)), 0), 1)
        sparsity = np.round(1.0 - dense_part, decimals)  # non-increasing (rounding keeps monotonicity)
        time = np.round(0.1 + np.maximum.accumulate(np.maximum.accumulate(rng.random((m, n)), 0), 1), decimals)
        for (i, c), (j, s) in itertools.product(enumerate(alphas_c), enumerate(alphas_s)):
            table[(c, s, chunk_n)] = PointResult(float(score[i, j]), float(sparsity[i, j]),
                                                 float(time[i, j]) if timed else None)
    return table


def exhaustive_choice(table: Table, threshold: float, tol: float) -> tuple[float, float, int] | None:
    """Evaluate the whole grid: the best feasible point by the documented objective and tie rules."""
    feasible = [(key, r) for key, r in table.items() if r.score >= threshold]
    if not feasible:
        return None
    best = max(r.sparsity for _, r in feasible)
    tied = [(key, r) for key, r in feasible if r.sparsity >= best - tol]
    key, _ = min(tied, key=lambda kr: (kr[0][2], -kr[1].sparsity,
                                       math.inf if kr[1].time_s is None else kr[1].time_s, kr[0][0], kr[0][1]))
    return key


class CountingEvaluator:
    def __init__(self, table: Table) -> None:
        self.table, self.calls = table, []

    def __call__(self, alpha_c: float, alpha_s: float, chunk_n: int) -> PointResult:
        self.calls.append((alpha_c, alpha_s, chunk_n))
        return self.table[(alpha_c, alpha_s, chunk_n)]


def check_against_exhaustive(table: Table, alphas_c, alphas_s, chunk_ns, quantile: float, tol: float) -> None:
    threshold = float(np.quantile([r.score for r in table.values()], quantile))
    dense_score = threshold / 0.99
    ev, decided = CountingEvaluator(table), []
    result = tune_length_bucket(ev, alphas_c=alphas_c, alphas_s=alphas_s, chunk_ns=chunk_ns,
                                dense_score=dense_score, min_relative_score=0.99, sparsity_tol=tol,
                                on_decided=decided.append)
    expected = exhaustive_choice(table, 0.99 * dense_score, tol)
    got = None if result.chosen is None else (result.chosen.point.alpha_c, result.chosen.point.alpha_s,
                                              result.chosen.point.chunk_n)
    assert got == expected
    grid = len(alphas_c) * len(alphas_s) * len(chunk_ns)
    assert len(ev.calls) == len(set(ev.calls)) == len(result.evaluated_points)  # no point evaluated twice
    assert len(ev.calls) <= grid
    assert len(ev.calls) <= len(chunk_ns) * (len(alphas_c) + len(alphas_s))  # the probe and the staircase
    assert len(decided) == len(set(decided)) == grid  # the progress callback sees every grid point once
    evaluated = {(e.point.alpha_c, e.point.alpha_s, e.point.chunk_n) for e in result.evaluated_points}
    skipped = {(s.point.alpha_c, s.point.alpha_s, s.point.chunk_n) for s in result.skipped_points}
    assert evaluated | skipped == set(table) and not evaluated & skipped  # every point accounted for once
    for s in result.skipped_points:  # each skip rule's claim holds in the true table
        truth = table[(s.point.alpha_c, s.point.alpha_s, s.point.chunk_n)]
        if s.rule == "dominated_by_failure":
            assert truth.score < 0.99 * dense_score
        elif s.rule == "dominates_feasible":
            assert truth.score >= 0.99 * dense_score


ALPHAS = [0.80, 0.85, 0.90, 0.92, 0.95, 0.98]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(2, 6), n=st.integers(2, 6),
       n_chunks=st.integers(1, 4), timed=st.booleans(), decimals=st.sampled_from([1, 2, 6]),
       quantile=st.floats(0.0, 1.0), tol=st.sampled_from([0.0, 0.005, 0.05]))
def test_pruned_search_equals_exhaustive_on_monotone_tables(seed, m, n, n_chunks, timed, decimals, quantile, tol):
    rng = np.random.default_rng(seed)
    alphas_c, alphas_s = ALPHAS[:m], ALPHAS[-n:]
    chunk_ns = [1, 2, 4, 6][:n_chunks]
    table = monotone_table(rng, alphas_c, alphas_s, chunk_ns, timed, decimals)
    check_against_exhaustive(table, alphas_c, alphas_s, chunk_ns, quantile, tol)


def test_feasible_min_corner_settles_each_chunk_n_in_one_evaluation() -> None:
    rng = np.random.default_rng(5)
    table = monotone_table(rng, ALPHAS[:4], ALPHAS[:4], [1, 2, 4], timed=False, decimals=6)
    threshold = min(r.score for r in table.values())  # every point feasible
    ev = CountingEvaluator(table)
    result = tune_length_bucket(ev, alphas_c=ALPHAS[:4], alphas_s=ALPHAS[:4], chunk_ns=[1, 2, 4],
                                dense_score=threshold / 0.99)
    assert ev.calls == [(ALPHAS[0], ALPHAS[0], n) for n in (1, 2, 4)]
    assert result.chosen is not None and result.chosen.point == exhaustive_choice_point(table, threshold)


def exhaustive_choice_point(table: Table, threshold: float):
    from calib.sampleattention.tuning import GridPoint

    return GridPoint(*exhaustive_choice(table, threshold, 0.0))


def flat_table(sparsity_by_chunk: dict[int, float], time_by_chunk: dict[int, float | None] | None = None) -> Table:
    """Every point feasible; sparsity depends only on chunk_n (ties across the whole alpha grid)."""
    times = time_by_chunk or {}
    return {(c, s, n): PointResult(1.0, sp, times.get(n)) for n, sp in sparsity_by_chunk.items()
            for c in ALPHAS[:3] for s in ALPHAS[:3]}


def tune(table: Table, tol: float = 0.0, dense_score: float = 1.0):
    keys = sorted(table)
    return tune_length_bucket(CountingEvaluator(table), alphas_c=sorted({k[0] for k in keys}),
                              alphas_s=sorted({k[1] for k in keys}), chunk_ns=sorted({k[2] for k in keys}),
                              dense_score=dense_score, sparsity_tol=tol)


def test_equal_sparsity_goes_to_smaller_chunk_n_then_smaller_alphas() -> None:
    chosen = tune(flat_table({4: 0.7, 2: 0.7, 1: 0.7})).chosen.point
    assert (chosen.chunk_n, chosen.alpha_c, chosen.alpha_s) == (1, 0.80, 0.80)


def test_sparsity_tolerance_prefers_smaller_chunk_n() -> None:
    table = flat_table({1: 0.797, 2: 0.800})
    assert tune(table, tol=0.0).chosen.point.chunk_n == 2  # exact objective: strictly sparser wins
    assert tune(table, tol=0.005).chosen.point.chunk_n == 1  # within the tie window: fewer chunks
    assert tune(table, tol=0.002).chosen.point.chunk_n == 2  # 0.003 apart is outside a 0.002 window


def test_within_tie_window_same_chunk_n_larger_sparsity_then_faster() -> None:
    # (0.80, 0.85) and (0.85, 0.80) are incomparable by dominance; both feasible, all else failing
    def row(sp: float, t: float, ok: bool = True) -> PointResult:
        return PointResult(1.0 if ok else 0.0, sp, t)

    table = {(0.80, 0.80, 1): row(0.95, 1.0, ok=False), (0.80, 0.85, 1): row(0.90, 2.0),
             (0.85, 0.80, 1): row(0.898, 1.0), (0.85, 0.85, 1): row(0.85, 3.0)}
    assert tune(table, tol=0.005).chosen.point.alpha_c == 0.80  # larger sparsity beats faster
    table[(0.85, 0.80, 1)] = row(0.90, 1.0)
    assert tune(table, tol=0.005).chosen.point.alpha_c == 0.85  # equal sparsity: faster wins


def test_nothing_feasible_gives_none_and_dense_row(caplog: pytest.LogCaptureFixture) -> None:
    table = {k: PointResult(0.5, r.sparsity, None) for k, r in flat_table({1: 0.5, 2: 0.5}).items()}
    result = tune(table, dense_score=1.0)
    assert result.chosen is None
    # per chunk_n the sparsest point (the probe), then the walk tries the largest alpha_c with each alpha_s
    # (all fail); the rest is dominated
    assert len(result.evaluated_points) == 2 * (1 + 3)
    assert {(e.point.alpha_c, e.point.alpha_s) for e in result.evaluated_points} == {
        (0.80, 0.80), (0.90, 0.80), (0.90, 0.85), (0.90, 0.90)}
    with caplog.at_level(logging.WARNING):
        bucket_table = build_bucket_table([1536], [result, result], blk=64, max_length=None)
    assert bucket_table.rows == [BucketRow(1.0, 1.0, 1)] * 2
    assert "runs dense" in caplog.text


def test_every_evaluated_point_and_the_choice_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="calib.sampleattention.tuning"):
        result = tune(flat_table({1: 0.6, 2: 0.7}))
    lines = [r.getMessage() for r in caplog.records]
    for e in result.evaluated_points:
        p = e.point
        assert any(f"chunk_n={p.chunk_n} alpha_c={p.alpha_c:.3f} alpha_s={p.alpha_s:.3f}" in line for line in lines)
    assert any("chosen" in line and "chunk_n=2" in line for line in lines)


def test_mixed_timing_is_refused() -> None:
    table = flat_table({1: 0.6, 2: 0.7}, {1: 0.1, 2: None})
    with pytest.raises(ValueError, match="time_s"):
        tune(table)


def test_lengths_by_bucket_and_unprofiled_buckets_inherit() -> None:
    llama_edges = [16384, 49152, 81920, 114688]
    assert lengths_by_bucket(llama_edges, [8192, 16384, 32768, 65536, 131072]) == [
        [8192], [16384, 32768], [65536], [], [131072]]
    table = flat_table({1: 0.6})
    result = tune(table)
    other = tune(flat_table({2: 0.6}))
    built = build_bucket_table(llama_edges, [None, result, None, other, None], blk=64, max_length=131072)
    first, second = BucketRow(0.80, 0.80, 1), BucketRow(0.80, 0.80, 2)
    assert built.rows == [first, first, first, second, second]
    assert built.max_length == 131072


def test_real_selection_is_monotone_and_search_matches_exhaustive() -> None:
    """End to end on the real selection: score = CRA on all rows (monotone, since a larger alpha keeps a
    superset of columns and bands), sparsity = 1 - mean block density."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 256, 16, generator=g, dtype=torch.float64)
    q[..., 0] += 3.0
    k[:, :, [0, 100], 0] += 5.0
    alphas = [0.5, 0.7, 0.85, 0.95]
    table: Table = {}
    masks = {}
    for c, s, n in itertools.product(alphas, alphas, [1, 2]):
        mask = sampleattention_select(q, k, alpha_c=c, alpha_s=s, chunk_n=n, blk=16)
        masks[(c, s, n)] = mask.to_dense()
        cra = cumulative_residual_attention(q, k, mask).min().item()
        table[(c, s, n)] = PointResult(cra, 1.0 - mask.density().mean().item(), None)
    for (c, s, n), keep in masks.items():  # superset property behind the tuner's assumption
        for (c2, s2, n2), keep2 in masks.items():
            if n2 == n and c2 >= c and s2 >= s:
                assert not (keep & ~keep2).any()
    scores = sorted(r.score for r in table.values())
    assert scores[0] < scores[-1]
    for quantile in (0.2, 0.5, 0.8):
        check_against_exhaustive(table, alphas, alphas, [1, 2], quantile, tol=0.0)
