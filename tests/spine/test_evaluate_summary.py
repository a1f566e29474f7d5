"""Eval summary: accuracies per task@length, per-length pooled CIs, stats averaged per group."""

from __future__ import annotations

import pytest

from calib.evaluate import PromptResult, summarize


def _results(pattern: list[tuple[str, int, bool]], stats: dict[str, float] | None = None) -> list[PromptResult]:
    return [PromptResult(task, length, "", correct, dict(stats or {})) for task, length, correct in pattern]


def test_dense_only_reports_accuracy_per_cell_and_length():
    dense = _results([("a", 1024, True), ("a", 1024, False), ("b", 1024, True), ("b", 2048, True)])
    tasks, metrics = summarize(dense, None, resamples=200, seed=0)
    assert tasks == {"a@1024": {"dense": 0.5}, "b@1024": {"dense": 1.0}, "b@2048": {"dense": 1.0}}
    assert metrics["len1024.dense_acc"] == pytest.approx(2 / 3) and metrics["len2048.dense_acc"] == 1.0
    assert metrics["dense_acc"] == 0.75 and metrics["num_prompts"] == 4
    assert not any("sparse" in k or "diff" in k for k in metrics)


def test_sparse_reports_paired_differences_and_mean_stats():
    dense = _results([("a", 1024, True)] * 4 + [("a", 2048, True)] * 4)
    # the sparse method loses every 2048 prompt and none at 1024
    sparse = _results([("a", 1024, True)] * 4 + [("a", 2048, False)] * 4, stats={"sparsity": 0.25})
    for r, s in zip(sparse[4:], [0.5, 0.7, 0.5, 0.7]):
        r.stats["sparsity"] = s
    tasks, metrics = summarize(dense, sparse, resamples=200, seed=0)
    assert tasks["a@2048"] == {"dense": 1.0, "sparse": 0.0}
    assert metrics["len1024.diff"] == metrics["len1024.diff_ci_low"] == metrics["len1024.diff_ci_high"] == 0.0
    assert metrics["len2048.diff"] == metrics["len2048.diff_ci_high"] == -1.0
    assert metrics["a@2048.sparsity"] == pytest.approx(0.6) and metrics["len1024.sparsity"] == 0.25
    assert metrics["diff"] == -0.5 and metrics["sparse_acc"] == 0.5
    assert metrics["diff_ci_low"] <= -0.5 <= metrics["diff_ci_high"]
