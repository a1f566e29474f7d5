"""What the SampleAttention tuning shows: per-bucket heatmaps, the Table-3 table, JSON records.

* Heatmaps (one figure per bucket): for every chunk_n with at least one evaluated point, alpha_c
  (rows) x alpha_s (columns) -> score and -> sparsity. Skipped cells are grey with the pruning rule's
  letter (F: dominated_by_failure, B: cannot_beat_best, D: dominates_feasible); a score stopped early
  reads ``<=x`` (an upper bound); the chosen cell is outlined.
* Table 3 (paper Table 3 shape): for each bucket, the score and sparsity of every chunk_n at the
  bucket's chosen (alpha_c, alpha_s) — or, for a bucket where nothing was feasible, at the largest
  alphas of the grid — all scored on every profiling prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from calib.sampleattention.scoring import PointEval
from calib.sampleattention.tuning import GridPoint, TuningResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# matplotlib is imported where used: the recipe imports this module, and the CLI imports the recipe for
# checks that must fail fast.

RULE_LETTERS = {"dominated_by_failure": "F", "cannot_beat_best": "B", "dominates_feasible": "D"}


@dataclass
class BucketReport:
    """One bucket's tuning outcome as the recipe logs it."""

    index: int
    lower: int  # inclusive lower length edge (0 for the first bucket)
    upper: int | None  # exclusive upper edge (None: open-ended)
    lengths: list[int]  # profiled prompt lengths in this bucket
    num_prompts: int
    dense_score: float
    dense_exact: float
    threshold: float
    result: TuningResult
    evals: dict[GridPoint, PointEval]
    table3_alpha: tuple[float, float]
    table3: dict[int, PointEval]
    grid_points: int

    @property
    def label(self) -> str:
        upper = "inf" if self.upper is None else str(self.upper)
        return f"[{self.lower},{upper})"

    def chosen_eval(self) -> PointEval | None:
        return None if self.result.chosen is None else self.evals[self.result.chosen.point]

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen_eval()
        skipped = [{"alpha_c": s.point.alpha_c, "alpha_s": s.point.alpha_s, "chunk_n": s.point.chunk_n,
                    "rule": s.rule, "because_of": None if s.because_of is None else vars(s.because_of)}
                   for s in self.result.skipped_points]
        return {"bucket": self.index, "range": self.label, "lengths": self.lengths, "num_prompts": self.num_prompts,
                "dense_score": self.dense_score, "dense_exact": self.dense_exact, "threshold": self.threshold,
                "grid_points": self.grid_points, "evaluated_points": len(self.result.evaluated_points),
                "evaluated": [dict(self.evals[e.point].record(), feasible=e.feasible)
                              for e in self.result.evaluated_points],
                "skipped": skipped, "chosen": None if chosen is None else chosen.record(),
                "table3": {"alpha_c": self.table3_alpha[0], "alpha_s": self.table3_alpha[1],
                           "rows": [dict(e.record(), feasible=e.score >= self.threshold)
                                    for _, e in sorted(self.table3.items())]}}


def table3_markdown(reports: list[BucketReport]) -> str:
    """Paper Table 3 shape: one row per bucket, ``score / sparsity`` per chunk_n at the chosen alphas."""
    chunk_ns = sorted({n for r in reports for n in r.table3})
    head = "| bucket | (alpha_c, alpha_s) | dense | " + " | ".join(f"chunk_n={n}" for n in chunk_ns) + " |"
    lines = [head, "|" + " --- |" * (3 + len(chunk_ns))]
    for r in reports:
        cells = []
        for n in chunk_ns:
            e = r.table3.get(n)
            mark = "*" if r.result.chosen is not None and r.result.chosen.point == GridPoint(*r.table3_alpha, n) else ""
            cells.append("-" if e is None else f"{e.score:.4f} / {e.sparsity:.3f}{mark}")
        lines.append(f"| {r.index} {r.label} | ({r.table3_alpha[0]:.2f}, {r.table3_alpha[1]:.2f}) | "
                     f"{r.dense_score:.4f} | " + " | ".join(cells) + " |")
    lines.append("\ncells: worst task's score / dense (per task) / sparsity on all profiling prompts; * = chosen; "
                 "dense = dense mean score")
    return "\n".join(lines) + "\n"


def _grid(report: BucketReport, chunk_n: int, alphas_c: list[float], alphas_s: list[float]) -> dict[str, Any]:
    """Score/sparsity matrices ``[len(alphas_c), len(alphas_s)]`` and cell labels for one chunk_n."""
    score = [[math.nan] * len(alphas_s) for _ in alphas_c]
    sparsity = [[math.nan] * len(alphas_s) for _ in alphas_c]
    labels = [[""] * len(alphas_s) for _ in alphas_c]
    for e in report.evals.values():
        if e.point.chunk_n != chunk_n:
            continue
        i, j = alphas_c.index(e.point.alpha_c), alphas_s.index(e.point.alpha_s)
        score[i][j], sparsity[i][j] = e.score, e.sparsity
        labels[i][j] = ("" if e.complete else "<=")
    for s in report.result.skipped_points:
        i, j = alphas_c.index(s.point.alpha_c), alphas_s.index(s.point.alpha_s)
        if s.point.chunk_n == chunk_n and math.isnan(score[i][j]):
            labels[i][j] = RULE_LETTERS.get(s.rule, "?")
    return {"score": score, "sparsity": sparsity, "labels": labels}


def heatmap_figure(report: BucketReport, alphas_c: list[float], alphas_s: list[float]) -> Figure:
    """The bucket's figure: one row per evaluated chunk_n, columns score and sparsity."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    chunk_ns = sorted({e.point.chunk_n for e in report.evals.values()})
    rows = max(1, len(chunk_ns))
    size = (2.2 + 2.2 * len(alphas_s), 0.6 + 0.9 * len(alphas_c) * rows)
    fig = Figure(figsize=size)
    axes = fig.subplots(rows, 2, squeeze=False)
    chosen = report.result.chosen.point if report.result.chosen is not None else None
    for row, n in enumerate(chunk_ns):
        grid = _grid(report, n, alphas_c, alphas_s)
        panels = (("score", "viridis", None, None), ("sparsity", "magma", 0.0, 1.0))
        for col, (key, cmap, vmin, vmax) in enumerate(panels):
            ax = axes[row][col]
            data = np.array(grid[key], dtype=float)
            ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
            ax.set_facecolor("0.85")
            for i in range(len(alphas_c)):
                for j in range(len(alphas_s)):
                    text = grid["labels"][i][j] + ("" if math.isnan(data[i, j]) else f"{data[i, j]:.4g}")
                    box = None if math.isnan(data[i, j]) else {"facecolor": "white", "alpha": 0.7, "linewidth": 0}
                    ax.text(j, i, text, ha="center", va="center", fontsize=7, bbox=box)
            if chosen is not None and chosen.chunk_n == n:
                ax.add_patch(Rectangle((alphas_s.index(chosen.alpha_s) - 0.5, alphas_c.index(chosen.alpha_c) - 0.5),
                                       1, 1, fill=False, edgecolor="red", linewidth=2))
            ax.set_xticks(range(len(alphas_s)), [f"{a:.2f}" for a in alphas_s], fontsize=7)
            ax.set_yticks(range(len(alphas_c)), [f"{a:.2f}" for a in alphas_c], fontsize=7)
            ax.set_xlabel("alpha_s", fontsize=8)
            ax.set_ylabel("alpha_c", fontsize=8)
            extra = f" (need >= {report.threshold:.4g})" if key == "score" else ""
            ax.set_title(f"chunk_n={n}: {'worst task / dense' if key == 'score' else key}{extra}", fontsize=8)
    fig.suptitle(f"SampleAttention bucket {report.index} {report.label}: dense score {report.dense_score:.4g}; "
                 "grey = skipped (F/B/D), <= = stopped early, red = chosen", fontsize=8)
    fig.tight_layout()
    return fig
