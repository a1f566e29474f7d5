"""The CRA the runtime reports from Stage 1's per-row block masses equals the exact CRA on the sampled rows."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.sampleattention.api import SampleAttentionPrefill
from runtime_kernels.sampleattention.buckets import BucketRow
from runtime_kernels.sampleattention.reference import (cumulative_residual_attention, sample_scores,
                                                       sampled_cra, sampled_query_rows, stage1_reductions,
                                                       stage1_row_reductions)


def _qk(b: int, hq: int, hkv: int, sq: int, sk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, 16, generator=g, dtype=torch.float64) * 2,
            torch.randn(b, hkv, sk, 16, generator=g, dtype=torch.float64) * 2)


@pytest.mark.parametrize("b, hq, hkv, sq, sk, chunk_n", [(1, 4, 2, 200, 200, 3), (2, 2, 1, 97, 130, 1)])
def test_row_masses_give_the_exact_cra_of_any_mask(b, hq, hkv, sq, sk, chunk_n):
    q, k = _qk(b, hq, hkv, sq, sk, seed=sq)
    blk = 16
    column, slash, row_mass = stage1_row_reductions(q, k, chunk_n=chunk_n, blk=blk)
    rows, probs = sample_scores(q, k, chunk_n=chunk_n, blk=blk)  # [B, Hq, R, Sk], materialized
    pad = torch.nn.functional.pad(probs, (0, row_mass.shape[-1] * blk - sk))
    torch.testing.assert_close(row_mass, pad.view(*probs.shape[:3], -1, blk).sum(-1))  # by definition
    ref_column, ref_slash = stage1_reductions(q, k, chunk_n=chunk_n, blk=blk)
    torch.testing.assert_close(column, ref_column)
    torch.testing.assert_close(slash, ref_slash)
    g = torch.Generator().manual_seed(1)
    nq, nk = -(-sq // blk), -(-sk // blk)
    for density in (0.2, 0.6, 1.0):
        mask = BlockMask.from_dense(torch.rand(b, hq, nq, nk, generator=g) < density, sq, sk, blk, blk)
        want = cumulative_residual_attention(q, k, mask, rows)
        torch.testing.assert_close(sampled_cra(mask, rows, row_mass), want, rtol=1e-12, atol=1e-12)


def test_prefill_reports_the_exact_sampled_cra():
    q, k = _qk(1, 4, 2, 256, 256, seed=3)
    v = torch.randn(1, 2, 256, 16, dtype=torch.float64)
    row = BucketRow(0.9, 0.9, 2)
    rt = SampleAttentionPrefill(row, blk=32)
    rt.prefill(0, q, k, v, scale=0.25)
    stats = rt.pop_stats()
    from runtime_kernels.sampleattention.reference import sampleattention_select

    mask = sampleattention_select(q, k, alpha_c=0.9, alpha_s=0.9, chunk_n=2, blk=32, scale=0.25)
    cra = cumulative_residual_attention(q, k, mask, sampled_query_rows(256, 2, 32), scale=0.25)
    assert stats["cra"] == pytest.approx(float(cra.mean()), rel=1e-9)
    assert stats["cra_min"] == pytest.approx(float(cra.min()), rel=1e-9)
    assert stats["density"] == pytest.approx(float(mask.density().mean()), rel=1e-12)
