"""SAAP decode attention reference: exact merge, dense equivalence, brute-force selection, dispatch."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from runtime_kernels.saap import (
    BucketIndex,
    SaapLayerParams,
    classify_queries,
    merge_partials,
    partial_attention,
    rank_buckets,
    saap_decode_attention,
    saap_decode_attention_reference,
)


def _params(hq, hkv, d, c, hd, sink, recent, seed=0) -> SaapLayerParams:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return SaapLayerParams(sink=sink, recent=recent, centroids=r(hkv, c, d), w1=r(hq, d, hd) / math.sqrt(d),
                           b1=r(hq, hd) * 0.1, bn_mean=r(hq, hd) * 0.1, bn_var=torch.rand(hq, hd, generator=g) + 0.5,
                           bn_weight=r(hq, hd), bn_bias=r(hq, hd) * 0.1, w2=r(hq, hd, c) / math.sqrt(hd),
                           b2=r(hq, c) * 0.1)


def _case(b, hq, hkv, t, d, c, sink, recent, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    q, qd = torch.randn(b, hq, d, generator=g), torch.randn(b, hq, d, generator=g)
    k, kd, v = (torch.randn(b, hkv, t, d, generator=g) for _ in range(3))
    params = _params(hq, hkv, d, c, 16, sink, recent, seed)
    return q, qd, k, kd, v, params, BucketIndex.build(kd, params.centroids, sink=sink, recent=recent)


def _dense64(q, k, v, keep=None):
    """float64 softmax attention, GQA, optional boolean key mask [B, Hkv, G?, T] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("bhgd,bhtd->bhgt", q.double().view(b, hkv, hq // hkv, d), k.double()) / math.sqrt(d)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) @ v.double()).view(b, hq, d)


SHAPES = [(1, 8, 2, 300, 16, 8), (2, 4, 4, 97, 8, 5), (3, 6, 2, 129, 32, 16)]
IDS = [f"B{b}-Hq{hq}-Hkv{hkv}-T{t}-D{d}-C{c}" for b, hq, hkv, t, d, c in SHAPES]


@pytest.mark.parametrize("b,hq,hkv,t,d,c", SHAPES, ids=IDS)
def test_all_buckets_equal_dense(b, hq, hkv, t, d, c):
    q, qd, k, kd, v, params, idx = _case(b, hq, hkv, t, d, c, sink=1, recent=17)
    out = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=c)
    assert torch.allclose(out.double(), _dense64(q, k, v), atol=1e-5, rtol=1e-5)
    out = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=10 * c)  # ℓ > C clamps
    assert torch.allclose(out.double(), _dense64(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b,hq,hkv,t,d,c", SHAPES, ids=IDS)
@pytest.mark.parametrize("top_l", [1, 3])
def test_matches_brute_force_selection(b, hq, hkv, t, d, c, top_l):
    sink, recent = 2, 11
    q, qd, k, kd, v, params, idx = _case(b, hq, hkv, t, d, c, sink, recent)
    # independent selection: nearest centroid in float64, group-summed probabilities, set membership
    bucket = ((kd.double().unsqueeze(-2) - params.centroids.double()[None, :, None]) ** 2).sum(-1).argmin(-1)
    probs = classify_queries(qd, params).view(b, hkv, hq // hkv, c).sum(2)  # [B, Hkv, C]
    top = probs.topk(top_l, -1).indices  # [B, Hkv, ℓ]
    pos = torch.arange(t)
    in_top = (bucket.unsqueeze(-1) == top.unsqueeze(2)).any(-1)  # [B, Hkv, T]
    keep = (pos < sink) | (pos >= t - recent) | in_top
    expect = _dense64(q, k, v, keep.unsqueeze(2))
    out = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=top_l)
    assert torch.allclose(out.double(), expect, atol=1e-5, rtol=1e-5)


def test_last_bucket_is_visited():
    """Alg. 2's `ℓ > b_i > 0` would skip bucket ℓ: with ℓ = 1 the one chosen bucket must count."""
    q, qd, k, kd, v, params, idx = _case(1, 4, 1, 200, 8, 4, sink=1, recent=5)
    window_only = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=0)
    one = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=1)
    assert not torch.allclose(one, window_only)


def test_short_cache_is_dense_and_dense_layer():
    q, qd, k, kd, v, params, idx = _case(2, 4, 2, 12, 8, 4, sink=1, recent=20)  # T < window
    out = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=2)
    assert torch.allclose(out.double(), _dense64(q, k, v), atol=1e-6)
    dense = SaapLayerParams(sink=1, recent=3, dense=True)
    q, qd, k, kd, v, _, _ = _case(2, 4, 2, 100, 8, 4, sink=1, recent=3)
    out = saap_decode_attention(q, k, v, None, dense, top_l=2)
    assert torch.allclose(out.double(), _dense64(q, k, v), atol=1e-6)


def test_merge_partials_equals_softmax_over_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 8, generator=g), torch.randn(50, 8, generator=g) * 3, torch.randn(50, 8, generator=g)
    split = [torch.arange(0, 7), torch.arange(7, 7), torch.arange(7, 30), torch.arange(30, 50)]  # one empty
    parts = [partial_attention(q, k[s], v[s], torch.ones(len(s), dtype=torch.bool), 0.3) for s in split]
    o = torch.stack([p[0] for p in parts], -2)  # [3, P, D]
    m = torch.stack([p[1] for p in parts], -1)  # [3, P]
    s = torch.stack([p[2] for p in parts], -1)
    out, lse = merge_partials(o, m, s)
    scores = (q.double() @ k.double().T) * 0.3
    assert torch.allclose(out.double(), torch.softmax(scores, -1) @ v.double(), atol=1e-6)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-5)


def test_rank_buckets_sums_the_group():
    # 2 KV heads x group 2; bucket 2 is never any head's argmax but wins the group sum of KV head 0
    probs = torch.tensor([[[0.5, 0.0, 0.45, 0.05], [0.0, 0.5, 0.45, 0.05],
                           [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]]])
    top = rank_buckets(probs, group=2, top_l=2)
    assert top.shape == (1, 2, 2)
    assert top[0, 0, 0] == 2 and set(top[0, 0].tolist()) <= {0, 1, 2}
    assert top[0, 1].tolist() == [3, 2]


def test_params_roundtrip_and_validation():
    p = _params(4, 2, 8, 5, 16, 1, 7)
    t = p.to_tensors("layers.3.")
    assert set(t) == {"layers.3." + n for n in SaapLayerParams.TENSOR_FIELDS}
    p2 = SaapLayerParams.from_tensors(t, sink=1, recent=7, prefix="layers.3.")
    q = torch.randn(2, 4, 8)
    assert torch.equal(classify_queries(q, p), classify_queries(q, p2))
    with pytest.raises(ValueError, match="lacks tensors"):
        SaapLayerParams(sink=1, recent=7, centroids=p.centroids)
    with pytest.raises(ValueError, match="sink"):
        SaapLayerParams(sink=0, recent=0, dense=True)


def test_dispatch():
    q, qd, k, kd, v, params, idx = _case(1, 4, 2, 64, 8, 4, sink=1, recent=5)
    ref = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=2)
    assert torch.equal(saap_decode_attention(q, k, v, idx, params, top_l=2, q_derope=qd), ref)
    with pytest.raises(ValueError, match="q_derope"):
        saap_decode_attention(q, k, v, idx, params, top_l=2)
    with pytest.raises(ValueError, match="covers"):
        saap_decode_attention(q, k[:, :, :-1], v[:, :, :-1], idx, params, top_l=2, q_derope=qd)


def test_import_is_light():
    code = ("import sys, runtime_kernels.saap; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('calib', 'hydra', 'mlflow', 'faiss')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
