"""scripts/bench/paired.py: a method timed against dense in ABBA pairs, and the interval of the pairs' ratio."""

from __future__ import annotations

import gc
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import paired  # noqa: E402
from paired import dense_prefill, median_interval, paired_ms  # noqa: E402


def test_dense_prefill_switches_the_method_off_and_always_back_on():
    class Model:
        calib_attention = SimpleNamespace(prefill="sale kernel", decode="saap index")

    model = Model()
    with dense_prefill(model):
        assert (model.calib_attention.prefill, model.calib_attention.decode) == (None, None)
    assert (model.calib_attention.prefill, model.calib_attention.decode) == ("sale kernel", "saap index")
    with pytest.raises(RuntimeError), dense_prefill(model):
        raise RuntimeError("a prefill failed")
    assert model.calib_attention.prefill == "sale kernel"
    with dense_prefill(object()):  # nothing attached: nothing to switch
        pass


def test_paired_timing_alternates_the_two_paths_abba_with_the_collector_off():
    """A method's calls and dense's alternate in ABBA order after one warm-up each; each median is its own
    path's, the interval is over the pairs' ratios dense / method; the garbage collector is off while
    timing and on again after; with nothing attached the pair is A/A."""
    state = SimpleNamespace(prefill="sale", decode=None)
    seen: list[tuple[str | None, bool]] = []
    times = {"sale": iter([9.0, 1.0, 2.0, 30.0]), None: iter([9.0, 5.0, 7.0, 6.0])}

    def timed() -> float:
        seen.append((state.prefill, gc.isenabled()))
        return next(times[state.prefill])

    got = paired_ms(SimpleNamespace(calib_attention=state), timed, 3, min_s=0)
    # pairs (1, 5), (2, 7), (30, 6): ratios 5, 3.5, 0.2; three pairs give no 95 % interval narrower than their range
    assert (got.ms, got.dense_ms, got.ratio, got.ratio_low, got.ratio_high, got.pairs) == (2.0, 6.0, 3.5, 0.2, 5.0, 3)
    on, off = ("sale", False), (None, False)
    assert seen == [("sale", True), (None, True), on, off, off, on, on, off] and gc.isenabled()
    calls = iter([4.0, 4.0, 3.0, 5.0, 3.0, 4.0])
    # dense against itself: pair 1 takes 3 (method) then 5 (dense), pair 2 (dense first) 3 then 4 (method)
    got = paired_ms(object(), lambda: next(calls), 2, min_s=0)
    assert (got.ms, got.dense_ms, got.ratio_low, got.ratio_high) == (3.5, 4.0, 3 / 4, 5 / 3)
    assert got.ratio == pytest.approx((3 / 4 + 5 / 3) / 2)  # the pairs' median, not 4.0 / 3.5


def test_paired_timing_repeats_until_the_timed_calls_fill_the_minimum_time():
    """Past ``repeats`` pairs, more pairs until both paths' timed calls add up to ``min_s``: 10 ms calls
    and 0.1 s need five pairs; a cap bounds the count for calls too short to fill it."""
    count = 0

    def timed() -> float:
        nonlocal count
        count += 1
        return 10.0

    assert paired_ms(object(), timed, 2, min_s=0.1).pairs == 5
    assert count == 2 + 2 * 5
    count = 0
    paired_ms(object(), timed, 2, min_s=1e9)
    assert count == 2 + 2 * paired.PAIRED_MAX_REPEATS


def test_median_interval_takes_the_binomial_order_statistics():
    """Hand-worked: n = 10, P(B(10, 1/2) <= 1) = 11/1024 <= 2.5 % < P(<= 2) = 56/1024, so x(2) and x(9);
    n = 15: P(<= 3) = 576/32768 <= 2.5 % < P(<= 4) = 1941/32768, so x(4) and x(12); n = 5: even
    P(0) = 1/32 is over 2.5 %, so the whole range; one value is its own interval."""
    assert median_interval([5, 3, 8, 1, 9, 2, 7, 4, 6, 10]) == (2, 9)
    assert median_interval(range(1, 16)) == (4, 12)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert median_interval([0.97]) == (0.97, 0.97)
    assert median_interval(range(1, 11), level=0.5) == (4, 7)  # P(<= 3) = 176/1024 <= 25 % < P(<= 4) = 386/1024
    with pytest.raises(ValueError):
        median_interval([])


def test_median_interval_covers_the_true_median_at_its_stated_level():
    """Over 4000 samples of 15 draws from a skewed distribution (exponential, median ln 2), the interval
    holds the median in 1 - 2 * 576/32768 = 96.5 % of them (binomial: ± 0.9 points at 3 sigma)."""
    rng = random.Random(0)
    true_median = statistics.median(rng.expovariate(1.0) for _ in range(200_001))  # ln 2 up to 0.3 %
    hits = 0
    for _ in range(4000):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(15)])
        hits += low <= true_median <= high
    assert abs(hits / 4000 - (1 - 2 * 576 / 32768)) < 0.009
