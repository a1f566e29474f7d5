"""Per-length-bucket search of SampleAttention's (alpha_c, alpha_s, chunk_n) (Zhu et al., arXiv:2406.15486, §4.2.6).

Objective. A grid point is *feasible* when its task score on the bucket's profiling prompts is
``>= min_relative_score * dense_score``. Among feasible points let ``s*`` be the largest sparsity;
points with sparsity ``>= s* - sparsity_tol`` are *tied*, and the chosen one (:func:`choose_point`) is
the smallest by ``(chunk_n, -sparsity, time_s, alpha_c, alpha_s)``: smaller chunk_n (less sampling
overhead), then larger sparsity, then the shorter attention time (when a GPU timed it; ``None``
otherwise), then the smaller alphas. With ``sparsity_tol = 0`` only exactly equal sparsities tie.

Search (:func:`tune_length_bucket`): per chunk_n the sparsest point, then a staircase walk over the
monotone feasibility frontier, skipping every point that a pruning rule (:meth:`_Search.skip_reason`)
shows cannot change the choice; a final sweep evaluates any grid point no rule covers, so the result
equals the exhaustive-grid optimum whenever score and sparsity are monotone in each alpha.
Results: docs/results/sampleattention.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PointResult:
    """What evaluating one grid point on the profiling prompts gives."""

    score: float  # task score (same scale as dense_score)
    sparsity: float  # fraction of causal blocks skipped, in [0, 1]
    time_s: float | None = None  # measured attention time (GPU only), else None


@dataclass(frozen=True)
class GridPoint:
    alpha_c: float
    alpha_s: float
    chunk_n: int


@dataclass(frozen=True)
class EvaluatedPoint:
    point: GridPoint
    result: PointResult
    feasible: bool


@dataclass(frozen=True)
class SkippedPoint:
    point: GridPoint
    rule: str  # dominated_by_failure | cannot_beat_best | dominates_feasible
    because_of: GridPoint | None  # the evaluated point that justifies the skip


@dataclass
class TuningResult:
    """``chosen`` is None when no grid point is feasible (callers fall back to dense)."""

    chosen: EvaluatedPoint | None
    evaluated_points: list[EvaluatedPoint]
    skipped_points: list[SkippedPoint]
    threshold: float  # min_relative_score * dense_score

    def records(self) -> list[dict[str, Any]]:
        """Flat rows (evaluated then skipped) for logging a table to the tracker."""
        out = [{**asdict(e.point), **asdict(e.result), "feasible": e.feasible, "status": "evaluated",
                "chosen": e == self.chosen} for e in self.evaluated_points]
        out += [{**asdict(s.point), "status": f"skipped:{s.rule}"} for s in self.skipped_points]
        return out


def _sort_key(e: EvaluatedPoint) -> tuple[float, ...]:
    time = math.inf if e.result.time_s is None else e.result.time_s
    return (e.point.chunk_n, -e.result.sparsity, time, e.point.alpha_c, e.point.alpha_s)


def choose_point(feasible: Sequence[EvaluatedPoint], sparsity_tol: float = 0.0) -> EvaluatedPoint | None:
    """The module docstring's choice among feasible points (None for an empty list)."""
    if not feasible:
        return None
    best = max(e.result.sparsity for e in feasible)
    tied = [e for e in feasible if e.result.sparsity >= best - sparsity_tol]
    return min(tied, key=_sort_key)


@dataclass
class _Search:
    """Book-keeping of one bucket's search: what is known and why points were skipped."""

    evaluate: Callable[[float, float, int], PointResult]
    threshold: float
    sparsity_tol: float
    on_decided: Callable[[GridPoint], None] | None = None  # called once per grid point evaluated or skipped
    evaluated: dict[GridPoint, EvaluatedPoint] = field(default_factory=dict)
    skipped: dict[GridPoint, SkippedPoint] = field(default_factory=dict)

    def best_sparsity(self) -> float:
        return max((e.result.sparsity for e in self.evaluated.values() if e.feasible), default=-math.inf)

    def skip_reason(self, p: GridPoint) -> SkippedPoint | None:
        """The first pruning rule that covers ``p``, or None.

        Assumptions (per chunk_n; nothing is assumed across chunk_n, cf. paper Table 3): the score is
        non-decreasing in each alpha (a larger CRA threshold keeps a superset of blocks); sparsity is
        non-increasing in each alpha (same reason), and attention time non-decreasing. Each rule is sound
        under them (a skipped point could not change the choice):

        1. ``dominated_by_failure``: both alphas <= those of a failing point (same chunk_n) => it fails.
        2. ``cannot_beat_best``: its sparsity is bounded by ``ub``, the smallest sparsity of any evaluated
           point with both alphas <= its own (same chunk_n). It is skipped if ``ub < best feasible
           sparsity - tol`` (it can neither tie nor raise ``s*``), or if a feasible evaluated point ``b``
           has ``b.sparsity >= ub`` and ``(b.chunk_n, -b.sparsity) < (chunk_n, -ub)``: ``b`` is tied
           whenever it is, and wins the tie-break.
        3. ``dominates_feasible``: both alphas >= those of a feasible evaluated point ``q`` (same
           chunk_n) => feasible, but sparsity <= q's and time >= q's, so it never beats ``q``.
        """
        same = [e for e in self.evaluated.values() if e.point.chunk_n == p.chunk_n]
        below = [e for e in same if e.point.alpha_c <= p.alpha_c and e.point.alpha_s <= p.alpha_s]
        for e in same:
            if not e.feasible and p.alpha_c <= e.point.alpha_c and p.alpha_s <= e.point.alpha_s:
                return SkippedPoint(p, "dominated_by_failure", e.point)
        if below:
            bound = min(below, key=lambda e: e.result.sparsity)
            ub = bound.result.sparsity  # rule 2: sparsity(p) <= ub
            if ub < self.best_sparsity() - self.sparsity_tol or any(
                e.feasible and e.result.sparsity >= ub and (e.point.chunk_n, -e.result.sparsity) < (p.chunk_n, -ub)
                for e in self.evaluated.values()
            ):
                return SkippedPoint(p, "cannot_beat_best", bound.point)
        for e in below:
            if e.feasible:
                return SkippedPoint(p, "dominates_feasible", e.point)
        return None

    def visit(self, p: GridPoint) -> str:
        """Evaluate ``p`` unless a rule covers it: ``"feasible"``, ``"failing"`` or ``"pruned"``."""
        if p in self.evaluated:
            return "feasible" if self.evaluated[p].feasible else "failing"
        skip = self.skipped.get(p) or self.skip_reason(p)
        if skip is not None:
            if p not in self.skipped and self.on_decided is not None:
                self.on_decided(p)
            self.skipped[p] = skip
            logger.debug("skip %s: %s (%s)", p, skip.rule, skip.because_of)
            return {"dominated_by_failure": "failing", "dominates_feasible": "feasible"}.get(skip.rule, "pruned")
        result = self.evaluate(p.alpha_c, p.alpha_s, p.chunk_n)
        entry = EvaluatedPoint(p, result, result.score >= self.threshold)
        self.evaluated[p] = entry
        if self.on_decided is not None:
            self.on_decided(p)
        logger.info("chunk_n=%d alpha_c=%.3f alpha_s=%.3f: score=%.4f (need %.4f, %s) sparsity=%.4f time=%s",
                    p.chunk_n, p.alpha_c, p.alpha_s, result.score, self.threshold,
                    "ok" if entry.feasible else "fails", result.sparsity,
                    "n/a" if result.time_s is None else f"{result.time_s:.6f}s")
        return "feasible" if entry.feasible else "failing"

    def staircase(self, alphas_c: list[float], alphas_s: list[float], chunk_n: int) -> None:
        """Walk the feasibility frontier of one chunk_n (ascending alpha lists)."""
        i, j = len(alphas_c) - 1, 0
        while i >= 0 and j < len(alphas_s):
            status = self.visit(GridPoint(alphas_c[i], alphas_s[j], chunk_n))
            if status == "failing":
                j += 1  # every smaller alpha_c at this alpha_s fails too
            else:
                i -= 1  # feasible: larger alpha_s only loses sparsity; pruned: so does everything above it


def tune_length_bucket(
    evaluate: Callable[[float, float, int], PointResult],
    *,
    alphas_c: Sequence[float],
    alphas_s: Sequence[float],
    chunk_ns: Sequence[int],
    dense_score: float,
    min_relative_score: float = 0.99,
    sparsity_tol: float = 0.0,
    on_decided: Callable[[GridPoint], None] | None = None,
) -> TuningResult:
    """Search one length bucket's grid with dominance pruning (:meth:`_Search.skip_reason`).

    chunk_n ascending; within one chunk_n first the sparsest point (smallest alpha_c, smallest alpha_s):
    when it is feasible, rule 3 covers every other point of that chunk_n (one evaluation settles it);
    when it fails it cost one (early-stopped) evaluation. Then a staircase (saddleback) walk over the
    monotone feasibility frontier: start at (largest alpha_c, smallest alpha_s); feasible -> next smaller
    alpha_c, failing -> next larger alpha_s. It evaluates at most ``|alphas_c| + |alphas_s|`` points per
    chunk_n (the probe and the walk) and visits every minimal feasible point. A final sweep evaluates any
    grid point no rule covers.

    ``evaluate(alpha_c, alpha_s, chunk_n) -> PointResult`` runs the profiling prompts of the bucket.
    Returns the chosen point (None if nothing is feasible), every evaluated point in evaluation
    order and every skipped point with the rule and the point that justified it. ``on_decided(point)``
    is called once per grid point as it is evaluated or skipped (a progress bar over the grid).
    """
    if not alphas_c or not alphas_s or not chunk_ns:
        raise ValueError("alphas_c, alphas_s and chunk_ns must each hold at least one value")
    if not 0.0 < min_relative_score <= 1.0 or sparsity_tol < 0.0:
        raise ValueError(f"need 0 < min_relative_score <= 1 and sparsity_tol >= 0; got "
                         f"{min_relative_score}, {sparsity_tol}")
    cs, ss, ns = sorted(set(alphas_c)), sorted(set(alphas_s)), sorted(set(chunk_ns))
    search = _Search(evaluate, min_relative_score * dense_score, sparsity_tol, on_decided)
    for n in ns:
        search.visit(GridPoint(cs[0], ss[0], n))  # the sparsest point: feasible settles this chunk_n
        search.staircase(cs, ss, n)
    for n in ns:  # safety net: anything no rule covers gets evaluated (nothing, for monotone tables)
        for c in cs:
            for s in ss:
                search.visit(GridPoint(c, s, n))
    evaluated = list(search.evaluated.values())
    if len({e.result.time_s is None for e in evaluated}) > 1:
        raise ValueError("evaluate returned time_s for some points and None for others; measure all or none")
    chosen = choose_point([e for e in evaluated if e.feasible], sparsity_tol)
    logger.info("evaluated %d of %d grid points (%d skipped); chosen: %s", len(evaluated),
                len(cs) * len(ss) * len(ns), len(search.skipped), chosen if chosen else "none feasible -> dense")
    return TuningResult(chosen, evaluated, list(search.skipped.values()), search.threshold)


def lengths_by_bucket(edges: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """Profiling lengths grouped by the bucket that holds them (``len(edges) + 1`` lists, sorted)."""
    table = BucketTable(list(edges), [BucketRow(1.0, 1.0, 1)] * (len(edges) + 1))
    groups: list[list[int]] = [[] for _ in range(len(edges) + 1)]
    for length in sorted(set(lengths)):
        groups[table.bucket_index(length)].append(length)
    return groups


def build_bucket_table(
    edges: Sequence[int], results: Sequence[TuningResult | None], *, blk: int, max_length: int | None
) -> BucketTable:
    """The artifact table from one result per bucket (in bucket order; None = bucket not profiled).

    A bucket whose search found no feasible point runs dense ``(1.0, 1.0, 1)``; a bucket that was not
    profiled takes the row of the nearest shorter profiled bucket, else the nearest longer one, else
    dense. Both cases log a warning.
    """
    if len(results) != len(edges) + 1:
        raise ValueError(f"{len(edges)} bucket edges need {len(edges) + 1} results, got {len(results)}")
    tuned: list[BucketRow | None] = []
    for index, result in enumerate(results):
        if result is not None and result.chosen is None:
            logger.warning("SampleAttention bucket %d: no grid point reaches the score threshold %.4f; "
                           "the bucket runs dense", index, result.threshold)
            tuned.append(BucketRow(1.0, 1.0, 1))
        elif result is not None:
            p = result.chosen.point
            tuned.append(BucketRow(float(p.alpha_c), float(p.alpha_s), int(p.chunk_n)))
        else:
            tuned.append(None)
    rows = []
    for index, row in enumerate(tuned):
        if row is None:
            donors = [r for r in reversed(tuned[:index]) if r is not None] + [r for r in tuned[index:] if r is not None]
            row = donors[0] if donors else BucketRow(1.0, 1.0, 1)
            logger.warning("SampleAttention bucket %d has no profiling length; using %s", index, row)
        rows.append(row)
    return BucketTable(list(edges), rows, blk, max_length)
