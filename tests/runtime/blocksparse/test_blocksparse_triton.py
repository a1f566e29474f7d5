"""Triton block-sparse attention vs the PyTorch reference (the definition of correct).

Unmarked tests run the kernel under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 without CUDA), on tiny shapes; ``gpu`` tests run the compiled kernel on CUDA at
realistic sizes in bf16/fp16.

Tolerances: on CPU the kernel computes in float32 (float32 inputs; bf16 inputs are computed in float32
by the wrapper because the interpreter cannot multiply bf16) and is compared with the float64 reference:
softmax over <= a few hundred keys in float32 is good to ~1e-6, so 1e-4 leaves room without hiding a
wrong element (a dropped or extra key changes outputs by ~1e-1). On the GPU the probabilities are rounded
to bf16/fp16 before ``P @ V`` and outputs are stored in bf16/fp16: bf16 keeps 8 mantissa bits (relative
rounding 4e-3 per element), so outputs of O(1) agree to ~1e-2; the checks use 2e-2 (bf16) and 1e-2 (fp16).
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.blocksparse import api
from runtime_kernels.blocksparse import reference as ref
from runtime_kernels.blocksparse.mask import BlockMask, causal_block_mask

tri = pytest.importorskip("runtime_kernels.blocksparse.triton")

# (B, Hq, Hkv, Tq, Tk, D, block_q, block_k)
CPU_SHAPES = [
    (1, 4, 1, 200, 200, 64, 64, 32),  # SALE blocks, odd length, GQA 4
    (1, 2, 2, 190, 190, 128, 64, 64),  # SampleAttention blocks, D 128, MHA
    (2, 4, 4, 130, 301, 64, 64, 32),  # chunked prefill (Tq < Tk), odd offsets, batch 2
    (1, 8, 2, 100, 100, 64, 16, 16),  # smallest blocks: four 16-key entries per 64-column tile
    (1, 2, 1, 300, 300, 64, 128, 16),  # 128-row query blocks
    (1, 2, 1, 257, 257, 64, 32, 128),  # key blocks wider than the tile (walked in halves)
    (1, 2, 2, 150, 150, 24, 64, 256),  # head dim not a power of two (padded), one 256-key block
]
IDS = [f"B{b}-H{h}-KV{kv}-Tq{tq}-Tk{tk}-D{d}-bq{bq}-bk{bk}" for b, h, kv, tq, tk, d, bq, bk in CPU_SHAPES]


def _inputs(b, hq, hkv, tq, tk, d, *, dtype=torch.float32, device="cpu", seed=0, dv=None):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, device=device) * 1.5  # peaky enough to exercise the max shift
    k = torch.randn(b, hkv, tk, d, generator=g, device=device)
    v = torch.randn(b, hkv, tk, dv or d, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _random_mask(b, hq, tq, tk, bq, bk, density, *, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(100 + seed)
    keep = torch.rand(b, hq, -(-tq // bq), -(-tk // bk), generator=g, device=device) < density
    return BlockMask.from_dense(keep, tq, tk, bq, bk)


def _reference(q, k, v, mask, **kw):
    """The reference in float64 (independent of the kernel's precision)."""
    return ref.block_sparse_attention(q.double(), k.double(), v.double(), mask, return_lse=True, **kw)


def _poisoned_call(q, k, v, mask, **kw):
    """Run the kernel into NaN-filled ``out``/``lse`` buffers: an element it forgets stays NaN."""
    b, hq, tq = q.shape[:3]
    out = torch.full((b, hq, tq, v.shape[-1]), math.nan, dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, tq), math.nan, dtype=torch.float32, device=q.device)
    tri.block_sparse_attention_into(q, k, v, mask, out, lse, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    return out, lse


def _assert_lse_close(lse, ref_lse, tol):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------- interpreter (CPU)
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=IDS)
def test_random_mask_matches_reference(shape):
    b, hq, hkv, tq, tk, d, bq, bk = shape
    q, k, v = _inputs(b, hq, hkv, tq, tk, d)
    mask = _random_mask(b, hq, tq, tk, bq, bk, 0.45)
    out, lse = _poisoned_call(q, k, v, mask)
    ref_out, ref_lse = _reference(q, k, v, mask)
    assert out.dtype == torch.float32 and out.shape == ref_out.shape
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    _assert_lse_close(lse, ref_lse, 1e-4)


@pytest.mark.parametrize("shape", [CPU_SHAPES[0], CPU_SHAPES[2]], ids=[IDS[0], IDS[2]])
def test_full_mask_equals_dense_causal(shape):
    b, hq, hkv, tq, tk, d, bq, bk = shape
    q, k, v = _inputs(b, hq, hkv, tq, tk, d, seed=1)
    out = tri.block_sparse_attention(q, k, v, BlockMask.full(b, hq, tq, tk, bq, bk))
    dense = ref.dense_causal_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), dense, rtol=1e-4, atol=1e-4)


def test_empty_and_partly_empty_rows():
    """Rows with nothing kept give 0 / -inf; rows of a block that only keeps a key block after them too."""
    b, hq, hkv, t, d, bq, bk = 1, 2, 1, 160, 64, 64, 32
    q, k, v = _inputs(b, hq, hkv, t, t, d, seed=2)
    keep = torch.zeros(b, hq, 3, 5, dtype=torch.bool)
    keep[0, 0, 0, 1] = True  # head 0, query block 0: only keys 32..63 -> rows 0..31 see nothing
    keep[0, 0, 2, :] = True  # head 0, query block 2: everything (ragged last query block)
    keep[0, 1, 1, 0] = True  # head 1, query block 1: only the sink block; query blocks 0, 2 empty
    mask = BlockMask.from_dense(keep, t, t, bq, bk)
    out, lse = _poisoned_call(q, k, v, mask)
    ref_out, ref_lse = _reference(q, k, v, mask)
    assert torch.all(out[0, 0, :32] == 0) and torch.all(lse[0, 0, :32] == -math.inf)
    assert torch.all(out[0, 1, :64] == 0) and torch.all(lse[0, 1, 128:] == -math.inf)
    assert torch.isfinite(lse[0, 0, 32:64]).all() and torch.isfinite(lse[0, 1, 64:128]).all()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    _assert_lse_close(lse, ref_lse, 1e-4)


def test_diagonal_only_and_sink_plus_diagonal_lists():
    """Lists made only of the causal tail (masked path alone) and of one far block + the tail."""
    b, hq, hkv, t, d, bq, bk = 1, 4, 4, 256, 64, 64, 32
    q, k, v = _inputs(b, hq, hkv, t, t, d, seed=3)
    nq, nk = t // bq, t // bk
    diag = torch.arange(nk)[None, :] // 2 == torch.arange(nq)[:, None]  # [NQ, NK] the block's own keys
    keep = diag.expand(b, hq, nq, nk).clone()
    keep[:, 2:, :, 0] = True  # heads 2, 3 also keep the sink block
    mask = BlockMask.from_dense(keep, t, t, bq, bk)
    out, lse = _poisoned_call(q, k, v, mask)
    ref_out, ref_lse = _reference(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    _assert_lse_close(lse, ref_lse, 1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)], ids=["bf16", "fp16"])
def test_half_precision_inputs_keep_dtype(dtype, tol):
    b, hq, hkv, tq, tk, d, bq, bk = CPU_SHAPES[0]
    q, k, v = _inputs(b, hq, hkv, tq, tk, d, dtype=dtype, seed=4)
    mask = _random_mask(b, hq, tq, tk, bq, bk, 0.5, seed=4)
    out, lse = tri.block_sparse_attention(q, k, v, mask, return_lse=True)
    ref_out, ref_lse = _reference(q, k, v, mask)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    _assert_lse_close(lse, ref_lse, tol)


def test_explicit_scale_non_contiguous_inputs_and_value_dim():
    """``scale`` is used; q/k/v in [B, T, H, D] memory layout; Dv != D."""
    b, hq, hkv, t, d, dv = 1, 4, 2, 150, 64, 32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, t, hq, d, generator=g).transpose(1, 2)  # [B, Hq, T, D] view, stride(2) = Hq * D
    k = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    v = torch.randn(b, t, hkv, dv, generator=g).transpose(1, 2)
    mask = _random_mask(b, hq, t, t, 64, 32, 0.6, seed=5)
    out, lse = _poisoned_call(q, k, v, mask, scale=0.3)
    ref_out, ref_lse = _reference(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    _assert_lse_close(lse, ref_lse, 1e-4)


def test_return_types_and_float64_delegation():
    q, k, v = _inputs(1, 2, 1, 70, 70, 64)
    mask = _random_mask(1, 2, 70, 70, 64, 32, 0.7)
    out = tri.block_sparse_attention(q, k, v, mask)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 70, 64)
    out64, lse64 = tri.block_sparse_attention(q.double(), k.double(), v.double(), mask, return_lse=True)
    assert out64.dtype == torch.float64 and lse64.dtype == torch.float64  # the reference's float64 path
    torch.testing.assert_close(out.double(), out64, rtol=1e-4, atol=1e-4)


def test_uncovered_inputs_run_the_reference():
    """Blocks that are not powers of two and a negative scale: same result as the reference."""
    q, k, v = _inputs(1, 2, 1, 96, 96, 64)
    for mask, scale in ((_random_mask(1, 2, 96, 96, 48, 24, 0.6), None), (BlockMask.full(1, 2, 96, 96, 64, 32), -0.2)):
        out = tri.block_sparse_attention(q, k, v, mask, scale=scale)
        expect = ref.block_sparse_attention(q, k, v, mask, scale=scale)
        torch.testing.assert_close(out, expect, rtol=0, atol=0)


def test_invalid_blocks_and_buffers_are_refused():
    q, k, v = _inputs(1, 2, 1, 96, 96, 64)
    out = torch.empty(1, 2, 96, 64)
    with pytest.raises(ValueError, match="power of two"):
        tri.block_sparse_attention_into(q, k, v, BlockMask.full(1, 2, 96, 96, 48, 32), out)
    with pytest.raises(ValueError, match="scale > 0"):
        tri.block_sparse_attention_into(q, k, v, BlockMask.full(1, 2, 96, 96, 64, 32), out, scale=-1.0)
    with pytest.raises(ValueError, match="mask is for"):
        tri.block_sparse_attention(q, k, v, BlockMask.full(1, 1, 96, 96, 64, 32))
    with pytest.raises(ValueError, match="out must be"):
        tri.block_sparse_attention_into(q, k, v, BlockMask.full(1, 2, 96, 96, 64, 32), torch.empty(1, 2, 96, 32))


def test_default_config_fits_every_block_shape():
    for bq in (16, 32, 64, 128, 256):
        for bk in (16, 32, 64, 128, 256):
            cfg = tri.default_config(bq, bk, 128, torch.bfloat16)
            assert bq % cfg.block_m == 0 and (cfg.block_n % bk == 0 or bk % cfg.block_n == 0)
    assert tri.default_config(64, 32, 128, torch.bfloat16) == tri.KernelConfig(64, 64, 4, 5)


def test_api_keeps_reference_on_cpu():
    q, k, v = _inputs(1, 2, 1, 70, 70, 64)
    assert api.resolve_backend(q) == "reference"
    assert api.resolve_backend(q, "triton") == "triton"  # importable here: explicit choice honoured


# ------------------------------------------------------------------------------------------------ GPU
def _sdpa_causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


GPU_CASES = [  # (Hq, Hkv, T, D, block_q, block_k, density)
    (8, 2, 4096, 128, 64, 32, 0.15),
    (8, 2, 8192, 128, 64, 64, 0.10),
    (4, 4, 4099, 64, 64, 32, 0.30),  # odd length, MHA, D 64
    (8, 2, 5001, 128, 64, 64, 0.50),
    (4, 1, 4096, 64, 128, 16, 0.20),
]
GPU_IDS = [f"H{h}-KV{kv}-T{t}-D{d}-{bq}x{bk}-p{p}" for h, kv, t, d, bq, bk, p in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_gpu_random_mask_matches_reference(case, dtype, tol):
    hq, hkv, t, d, bq, bk, density = case
    q, k, v = _inputs(1, hq, hkv, t, t, d, dtype=dtype, device="cuda")
    mask = _random_mask(1, hq, t, t, bq, bk, density, device="cuda")
    out, lse = _poisoned_call(q, k, v, mask)
    ref_out, ref_lse = ref.block_sparse_attention(q.float(), k.float(), v.float(), mask, return_lse=True)
    torch.testing.assert_close(out.float(), ref_out, rtol=tol, atol=tol)
    _assert_lse_close(lse, ref_lse.double(), 1e-3)  # lse from fp32 scores: tighter than the output


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("blocks", [(64, 32), (64, 64)], ids=["64x32", "64x64"])
def test_gpu_full_mask_matches_sdpa(blocks, dtype):
    hq, hkv, t, d = 16, 4, 6000, 128
    q, k, v = _inputs(1, hq, hkv, t, t, d, dtype=dtype, device="cuda", seed=7)
    out, _ = _poisoned_call(q, k, v, BlockMask.full(1, hq, t, t, *blocks, device="cuda"))
    torch.testing.assert_close(out.float(), _sdpa_causal(q, k, v).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_chunked_prefill_and_empty_rows():
    hq, hkv, tq, tk, d = 8, 2, 1000, 5003, 128
    q, k, v = _inputs(1, hq, hkv, tq, tk, d, dtype=torch.bfloat16, device="cuda", seed=8)
    keep = torch.rand(1, hq, -(-tq // 64), -(-tk // 32), device="cuda") < 0.2
    keep[0, 3] = False  # one head keeps nothing at all
    mask = BlockMask.from_dense(keep, tq, tk, 64, 32)
    out, lse = _poisoned_call(q, k, v, mask)
    ref_out, ref_lse = ref.block_sparse_attention(q.float(), k.float(), v.float(), mask, return_lse=True)
    assert torch.all(out[0, 3] == 0) and torch.all(lse[0, 3] == -math.inf)
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)
    _assert_lse_close(lse, ref_lse.double(), 1e-3)


@pytest.mark.gpu
def test_gpu_api_dispatches_to_triton():
    q, k, v = _inputs(1, 4, 1, 1024, 1024, 64, dtype=torch.bfloat16, device="cuda")
    mask = _random_mask(1, 4, 1024, 1024, 64, 32, 0.3, device="cuda")
    assert api.resolve_backend(q) == "triton"
    got = api.block_sparse_attention(q, k, v, mask)
    assert torch.equal(got, tri.block_sparse_attention(q, k, v, mask))  # same kernel, deterministic


@pytest.mark.gpu
def test_gpu_causal_block_table_matches_mask_full():
    """The kernel's diagonal split agrees with the mask module's causal rule at a ragged offset."""
    hq, hkv, tq, tk, d = 4, 4, 777, 2049, 64
    q, k, v = _inputs(1, hq, hkv, tq, tk, d, dtype=torch.float16, device="cuda", seed=9)
    mask = BlockMask.full(1, hq, tq, tk, 64, 32, device="cuda")
    assert torch.equal(mask.to_dense()[0, 0].cpu(), causal_block_mask(tq, tk, 64, 32))
    out, _ = _poisoned_call(q, k, v, mask)
    dense = ref.dense_causal_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), dense, rtol=1e-2, atol=1e-2)
