"""SAAP's classifier de-RoPEs the decode query as it loads it (``query_rotation``): the RoPE'd query and its
position's coefficients (:func:`runtime_kernels.rope.derope_coefficients`) in, the logits of the
de-RoPE'd query out, with no launch of its own.

Queries are made here as the model makes them: a pre-RoPE vector rotated in float64 at each batch row's own
position (HF's layout, attention scaling 1.1). The Triton classifier (interpreter on the CPU, NaN-poisoned
buffers) is checked against a float64 MLP of the pre-RoPE query, and against the reference on
:func:`reference.classifier_input` (bit for bit the same input in the interpreter); the decode step
against the reference given the pre-RoPE query.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime_kernels.rope import derope_coefficients, rotate_half
from runtime_kernels.saap import classify_queries, rank_buckets, saap_decode_attention
from runtime_kernels.saap.reference import classifier_input
from tests.runtime.saap.test_saap_kv_classifiers import _logits64, _per_kv_head

triton_mod = pytest.importorskip("runtime_kernels.saap.triton")
tconf = pytest.importorskip("runtime_kernels.saap.triton_config")
from tests.runtime.saap.test_saap_triton import PROB_ATOL, SMALL_TILES, TOL32, _case, _ref, _row_rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _poisoned_small_tiles(monkeypatch):
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, poison=True, **SMALL_TILES))


def _rotated(pre: torch.Tensor, positions: torch.Tensor, scaling: float = 1.1):
    """``pre [B, H, D]`` RoPE'd at row b's position in float64 (HF layout: the halves share frequencies,
    times ``scaling``) -> (the RoPE'd query in ``pre``'s dtype, de-RoPE coefficients ``[B, 2, D]``)."""
    d = pre.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double().to(pre.device)[:, None] * inv.to(pre.device)
    cos, sin = (torch.cat([f(ang), f(ang)], -1) * scaling for f in (torch.cos, torch.sin))  # [B, D]
    x = pre.double()
    post = x * cos[:, None] + rotate_half(x) * sin[:, None]
    return post.to(pre.dtype), derope_coefficients(cos.float(), sin.float())


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, D]`` as a view whose batch stride is smaller than its head stride (HF's layouts vary)."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
@pytest.mark.parametrize("small_max_b", [0, 16], ids=["large-batch", "small-batch"])
@pytest.mark.parametrize("group", [1, 3], ids=["per-query-head", "per-kv-head"])
def test_classifier_on_the_rotated_query_equals_it_on_the_derope_query(group, small_max_b, wdtype, monkeypatch):
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, small_batch_max_b=small_max_b))
    b, hq = 3, 6
    _, pre, _, _, p, _ = _case(b, hq, 2, 40, 64, 20, 1, 8, wdtype=wdtype)
    if group > 1:
        p = _per_kv_head(p, group)
    post, rot = _rotated(pre, torch.tensor([5, 700, 31000]))
    post = _strided(post)
    logits = triton_mod.saap_classifier_logits_triton(post, p, rot)
    assert logits.shape == (b, hq, 20) and not logits.isnan().any()
    # the reference on the same de-RoPE'd, weight-dtype input
    want = classify_queries(classifier_input(post, rot, p), p)
    assert torch.allclose(torch.softmax(logits, -1), want, atol=PROB_ATOL)
    if wdtype == torch.float32:  # no rounding to the weights' dtype: the float64 MLP of the true query
        ref64 = torch.softmax(_logits64(pre.cpu(), p.to("cpu")), -1)
        assert torch.allclose(torch.softmax(logits.double(), -1).cpu(), ref64, atol=1e-5)
    hkv_group = hq // 2
    for top_l in (1, 5):
        got = triton_mod.saap_select_buckets_triton(post, p, hkv_group, top_l, rot)
        assert torch.equal(got.long().sort(-1).values, rank_buckets(want, hkv_group, top_l).sort(-1).values)


@pytest.mark.parametrize("group", [1, 4], ids=["per-query-head", "per-kv-head"])
@pytest.mark.parametrize("structured", [False, True], ids=["random", "structured"])
def test_decode_step_on_the_rotated_query_matches_the_reference_on_the_true_one(structured, group):
    _, pre, k, v, p, idx = _case(3, 8, 2, 157, 64, 7, 2, 21, structured=structured)
    if group > 1:
        p = _per_kv_head(p, group)
    q, rot = _rotated(pre, torch.tensor([157, 90, 4000]))  # the attention's query is the RoPE'd one
    out = triton_mod.saap_decode_attention_triton(q, None, k, v, idx, p, top_l=2, query_rotation=rot)
    ref = _ref(q, pre, k, v, idx, p, 2)
    assert _row_rel_err(out, ref) < TOL32
    # the public entry point's reference path de-RoPEs the same way
    api_ref = saap_decode_attention(q, k, v, idx, p, top_l=2, query_rotation=rot, impl="reference")
    assert _row_rel_err(api_ref, ref) < TOL32


def test_exactly_one_classifier_input_and_a_well_formed_rotation():
    q, qd, k, v, p, idx = _case(2, 4, 2, 60, 64, 5, 1, 8)
    _, rot = _rotated(qd, torch.tensor([3, 9]))
    with pytest.raises(ValueError, match="exactly one of q_derope and query_rotation"):
        saap_decode_attention(q, k, v, idx, p, top_l=2, q_derope=qd, query_rotation=rot, impl="triton")
    with pytest.raises(ValueError, match="exactly one of q_derope and query_rotation"):
        saap_decode_attention(q, k, v, idx, p, top_l=2, impl="reference")
    with pytest.raises(ValueError, match=r"query_rotation must be \[B, 2, D\]"):
        triton_mod.saap_classifier_logits_triton(q, p, rot[:, :, :32])
    with pytest.raises(ValueError, match=r"query_rotation must be \[B, 2, D\]"):
        triton_mod.saap_classifier_logits_triton(q, p, rot.double())
