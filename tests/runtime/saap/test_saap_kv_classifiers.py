"""SAAP with one query classifier per KV head (arXiv:2502.08246, §5, batched queries): the group's query
heads share one MLP, so a step reads 1/G of the per-query-head classifier weights.

Checked against an independent float64 evaluation (each query head through its KV head's MLP), against
the same classifiers stored once per query head (expanded: the per-query-head code path), and the Triton
classifier and decode kernels (interpreter on the CPU, NaN-poisoned outputs) against the reference.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime_kernels.saap import SaapLayerParams, classify_queries, rank_buckets
from runtime_kernels.saap.reference import classifier_rows, query_head_logits

CLASSIFIER_FIELDS = tuple(n for n in SaapLayerParams.TENSOR_FIELDS if n != "centroids")


def _per_query_head(p: SaapLayerParams, group: int) -> SaapLayerParams:
    """The same classifiers stored once per query head (query head h holds classifier h // group)."""
    return replace(p, **{n: getattr(p, n).repeat_interleave(group, 0) for n in CLASSIFIER_FIELDS})


def _per_kv_head(p: SaapLayerParams, group: int) -> SaapLayerParams:
    """Classifier ``c``: query head ``c·group``'s (a per-KV-head layer made from a per-query-head one)."""
    return replace(p, **{n: getattr(p, n)[::group].contiguous() for n in CLASSIFIER_FIELDS})


def _logits64(qd: torch.Tensor, p: SaapLayerParams) -> torch.Tensor:
    """Float64 logits ``[B, Hq, C]``: query head ``h`` through MLP ``h // G``, written out per head."""
    b, hq, _ = qd.shape
    g = hq // p.num_classifiers
    out = []
    for h in range(hq):
        c = h // g
        x = qd[:, h].double() @ p.w1[c].double() + p.b1[c].double()
        x = (x - p.bn_mean[c].double()) / torch.sqrt(p.bn_var[c].double() + p.bn_eps) * p.bn_weight[c].double()
        x = torch.relu(x + p.bn_bias[c].double())
        out.append(x @ p.w2[c].double() + p.b2[c].double())
    return torch.stack(out, 1)


def test_rows_layout_round_trips_and_groups_each_kv_heads_queries():
    q = torch.arange(2 * 6 * 1, dtype=torch.float32).view(2, 6, 1)  # B = 2, Hq = 6, D = 1: value = b·6 + h
    rows = classifier_rows(q, 2)  # Hc = 2, G = 3
    assert rows.shape == (6, 2, 1)
    # classifier 1 (query heads 3, 4, 5) sees row b·3 + g = query head 3 + g of row b
    assert rows[:, 1, 0].tolist() == [3.0, 4.0, 5.0, 9.0, 10.0, 11.0]
    assert torch.equal(query_head_logits(rows, 2), q)
    assert torch.equal(classifier_rows(q, 6), q)  # one classifier per query head: the identity


def test_a_classifier_per_kv_head_equals_float64_and_its_per_query_head_copy():
    from tests.runtime.saap.test_saap_reference import _params

    p = _per_kv_head(_params(8, 2, 16, 12, 24, 1, 8, seed=3), 4)
    qd = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(4))
    probs = classify_queries(qd, p)
    assert p.num_classifiers == 2 and probs.shape == (3, 8, 12)
    assert torch.allclose(probs.double(), torch.softmax(_logits64(qd, p), -1), atol=1e-6)
    assert torch.allclose(probs, classify_queries(qd, _per_query_head(p, 4)), atol=1e-6)


def test_classifier_counts_must_be_a_multiple_of_the_kv_heads():
    from tests.runtime.saap.test_saap_reference import _params

    p = _params(8, 4, 16, 12, 24, 1, 8)
    with pytest.raises(ValueError, match="shapes disagree"):
        replace(p, **{n: getattr(p, n)[:2] for n in CLASSIFIER_FIELDS})  # 2 classifiers for 4 KV heads


triton_mod = pytest.importorskip("runtime_kernels.saap.triton")
tconf = pytest.importorskip("runtime_kernels.saap.triton_config")


@pytest.fixture
def small_tiles(monkeypatch):
    """NaN-poisoned buffers and tiles small enough to walk several of each (tests/runtime/saap/test_saap_triton.py)."""
    from tests.runtime.saap.test_saap_triton import SMALL_TILES

    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, poison=True, **SMALL_TILES))
    return monkeypatch


@pytest.mark.parametrize("small_max_b", [0, 16], ids=["large-batch", "small-batch"])
@pytest.mark.parametrize("b", [1, 3])
def test_triton_classifier_per_kv_head_matches_float64_and_ranks_like_the_reference(b, small_max_b, small_tiles):
    from tests.runtime.saap.test_saap_triton import PROB_ATOL, _case

    small_tiles.setattr(tconf, "CONFIG", replace(tconf.CONFIG, small_batch_max_b=small_max_b))
    _, qd, _, _, p, _ = _case(b, 6, 2, 40, 64, 20, 1, 8)
    p = _per_kv_head(p, 3)
    logits = triton_mod.saap_classifier_logits_triton(qd, p)
    assert logits.shape == (b, 6, 20)
    ref = torch.softmax(_logits64(qd.cpu(), p.to("cpu")), -1)
    assert torch.allclose(torch.softmax(logits.double(), -1).cpu(), ref, atol=PROB_ATOL)
    for top_l in (1, 5, 20):
        want = rank_buckets(classify_queries(qd, p), 3, top_l).sort(-1).values
        got = triton_mod.saap_select_buckets_triton(qd, p, 3, top_l)
        assert torch.equal(got.long().sort(-1).values, want)


@pytest.mark.parametrize("structured", [False, True], ids=["random", "structured"])
def test_triton_decode_step_with_kv_head_classifiers_matches_the_reference(structured, small_tiles):
    from tests.runtime.saap.test_saap_triton import TOL32, _case, _ref, _row_rel_err

    q, qd, k, v, p, idx = _case(3, 8, 2, 157, 64, 7, 2, 21, structured=structured)
    p = _per_kv_head(p, 4)
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=2, scale=None)
    assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, 2)) < TOL32
