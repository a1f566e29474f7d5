"""The runtime entry point: bucket row by prompt length -> selection -> block-sparse attention."""

from __future__ import annotations

import math

import torch

from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.sampleattention import (
    BucketRow,
    BucketTable,
    sampleattention_prefill_attention,
    sampleattention_prefill_mask,
    sampleattention_select,
)


def masked_attention_f64(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Float64 brute force: softmax over ``allowed: [B, H, Sq, Sk]`` elements only."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


def qkv(s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, s, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, s, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, s, 16, generator=g, dtype=torch.float64)
    q[..., 0] += 3.0
    k[:, :, :3, 0] += 4.0
    return q, k, v


TABLE = BucketTable([100], [BucketRow(1.0, 1.0, 1), BucketRow(0.7, 0.6, 2)], blk=16, max_length=400)


def test_short_prompt_uses_dense_bucket() -> None:
    q, k, v = qkv(99)
    out = sampleattention_prefill_attention(q, k, v, TABLE, backend="reference")
    causal = torch.ones(99, 99, dtype=torch.bool).tril().expand(1, 4, 99, 99)
    torch.testing.assert_close(out.double(), masked_attention_f64(q, k, v, causal), rtol=1e-10, atol=1e-10)


def test_long_prompt_uses_its_bucket_row_and_mask() -> None:
    q, k, v = qkv(200, seed=1)
    mask = sampleattention_prefill_mask(q, k, TABLE)
    expected_mask = sampleattention_select(q, k, alpha_c=0.7, alpha_s=0.6, chunk_n=2, blk=16)
    assert isinstance(mask, BlockMask) and (mask.block_q, mask.block_k) == (16, 16)
    assert torch.equal(mask.to_dense(), expected_mask.to_dense())
    assert (mask.density() < 1).all()
    out = sampleattention_prefill_attention(q, k, v, TABLE, backend="reference")
    ref = masked_attention_f64(q, k, v, mask.token_mask())
    torch.testing.assert_close(out.double(), ref, rtol=1e-10, atol=1e-10)
