"""A method timed against dense attention in its own process (``bench_serving.py``): the two paths in ABBA
pairs, and the interval of the pairs' ratio, so that a cell's × dense comes with the noise it carries.

A launch-bound prefill or a host-bound generation of a small model moves with the host from call to call,
and between processes by more than between the two paths; pairs taken in one process, in alternating order,
settle the ratio, and the spread of the per-pair ratios says how well."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

PAIRED_MIN_S = 2.0  # and more pairs until the timed calls of both paths add up to this many seconds
SECOND_MIN_S = 0.25  # the same for second tokens (each timed step follows an untimed prefill)
PAIRED_MAX_REPEATS = 400  # pairs at most (a sub-millisecond call would otherwise repeat thousands of times)
RATIO_LEVEL = 0.95  # coverage of the interval of the median per-pair ratio


@dataclass(frozen=True)
class Paired:
    """Medians of the two paths' calls (ms), the median of the per-pair ratios dense / method (× dense,
    above 1 where the method is faster) and its interval. The per-pair median, not the ratio of the two
    medians: a call time that moves with the host between modes can put the two medians in different
    modes while every pair, taken side by side, reads the same."""

    ms: float
    dense_ms: float
    ratio: float
    ratio_low: float
    ratio_high: float
    pairs: int


@contextlib.contextmanager
def dense_prefill(model) -> Iterator[None]:
    """The attached method's prefill work switched off (its prefill kernel, SAAP's index build): the
    same loop's dense prefill, for a reference measured in the method's own process."""
    state = getattr(model, "calib_attention", None)
    if state is None:
        yield
        return
    saved = state.prefill, state.decode
    state.prefill = state.decode = None
    try:
        yield
    finally:
        state.prefill, state.decode = saved


def median_interval(values: Sequence[float], level: float = RATIO_LEVEL) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics x(k) and x(n+1-k),
    k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2; for fewer values than that allows
    (n < 6 at 95 %), their whole range."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("the median interval of no values")
    tail, k = 0.0, 0
    while k < (n - 1) // 2 and tail + math.comb(n, k) / 2**n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def paired_ms(model, timed: Callable[[], float], repeats: int, min_s: float = PAIRED_MIN_S) -> Paired:
    """Calls of ``timed()`` (ms) and of the same under :func:`dense_prefill` (for dense itself: the same
    path twice, an A/A pair whose ratio is the measurement's noise), each path warmed up once first, with
    the garbage collector off (a host-bound prefill would otherwise pay a collection in some repeats).
    Pairs run in ABBA order (method, dense, dense, method, ...), so neither path always goes first after
    the other, and repeat until ``repeats`` pairs and ``min_s`` seconds of timed calls."""
    timed()
    with dense_prefill(model):
        timed()

    def dense() -> float:
        with dense_prefill(model):
            return timed()

    method_ms: list[float] = []
    dense_ms: list[float] = []
    gc.collect()
    gc.disable()
    try:
        while len(method_ms) < repeats or sum(method_ms) + sum(dense_ms) < min_s * 1e3:
            if len(method_ms) % 2 == 0:
                method_ms.append(timed())
                dense_ms.append(dense())
            else:
                dense_ms.append(dense())
                method_ms.append(timed())
            if len(method_ms) >= PAIRED_MAX_REPEATS:
                break
    finally:
        gc.enable()
    ratios = [d / m for m, d in zip(method_ms, dense_ms)]
    low, high = median_interval(ratios)
    return Paired(statistics.median(method_ms), statistics.median(dense_ms), statistics.median(ratios), low, high,
                  len(method_ms))
