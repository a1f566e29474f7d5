"""Block-sparse attention reference vs float64 brute force (dense causal and masked softmax)."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.blocksparse import api
from runtime_kernels.blocksparse.mask import BlockMask, causal_block_mask
from runtime_kernels.blocksparse.reference import block_sparse_attention

# (B, Hq, Hkv, Tq, Tk, D, block_q, block_k)
SHAPES = [
    (1, 4, 2, 300, 300, 16, 64, 32),  # odd length, GQA 2
    (2, 2, 2, 128, 128, 8, 64, 32),  # exact multiples, MHA, batch 2
    (1, 8, 2, 37, 203, 24, 16, 16),  # decode-like tail: Tq < Tk, odd everything
    (1, 3, 1, 1, 77, 8, 64, 32),  # a single query (MQA)
    (1, 2, 1, 200, 200, 16, 32, 64),  # key blocks larger than query blocks
]
IDS = [f"B{b}-H{h}-KV{kv}-Tq{tq}-Tk{tk}-D{d}-bq{bq}-bk{bk}" for b, h, kv, tq, tk, d, bq, bk in SHAPES]


def _inputs(b, hq, hkv, tq, tk, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, d + 3, generator=g, dtype=torch.float64)  # Dv != D on purpose
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _bruteforce(q, k, v, elem_mask):
    """float64 masked softmax, written independently of the code under test; empty rows -> 0."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~elem_mask, -math.inf)
    lse = torch.logsumexp(s, -1)  # -inf on empty rows
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return p @ v, lse


def _causal(tq, tk):
    return torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq))[:, None]  # [Tq, Tk]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_full_mask_equals_dense_causal(shape):
    b, hq, hkv, tq, tk, d, bq, bk = shape
    q, k, v = _inputs(b, hq, hkv, tq, tk, d)
    mask = BlockMask.full(b, hq, tq, tk, bq, bk)
    out, lse = block_sparse_attention(q, k, v, mask, return_lse=True)
    ref, ref_lse = _bruteforce(q, k, v, _causal(tq, tk).expand(b, hq, tq, tk))
    assert out.dtype == torch.float64 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_random_mask_equals_bruteforce(shape, seed):
    b, hq, hkv, tq, tk, d, bq, bk = shape
    q, k, v = _inputs(b, hq, hkv, tq, tk, d, seed=seed)
    nq, nk = -(-tq // bq), -(-tk // bk)
    g = torch.Generator().manual_seed(100 + seed)
    keep = torch.rand(b, hq, nq, nk, generator=g) < 0.4
    keep[..., 0, :] = False  # first query block: only its diagonal-most causal key block
    last_k = (tk - tq + min(bq, tq) - 1) // bk
    keep[..., 0, last_k] = True
    mask = BlockMask.from_dense(keep, tq, tk, bq, bk)
    ref, ref_lse = _bruteforce(q, k, v, mask.token_mask())
    for chunk_elems in (1, 1 << 25):  # one query block per step; all query blocks at once
        out, lse = block_sparse_attention(q, k, v, mask, return_lse=True, chunk_elems=chunk_elems)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)


def test_query_block_grouping_respects_budget():
    from runtime_kernels.blocksparse.reference import _group_query_blocks

    assert _group_query_blocks([1, 2, 3, 4], per_slot=1, budget=6) == [(0, 2, 2), (2, 3, 3), (3, 4, 4)]
    assert _group_query_blocks([0, 0, 5], per_slot=10, budget=1) == [(0, 2, 0), (2, 3, 5)]  # empty rows cost 0
    assert _group_query_blocks([2, 2, 2], per_slot=1, budget=100) == [(0, 3, 2)]


def test_row_with_only_diagonal_block_attends_only_there():
    b, hq, hkv, t, d, bq, bk = 1, 2, 1, 256, 8, 64, 64
    q, k, v = _inputs(b, hq, hkv, t, t, d)
    keep = torch.eye(t // bq, dtype=torch.bool).expand(b, hq, -1, -1)  # only diagonal blocks
    out = block_sparse_attention(q, k, v, BlockMask.from_dense(keep, t, t, bq, bk))
    # query block 2 sees keys 128..(row) only: independent per-block dense causal attention
    blk = slice(128, 192)
    ref, _ = _bruteforce(q[:, :, blk], k[:, :, blk], v[:, :, blk], _causal(64, 64).expand(b, hq, 64, 64))
    torch.testing.assert_close(out[:, :, blk], ref, rtol=1e-10, atol=1e-12)


def test_empty_rows_give_zero_output_and_neg_inf_lse():
    q, k, v = _inputs(1, 2, 2, 100, 100, 8)
    keep = torch.ones(1, 2, 2, 4, dtype=torch.bool)
    keep[0, 1, 1] = False  # head 1, query block 1 keeps nothing
    out, lse = block_sparse_attention(q, k, v, BlockMask.from_dense(keep, 100, 100, 64, 32), return_lse=True)
    assert torch.all(out[0, 1, 64:] == 0) and torch.all(lse[0, 1, 64:] == -math.inf)
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, 0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs_keep_dtype_and_match_float64(dtype):
    b, hq, hkv, tq, tk, d, bq, bk = SHAPES[0]
    q, k, v = _inputs(b, hq, hkv, tq, tk, d, dtype=dtype)
    keep = torch.rand(b, hq, -(-tq // bq), -(-tk // bk), generator=torch.Generator().manual_seed(3)) < 0.5
    mask = BlockMask.from_dense(keep, tq, tk, bq, bk)
    out = block_sparse_attention(q, k, v, mask)
    ref, _ = _bruteforce(q, k, v, mask.token_mask())
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_explicit_scale_is_used():
    q, k, v = _inputs(1, 2, 2, 70, 70, 8)
    mask = BlockMask.full(1, 2, 70, 70, 32, 32)
    out = block_sparse_attention(q, k, v, mask, scale=0.5)
    ref, _ = _bruteforce(q * (0.5 * math.sqrt(8)), k, v, _causal(70, 70).expand(1, 2, 70, 70))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_mismatched_mask_is_refused():
    q, k, v = _inputs(1, 4, 2, 64, 64, 8)
    with pytest.raises(ValueError, match="mask is for"):
        block_sparse_attention(q, k, v, BlockMask.full(1, 2, 64, 64, 32, 32))  # heads = Hkv, not Hq
    with pytest.raises(ValueError, match="multiple"):
        block_sparse_attention(q[:, :3], k, v, BlockMask.full(1, 3, 64, 64, 32, 32))


def test_sparse_long_input_touches_only_kept_blocks():
    """8K tokens with a sink + diagonal mask: cheap because only kept blocks are gathered."""
    b, h, t, d, bq, bk = 1, 2, 8192, 16, 64, 32
    q, k, v = _inputs(b, h, h, t, t, d, dtype=torch.float32)
    nq, nk = t // bq, t // bk
    keep = torch.zeros(b, h, nq, nk, dtype=torch.bool)
    keep[..., 0] = True
    keep[..., torch.arange(nq), 2 * torch.arange(nq) + 1] = True
    keep[..., torch.arange(nq), 2 * torch.arange(nq)] = True
    mask = BlockMask.from_dense(keep, t, t, bq, bk)
    out = block_sparse_attention(q, k, v, mask)
    rows = slice(4096, 4160)  # query block 64, checked against brute force on its visible keys
    sub_mask = keep[..., 64, :130].repeat_interleave(bk, -1)[:, :, None, :] & _causal(t, t)[rows, :4160]
    ref, _ = _bruteforce(q[:, :, rows], k[:, :, :4160], v[:, :, :4160], sub_mask)
    torch.testing.assert_close(out[:, :, rows].double(), ref, rtol=1e-5, atol=1e-5)


def test_api_dispatch_uses_reference_on_cpu():
    q, k, v = _inputs(1, 2, 2, 70, 70, 8)
    mask = BlockMask.full(1, 2, 70, 70, 32, 32)
    assert api.resolve_backend(q) == "reference"
    torch.testing.assert_close(api.block_sparse_attention(q, k, v, mask), block_sparse_attention(q, k, v, mask))
    with pytest.raises(ValueError, match="unknown backend"):
        api.block_sparse_attention(q, k, v, mask, backend="cuda")  # type: ignore[arg-type]
    if api._triton_module() is None:
        with pytest.raises(RuntimeError, match="not importable"):
            api.block_sparse_attention(q, k, v, mask, backend="triton")


def test_full_mask_matches_causal_block_mask():
    mask = BlockMask.full(2, 3, 37, 203, 16, 16)
    assert torch.equal(mask.to_dense(), causal_block_mask(37, 203, 16, 16).expand(2, 3, -1, -1))
    assert torch.all(mask.density() == 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_is_proportional_to_kept_blocks():
    b, h, t, d, bq, bk = 1, 8, 32768, 64, 64, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    nq, nk = t // bq, t // bk
    keep = torch.zeros(b, h, nq, nk, dtype=torch.bool, device="cuda")
    keep[..., :1] = True
    idx = torch.arange(nq, device="cuda")
    for off in range(-6, 2):
        keep[..., idx, (2 * idx + off).clamp(min=0)] = True
    mask = BlockMask.from_dense(keep, t, t, bq, bk)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = block_sparse_attention(q, k, v, mask)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 0.05 * b * h * t * t * 4  # far below one float32 [Tq, Tk] score matrix per head
    rows = slice(t - 64, t)  # last query block; its element mask built without the [Tq, Tk] table
    elem = keep[..., -1, :].repeat_interleave(bk, -1)[:, :, None, :].cpu() & _causal(t, t)[rows]
    ref, _ = _bruteforce(q[:, :, rows].cpu(), k.cpu(), v.cpu(), elem)
    torch.testing.assert_close(out[:, :, rows].double().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_over_allocated_indices_mean_the_same_mask():
    """A sync-free GPU selector sizes ``indices`` for every causal block; only ``indices[:offsets[-1]]``
    counts, so trailing garbage changes neither the block table nor the attention."""
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(1, 2, 3, 6, generator=g) < 0.5
    exact = BlockMask.from_dense(keep, 96, 96, 32, 16)
    padded = BlockMask(exact.offsets, torch.cat([exact.indices, torch.full((7,), 3, dtype=torch.int32)]),
                       1, 2, 96, 96, 32, 16)
    assert torch.equal(padded.to_dense(), exact.to_dense())
    q, k, v = (torch.randn(1, 2, 96, 8, generator=g, dtype=torch.float64) for _ in range(3))
    assert torch.equal(block_sparse_attention(q, k, v, padded), block_sparse_attention(q, k, v, exact))
