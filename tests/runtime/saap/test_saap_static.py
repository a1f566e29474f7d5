"""SAAP on a static-cache view: the valid length on the device, an index that lags the cache.

The Triton kernel (interpreter on CPU) gets ``k, v`` longer than the valid keys, NaN past them, and
``cache_len``; it must equal the reference on the exact slice. With every bucket visited the result is
plain attention over the valid keys, whether the index is up to date or lags (float64 reference).
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.saap import BucketIndex, SaapLayerParams, saap_decode_attention
from runtime_kernels.saap.reference import dense_decode_attention, saap_decode_attention_reference

triton_mod = pytest.importorskip("runtime_kernels.saap.triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, HQ, HKV, D, C, SINK, RECENT = 2, 4, 2, 16, 8, 1, 24


def _params(seed: int = 0) -> SaapLayerParams:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return SaapLayerParams(sink=SINK, recent=RECENT, centroids=r(HKV, C, D), w1=r(HQ, D, 32) / math.sqrt(D),
                           b1=r(HQ, 32) * 0.1, bn_mean=r(HQ, 32) * 0.1, bn_var=torch.rand(HQ, 32, generator=g) + 0.5,
                           bn_weight=r(HQ, 32), bn_bias=r(HQ, 32) * 0.1, w2=r(HQ, 32, C) * 0.5,
                           b2=r(HQ, C) * 0.1).to(DEV)


def _case(valid: int, view: int, indexed: int, seed: int = 1):
    """q, q_derope, k, v (``view`` keys, NaN past ``valid``), params, an index of the first ``indexed``."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    p = _params()
    q, qd = rn(B, HQ, D), rn(B, HQ, D)
    k, v = rn(B, HKV, view, D), rn(B, HKV, view, D)
    k[:, :, valid:], v[:, :, valid:] = float("nan"), float("nan")
    idx = BucketIndex.build(k[:, :, :indexed], p.centroids, sink=SINK, recent=RECENT)
    return q, qd, k, v, p, idx


@pytest.mark.parametrize("valid,view,indexed", [(150, 160, 150), (150, 192, 131), (97, 128, 64)],
                         ids=["T150-view160-current", "T150-view192-lag19", "T97-view128-lag33"])
@pytest.mark.parametrize("top_l", [2, C], ids=["l2", "lC"])
def test_kernel_on_a_view_equals_reference_on_the_slice(valid: int, view: int, indexed: int, top_l: int):
    q, qd, k, v, p, idx = _case(valid, view, indexed)
    length = torch.full((B,), valid, dtype=torch.long, device=DEV)
    got = saap_decode_attention(q, k, v, idx, p, top_l=top_l, q_derope=qd, impl="triton", cache_len=length)
    want = saap_decode_attention_reference(q, qd, k[:, :, :valid], v[:, :, :valid], idx, p, top_l)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_dense_layer_on_a_view_is_flash_decoding_over_the_valid_keys():
    q, _, k, v, _, _ = _case(150, 192, 150)
    dense = SaapLayerParams(sink=SINK, recent=RECENT, dense=True)
    length = torch.full((B,), 150, dtype=torch.long, device=DEV)
    got = saap_decode_attention(q, k, v, None, dense, top_l=1, impl="triton", cache_len=length)
    want = dense_decode_attention(q.double(), k[:, :, :150].double(), v[:, :, :150].double(), D ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("indexed", [150, 126, 60], ids=["current", "lag24", "lag90"])
def test_every_bucket_with_a_lagging_index_is_dense_attention(indexed: int):
    """Keys past the index's lists are attended with the window, none twice, none missed (float64)."""
    q, qd, k, v, p, idx = _case(150, 150, indexed)
    q, k, v = q.double(), k.double(), v.double()
    got = saap_decode_attention_reference(q, qd, k, v, idx, p, C)
    torch.testing.assert_close(got, dense_decode_attention(q, k, v, D ** -0.5), atol=1e-6, rtol=0)


def test_an_index_ahead_of_the_cache_is_refused():
    q, qd, k, v, p, idx = _case(150, 150, 150)
    with pytest.raises(ValueError, match="does not fit a cache of 120 keys"):
        saap_decode_attention_reference(q, qd, k[:, :, :120], v[:, :, :120], idx, p, 2)


def test_bf16_classifier_weights_rank_like_float32():
    """The serving dtype (hf.apply converts w1, w2 to the model's bf16): the group scores' top-ℓ keeps
    at least 90 % of the float32 choice over 64 random queries; ties decide the rest."""
    from runtime_kernels.saap.reference import classify_queries, rank_buckets

    p = _params()
    p16 = p.to(DEV, weight_dtype=torch.bfloat16)
    assert p16.w1.dtype == p16.w2.dtype == torch.bfloat16 and p16.b1.dtype == torch.float32
    qd = torch.randn(64, HQ, D, generator=torch.Generator().manual_seed(3)).to(DEV)
    a = rank_buckets(classify_queries(qd, p), HQ // HKV, 3)
    b = rank_buckets(classify_queries(qd.bfloat16(), p16), HQ // HKV, 3)
    same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean()  # fraction of float32 choices kept
    assert float(same) >= 0.9
