"""Timing helpers shared by the GPU benchmarks (``bench_decode.py``, ``bench_prefill.py``).

Method (SANTA paper App. R): CUDA events around the timed call only, warm-up calls first (compilation,
autotuning and handle creation stay out), a cold L2 before every timed call (a read of a buffer larger than
the GPU's L2, outside the events), the median over repeats.

The flush *reads* the buffer rather than writing it: a written flush leaves the L2 full of dirty lines,
whose write-back then happens inside the timed call, as extra HBM traffic of up to the L2's size charged
to whichever kernel runs next. That is no cost of the kernel, and it weighs most on the calls that read
least (a classifier's weight stream, a sparse step), so a read flush gives both a cold L2 and an honest
clock. ``flush="write"`` writes instead. Inputs are random, never zeros. ``floor_ms`` gives the bandwidth
floor printed beside every time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

HBM_TBPS = 4.2  # the HBM peak the targets are stated against, TB/s; the measured copy rate is printed beside it
L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    """Median and spread of one timed call, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int


def cuda_time(fn: Callable[[], object], *, warmup: int = 5, repeats: int = 30, cold_l2: bool = True,
              flush: str = "read") -> Timing:
    """Median device time of ``fn()`` with CUDA events, after ``warmup`` untimed calls.

    With ``cold_l2`` a 256 MiB buffer is read (``flush="read"``: the L2 is left holding its clean lines)
    or overwritten (``"write"``: dirty lines, see the module docstring) before each timed call, outside
    the events, so no call reads its inputs from the previous call's L2.
    """
    if flush not in ("read", "write"):
        raise ValueError(f"flush must be 'read' or 'write', got {flush!r}")
    buf = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda") if cold_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(repeats):
        if buf is not None:
            if flush == "read":
                buf.amax()
            else:
                buf.fill_(1.0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return Timing(statistics.median(times), times[len(times) // 10], times[(9 * len(times)) // 10], repeats)


def floor_ms(nbytes: float, tbps: float = HBM_TBPS) -> float:
    """Time to move ``nbytes`` through HBM at ``tbps`` TB/s, in milliseconds."""
    return nbytes / (tbps * 1e12) * 1e3


def measured_copy_tbps(nbytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy rate (bytes read + written) in TB/s: the achievable bandwidth ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup=3, repeats=10, cold_l2=False)
    return nbytes / (t.median_ms * 1e-3) / 1e12


def tbps(nbytes: float, ms: float) -> float:
    """Achieved TB/s for ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12


def print_targets(checks: list[tuple[str, float | None, float]], header: str, width: int = 44) -> None:
    """Print each ``(label, achieved ratio or None, needed ratio)`` as MET or MISSED by how much."""
    print(f"\n{header}")
    if not checks:
        print("  (no target shape in this run)")
    for label, got, need in checks:
        if got is None:
            print(f"  {label:<{width}} n/a")
            continue
        verdict = "MET" if got >= need else f"MISSED by {need / got:.2f}x"
        print(f"  {label:<{width}} {got:6.2f} (need >= {need:.2f})  {verdict}")
