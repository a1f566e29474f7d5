"""The ``summary/*`` headline metrics: the mapping table, eval sparsity from runtime stats, what a run logs."""

from __future__ import annotations

import pytest
import torch

from calib import tracking
from calib.tracking import Headline


def test_headline_metrics_maps_complements_and_skips_missing_sources():
    table = {"sparsity": Headline("sel", complement=True), "recall": Headline("rec"), "rel_error": Headline("absent")}
    out = tracking.headline_metrics(table, {"sel": 0.25, "rec": 0.8, "other": 1.0})
    assert out == {"summary/sparsity": pytest.approx(0.75), "summary/recall": pytest.approx(0.8)}


def test_every_method_has_a_row_and_names_come_from_one_vocabulary():
    from calib.config import available_methods

    assert set(tracking.RUN_HEADLINES) == set(available_methods())
    assert set(tracking.EVAL_SPARSITY_STATS) == set(available_methods())
    names = {n for table in tracking.RUN_HEADLINES.values() for n in table} | set(tracking.EVAL_HEADLINES)
    assert names | {"sparsity", "wall_s"} <= set(tracking.SUMMARY_NAMES)


def test_saap_sources_are_what_its_report_produces():
    """SAAP's summary reads ``at_top_l.<metric>.saap`` from :func:`calib.saap.report.headline_metrics`
    (a selectivity of 0.1 at the default ℓ is a sparsity of 0.9)."""
    from calib.saap.metrics import LayerEvaluation
    from calib.saap.report import head_curves, headline_metrics

    sel = torch.full((2, 2, 3), 0.1)  # [n_ℓ, Hq, nq]
    rec = torch.full((2, 2, 3), 0.7)
    ell = {"selectivity": sel, "selectivity_with_window": sel, "recall": rec, "rel_error": 1 - rec}
    window = {"selectivity": torch.zeros(1, 2, 3), "selectivity_with_window": torch.zeros(1, 2, 3),
              "recall": torch.zeros(1, 2, 3), "rel_error": torch.ones(1, 2, 3)}
    curves = head_curves({1: LayerEvaluation([4, 8], {"saap": ell, "window": window})})
    flat = tracking.flat_metrics(headline_metrics(curves, [4, 8], 8, [0.05]))
    out = tracking.headline_metrics(tracking.RUN_HEADLINES["saap"], flat)
    assert out == {"summary/sparsity": pytest.approx(0.9), "summary/recall": pytest.approx(0.7),
                   "summary/rel_error": pytest.approx(0.3)}


@pytest.mark.parametrize("method, stats, expected", [
    ("sale", [{"sparsity": 0.2}, {"sparsity": 0.4}], 0.3),
    ("sampleattention", [{"sparsity": 0.5, "density": 0.5}], 0.5),
    ("saap", [{"selectivity": 0.1}, {"selectivity": 0.3}, {}], 0.8),  # 1 - mean(0.1, 0.3); {}: no SAAP step
    ("santa", [{"sample_fraction": 0.25}], 0.75),
])
def test_eval_sparsity_is_the_mean_runtime_statistic(method, stats, expected):
    assert tracking.eval_sparsity(method, stats) == pytest.approx(expected)


def test_eval_sparsity_undefined_without_stats_or_method():
    assert tracking.eval_sparsity("sale", [{}, {}]) is None
    assert tracking.eval_sparsity("dense", [{"sparsity": 1.0}]) is None


def test_summary_line_orders_names_and_rounds():
    line = tracking.summary_line({"summary/wall_s": 84.6, "summary/rel_error": 0.048123, "summary/sparsity": 0.61349,
                                  "summary/acc_delta": -0.025})
    assert line == "sparsity 0.613 · acc_delta -0.025 · rel_error 0.0481 · wall_s 85"


def test_run_and_eval_summaries_are_logged_with_a_description(calib_home):
    import mlflow

    target = tracking.resolve_target({"experiment": "test"})
    with tracking.start_run(target, "r") as run:
        summary = tracking.log_run_summary("sale", {"sparsity": 0.123456, "err_worst": 0.05, "theta": 0.1})
    data = mlflow.MlflowClient().get_run(run.info.run_id).data
    assert {k: v for k, v in data.metrics.items() if k.startswith("summary/")} == summary
    assert summary["summary/sparsity"] == 0.1235 and summary["summary/rel_error"] == 0.05  # 4 significant digits
    assert summary["summary/wall_s"] >= 0.0
    assert data.tags[tracking.RUN_DESCRIPTION_TAG].startswith("sparsity 0.123 · rel_error 0.05 · wall_s ")

    metrics = {"dense_acc": 0.9, "sparse_acc": 0.85, "diff": -0.05, "diff_ci_low": -0.12, "diff_ci_high": 0.02}
    with tracking.start_run(target, "e") as run:
        summary = tracking.log_eval_summary("saap", metrics, [{"selectivity": 0.2}])
    logged = mlflow.MlflowClient().get_run(run.info.run_id).data.metrics
    assert logged["summary/acc_dense"] == pytest.approx(0.9) and logged["summary/acc_sparse"] == pytest.approx(0.85)
    assert logged["summary/acc_delta"] == pytest.approx(-0.05)
    assert (logged["summary/acc_delta_ci_low"], logged["summary/acc_delta_ci_high"]) == pytest.approx((-0.12, 0.02))
    assert logged["summary/sparsity"] == pytest.approx(0.8)
