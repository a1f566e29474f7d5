"""SAAP report aggregation: per-head curves, the per-ℓ table, recall interpolated at target selectivities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from calib.saap.metrics import LayerEvaluation
from calib.saap.report import (head_curves, headline_metrics, interpolated_recall, moving_average,
                               recall_by_query_range, summary_table)

TOP_LS = [4, 8]


def _evaluation(sel: list[list[float]], rec: list[list[float]], win: list[float]) -> LayerEvaluation:
    """One layer, 2 heads, 2 queries per head with equal values: ``sel/rec [n_ℓ][Hq]``, ``win [Hq]``."""
    def per_query(v: list[list[float]]) -> torch.Tensor:
        return torch.tensor(v)[..., None].expand(-1, -1, 2).clone()  # [n_ℓ, Hq, 2]

    ell = {"selectivity": per_query(sel), "selectivity_with_window": per_query(sel) * 0.5 + 0.5,
           "recall": per_query(rec), "rel_error": 1 - per_query(rec)}
    window = {"selectivity": torch.zeros(1, 2, 2), "selectivity_with_window": torch.full((1, 2, 2), 0.5),
              "recall": per_query([win]), "rel_error": 1 - per_query([win])}
    return LayerEvaluation(TOP_LS, {"saap": ell, "kmeans_derope": {k: v.clone() for k, v in ell.items()},
                                    "window": window})


def test_interpolation_per_head_then_mean_over_heads():
    # head 0: (0, .5) (.04, .7) (.08, .9); head 1: (0, .3) (.02, .4) (.2, .8)
    ev = _evaluation(sel=[[0.04, 0.02], [0.08, 0.2]], rec=[[0.7, 0.4], [0.9, 0.8]], win=[0.5, 0.3])
    curves = head_curves({1: ev})
    out = interpolated_recall(curves, [0.02, 0.05, 0.1])
    h0 = [0.5 + 0.2 * 0.02 / 0.04, 0.7 + 0.2 * 0.01 / 0.04, math.nan]  # 0.1 is beyond head 0's last point
    h1 = [0.4, 0.4 + 0.4 * 0.03 / 0.18, 0.4 + 0.4 * 0.08 / 0.18]
    expected = [(h0[0] + h1[0]) / 2, (h0[1] + h1[1]) / 2, h1[2]]  # NaN heads are left out of the mean
    assert out["saap"] == pytest.approx(expected)
    assert out["kmeans_derope"] == pytest.approx(expected)
    assert out["window"] == pytest.approx([0.4, 0.4, 0.4])
    per_layer = interpolated_recall(curves, [0.02], per_layer=True)
    assert len(per_layer["saap"]) == 1 and per_layer["saap"][0] == pytest.approx([expected[0]])


def test_table_and_headline():
    ev = _evaluation(sel=[[0.04, 0.02], [0.08, 0.2]], rec=[[0.7, 0.4], [0.9, 0.8]], win=[0.5, 0.3])
    curves = head_curves({1: ev, 2: ev})
    rows = summary_table(curves, TOP_LS)
    saap = [r for r in rows if r["method"] == "saap"]
    assert [r["l"] for r in saap] == TOP_LS
    assert saap[1]["selectivity"] == pytest.approx(0.14) and saap[1]["recall"] == pytest.approx(0.85)
    assert saap[1]["selectivity_with_window"] == pytest.approx(0.57)
    window = next(r for r in rows if r["method"] == "window")
    assert window["l"] == 0 and window["selectivity"] == 0.0 and window["recall"] == pytest.approx(0.4)
    m = headline_metrics(curves, TOP_LS, 8, [0.05])
    assert m["at_top_l"]["recall"]["saap"] == pytest.approx(0.85)
    assert m["at_top_l"]["rel_error"]["kmeans_derope"] == pytest.approx(0.15)
    assert set(m["recall_at_sel0.05"]) == {"saap", "kmeans_derope", "window"}
    assert m["window"]["recall"] == pytest.approx(0.4)


def test_headline_at_a_per_layer_default_l():
    """``at_top_l`` with one ℓ per layer reads each layer's own column: layer 1 at ℓ = 4, layer 2 at 8."""
    low = _evaluation(sel=[[0.04, 0.02], [0.08, 0.2]], rec=[[0.7, 0.4], [0.9, 0.8]], win=[0.5, 0.3])
    high = _evaluation(sel=[[0.1, 0.3], [0.5, 0.7]], rec=[[0.6, 0.6], [1.0, 0.9]], win=[0.5, 0.3])
    curves = head_curves({1: low, 2: high})
    m = headline_metrics(curves, TOP_LS, [4, 8], [0.05])
    assert m["at_top_l"]["selectivity"]["saap"] == pytest.approx((0.04 + 0.02 + 0.5 + 0.7) / 4)
    assert m["at_top_l"]["recall"]["saap"] == pytest.approx((0.7 + 0.4 + 1.0 + 0.9) / 4)
    same = headline_metrics(curves, TOP_LS, 8, [0.05])["at_top_l"]["recall"]["saap"]
    assert same == pytest.approx(headline_metrics(curves, TOP_LS, [8, 8], [0.05])["at_top_l"]["recall"]["saap"])
    with pytest.raises(ValueError, match="1 default ℓ for 2 evaluated layers"):
        headline_metrics(curves, TOP_LS, [4], [0.05])


def test_split_by_query_range():
    """Queries split by how far back their top-1 key lies: head 0's query 0 is long-range (300 > 256) and
    its query 1 is not (10); both of head 1's are. Each set's curve is the mean over its own queries, a
    head with none is NaN and left out; the fractions count (head, query) pairs."""
    sel = torch.tensor([[[0.02, 0.06], [0.04, 0.04]], [[0.1, 0.3], [0.2, 0.2]]])  # [n_ℓ, Hq, nq]
    rec = torch.tensor([[[0.8, 0.6], [0.7, 0.5]], [[0.9, 0.7], [1.0, 0.8]]])
    ell = {"selectivity": sel, "selectivity_with_window": sel, "recall": rec, "rel_error": 1 - rec}
    window = {"selectivity": torch.zeros(1, 2, 2), "selectivity_with_window": torch.zeros(1, 2, 2),
              "recall": torch.tensor([[[0.5, 0.4], [0.3, 0.3]]]), "rel_error": torch.zeros(1, 2, 2)}
    ev = LayerEvaluation(TOP_LS, {"saap": ell, "window": window}, torch.tensor([[300, 10], [400, 500]]))
    long = head_curves({1: ev}, 256, True)["saap"]["recall"]  # [1, n_ℓ, Hq]
    assert long[0].flatten().tolist() == pytest.approx([0.8, 0.6, 0.9, 0.9])  # [ℓ, head]; head 0: query 0 only
    short = head_curves({1: ev}, 256, False)["saap"]["recall"]
    assert short[0, :, 0].tolist() == pytest.approx([0.6, 0.7]) and torch.isnan(short[0, :, 1]).all()
    out = recall_by_query_range({1: ev}, 256, [0.02])
    assert out["long_range"]["fraction"] == 0.75 and out["short_range"]["fraction"] == 0.25
    # long: head 0 (0, .5) (.02, .8) -> .8; head 1 (0, .3) (.04, .6) -> .45; short: head 0 (0, .4) (.06, .6) -> 0.4667
    assert out["long_range"]["recall_at_sel0.02"]["saap"] == pytest.approx((0.8 + 0.45) / 2)
    assert out["short_range"]["recall_at_sel0.02"]["saap"] == pytest.approx(0.4 + 0.2 * 0.02 / 0.06)
    with pytest.raises(ValueError, match="no top-1 distances"):
        head_curves({1: LayerEvaluation(TOP_LS, ev.metrics)}, 256)


def test_moving_average_is_a_trailing_mean():
    x = np.array([1.0, 3.0, 5.0, 7.0])
    assert moving_average(x, 2).tolist() == [1.0, 2.0, 4.0, 6.0]


def test_json_safe_replaces_nan_for_strict_json():
    import json

    from calib.saap.report import json_safe

    out = json_safe({"a": [1.0, math.nan, [math.nan]], "b": "x"})
    assert json.dumps(out, allow_nan=False) == '{"a": [1.0, null, [null]], "b": "x"}'
