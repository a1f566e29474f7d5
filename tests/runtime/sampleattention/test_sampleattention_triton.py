"""SampleAttention's Triton Stage 1 / Stage 2 vs the PyTorch reference (the definition of correct).

Unmarked tests run the kernels on CPU tensors under TRITON_INTERPRET=1 on tiny shapes (odd lengths,
overlapping slices, GQA 1/2/4, head_dim 64/128), with poisoned buffers (``POISON``: NaN statistics, -1
counts / indices) so an entry the kernels do not write fails. Masks must equal the reference's exactly,
except in a (batch, head) whose selection float rounding may flip: the reference's cumulative mass lies
within ``TIE_TOL`` of alpha, or the two masses straddling the cut agree to ``TIE_REL`` (relative).
``gpu`` tests repeat this at 8k-32k in bf16 / fp16 on structured inputs and check no host sync happens.
"""

from __future__ import annotations

import math

import pytest
import torch

triton_mod = pytest.importorskip("runtime_kernels.sampleattention.triton")

from runtime_kernels.blocksparse.mask import BlockMask  # noqa: E402
from runtime_kernels.sale.triton import block_table  # noqa: E402
from runtime_kernels.sampleattention import api, reference  # noqa: E402
from runtime_kernels.sampleattention.buckets import BucketRow  # noqa: E402

# Masses are normalized float32 sums; kernel and reference differ only in float32 rounding of exp, the
# softmax normalizer (split-combined here) and summation order: ~1e-7 relative per element.
MASS_ATOL = 2e-6
TIE_TOL = 1e-5  # cumulative mass this close to alpha: the cut may move
TIE_REL = 1e-5  # two masses at the cut this close (relative; rounding is ~1e-6): the pick may swap
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the unmarked tests run compiled on a GPU machine


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.setattr(triton_mod, "POISON", True)
    import runtime_kernels.sale.triton as sale_triton

    monkeypatch.setattr(sale_triton, "POISON", True)


def _qk(b, hq, hkv, sq, sk, d, *, seed=0, dtype=torch.float32, device=None):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g)
    return q.to(dtype).to(device or DEV), k.to(dtype).to(device or DEV)


def structured_qkv(t, hq=8, hkv=2, d=128, *, seed=0, dtype=torch.bfloat16, device=None, peak=12.0):
    """Concentrated attention: random Fourier positional features with Cauchy frequencies, so that
    ``q_i . k_j ~ exp(-|i - j| / 64)`` (a local band of ``peak`` nats: slashes), a sink (first 4 keys) and
    retrieval stripes (t/1024 planted keys the even heads look up: columns), a shared key offset.
    With alpha = 0.95 the reference keeps ~3-16% of causal blocks at 16k."""
    g = torch.Generator().manual_seed(seed)
    nf = (d - 32) // 2
    w = torch.tan(math.pi * (torch.rand(nf, generator=g, dtype=torch.float64) - 0.5)) / 64.0
    ang = torch.arange(t, dtype=torch.float64)[:, None] * w
    feat = (torch.cat([ang.cos(), ang.sin()], -1) * math.sqrt(peak * math.sqrt(d) / nf)).float()  # [T, 2nf]
    k = 0.3 * torch.randn(1, hkv, t, d, generator=g)
    q = 0.3 * torch.randn(1, hq, t, d, generator=g)
    k[..., : 2 * nf] = feat
    q[..., : 2 * nf] = feat
    k[:, :, :4, 2 * nf] += 8.0
    q[..., 2 * nf] += 10.0
    stripes = 64 + torch.randperm(t - 64, generator=g)[: max(4, t // 1024)]
    k[:, :, stripes, 2 * nf + 1] += 8.0
    q[:, ::2, :, 2 * nf + 1] += 14.0
    k = k + 2.0 * torch.randn(1, hkv, 1, d, generator=g)
    v = torch.randn(1, hkv, t, d, generator=g)
    return tuple(x.to(dtype).to(device or DEV) for x in (q, k, v))


def _flippable(mass: torch.Tensor, alpha: float, *, keep_first: bool) -> torch.Tensor:
    """``[B, H]`` bool: float rounding could change the greedy cut of ``mass: [B, H, N]`` at ``alpha``.
    ``keep_first``: element 0 is always kept and the rest sorted (slashes); else all sorted (columns)."""
    m = mass.double() / mass.double().sum(-1, keepdim=True)
    base = m[..., :1] if keep_first else torch.zeros_like(m[..., :1])
    srt = (m[..., 1:] if keep_first else m).sort(-1, descending=True).values  # [B, H, n]
    cum = torch.cat([base, base + srt.cumsum(-1)], -1)  # kept mass after 0, 1, ..., n sorted elements
    near = ((cum - alpha).abs() <= TIE_TOL).any(-1)
    count = (cum < alpha).sum(-1, keepdim=True)  # sorted elements the cut keeps (= the reference's count)
    n = srt.shape[-1]
    last_in = srt.gather(-1, (count - 1).clamp(0, n - 1))
    first_out = srt.gather(-1, count.clamp(0, n - 1))
    tie = ((count > 0) & (count < n) & ((last_in - first_out).abs() <= TIE_REL * last_in.abs() + 1e-12))[..., 0]
    return near | tie


def _assert_masks_match(got: BlockMask, want: BlockMask, column, slash, alpha_c, alpha_s) -> int:
    """Exact equality of the block tables except flippable heads; returns the number of heads compared."""
    ok = ~(_flippable(column, alpha_c, keep_first=False) | _flippable(slash, alpha_s, keep_first=True))
    g, w = block_table(got), block_table(want)
    assert torch.equal(got.counts()[ok], w.sum(-1)[ok])
    assert torch.equal(g[ok], w[ok])
    nnz = int(got.offsets[-1])
    assert bool((got.indices[:nnz] >= 0).all())  # every meaningful index written (poison is -1)
    return int(ok.sum())


# ------------------------------------------------------------------------------------ interpreter tests
STAGE1_CASES = [
    pytest.param(1, 4, 1, 300, 300, 64, 2, 64, torch.float32, id="G4-T300-D64-chunk2-blk64-fp32"),
    pytest.param(2, 4, 4, 150, 333, 64, 3, 32, torch.bfloat16, id="G1-Sq150-Sk333-chunk3-blk32-bf16"),
    pytest.param(1, 4, 2, 200, 200, 128, 5, 64, torch.float32, id="G2-T200-D128-chunk5-overlap"),
    pytest.param(1, 2, 1, 100, 100, 64, 1, 16, torch.float32, id="G2-T100-chunk1-blk16"),
]


@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "sk", "d", "chunk_n", "blk", "dtype"), STAGE1_CASES)
def test_stage1_reductions_match_reference(b, hq, hkv, sq, sk, d, chunk_n, blk, dtype):
    q, k = _qk(b, hq, hkv, sq, sk, d, seed=sq + chunk_n, dtype=dtype)
    column, slash = triton_mod.stage1_reductions(q, k, chunk_n=chunk_n, blk=blk)
    want_c, want_s = reference.stage1_reductions(q, k, chunk_n=chunk_n, blk=blk)
    assert column.shape == want_c.shape and slash.shape == want_s.shape
    assert not bool(column.isnan().any() or slash.isnan().any())
    torch.testing.assert_close(column, want_c, rtol=0, atol=MASS_ATOL)
    torch.testing.assert_close(slash, want_s, rtol=0, atol=MASS_ATOL)


@pytest.mark.parametrize(("alpha_c", "alpha_s"), [(0.9, 0.9), (0.5, 0.95), (0.3, 0.3), (1.0, 0.5)])
def test_stage2_mask_builder_equals_reference(alpha_c, alpha_s):
    g = torch.Generator().manual_seed(7)
    column = (torch.rand(2, 3, 11, generator=g) ** 4).to(DEV)
    slash = (torch.rand(2, 3, 11, generator=g) ** 4).to(DEV)
    for seq_q, seq_k in [(700, 700), (450, 700)]:  # prefill and last-queries, odd lengths
        got = triton_mod.stage2_select(column, slash, alpha_c, alpha_s, seq_k, 64, seq_q=seq_q)
        want = reference.stage2_select(column, slash, alpha_c, alpha_s, seq_k, 64, seq_q=seq_q)
        assert torch.equal(got.offsets, want.offsets)
        assert torch.equal(got.indices[: want.indices.numel()], want.indices)


@pytest.mark.parametrize(("hq", "hkv", "chunk_n"), [(4, 1, 2), (2, 2, 6)], ids=["G4-chunk2", "G1-chunk6"])
def test_select_matches_reference(hq, hkv, chunk_n):
    q, k, _ = structured_qkv(333, hq, hkv, 64, seed=chunk_n, dtype=torch.float32)  # random q, k: dense
    kw = dict(alpha_c=0.8, alpha_s=0.8, chunk_n=chunk_n, blk=32)
    got = triton_mod.sampleattention_select(q, k, **kw)
    want = reference.sampleattention_select(q, k, **kw)
    column, slash = reference.stage1_reductions(q, k, chunk_n=chunk_n, blk=32)
    assert _assert_masks_match(got, want, column, slash, 0.8, 0.8) == hq  # nothing near a tie here
    assert 0.0 < float(got.density().mean()) < 1.0


def test_dense_alpha_gives_every_causal_block_and_api_dispatches():
    q, k = _qk(1, 2, 1, 200, 261, 64, seed=3)
    dense = triton_mod.sampleattention_select(q, k, alpha_c=1.0, alpha_s=0.9, chunk_n=2)
    assert torch.equal(block_table(dense), BlockMask.full(1, 2, 200, 261, 64, 64, DEV).to_dense())
    row = BucketRow(alpha_c=0.8, alpha_s=0.9, chunk_n=2)
    via_api = api._select(q, k, row, 64, None, "triton")
    direct = triton_mod.sampleattention_select(q, k, alpha_c=0.8, alpha_s=0.9, chunk_n=2)
    assert torch.equal(via_api.offsets, direct.offsets)
    reference_mask = api._select(q, k, row, 64, None, "reference")
    assert reference_mask.indices.numel() == int(reference_mask.offsets[-1])  # the reference path ran
    assert torch.equal(reference_mask.offsets, via_api.offsets)


# -------------------------------------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@pytest.mark.parametrize("t", [8192, 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_selection_matches_reference(t, dtype):
    q, k, _ = structured_qkv(t, dtype=dtype, device="cuda")
    column, slash = triton_mod.stage1_reductions(q, k, chunk_n=4)
    want_c, want_s = reference.stage1_reductions(q, k, chunk_n=4)
    torch.testing.assert_close(column, want_c, rtol=0, atol=1e-5)  # float32 sums over up to 256 x 32k
    torch.testing.assert_close(slash, want_s, rtol=0, atol=1e-5)
    for alpha_c, alpha_s in [(0.95, 0.95), (0.8, 0.9)]:
        kw = dict(alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=4)
        got = triton_mod.sampleattention_select(q, k, **kw)
        want = reference.sampleattention_select(q, k, **kw)
        compared = _assert_masks_match(got, want, want_c, want_s, alpha_c, alpha_s)
        print(f"T={t} {dtype} alpha=({alpha_c}, {alpha_s}): density {float(got.density().mean()):.3f}, "
              f"{compared}/8 heads compared exactly")
        assert compared >= 6


@pytest.mark.gpu
def test_gpu_prefill_attention_matches_masked_reference():
    q, k, v = structured_qkv(8192, device="cuda")
    row = BucketRow(alpha_c=0.95, alpha_s=0.95, chunk_n=4)
    mask = triton_mod.sampleattention_select(q, k, alpha_c=0.95, alpha_s=0.95, chunk_n=4)
    out = api.SampleAttentionPrefill(row, report_cra=True).prefill(0, q, k, v, q.shape[-1] ** -0.5)
    want = api.masked_dense_attention(q, k, v, mask)  # over-allocated indices: only [:nnz] counts
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_selection_never_syncs_the_host():
    q, k, _ = structured_qkv(16384, device="cuda")
    kw = dict(alpha_c=0.95, alpha_s=0.95, chunk_n=4)
    triton_mod.sampleattention_select(q, k, **kw)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = triton_mod.sampleattention_select(q, k, **kw)
        dense = triton_mod.sampleattention_select(q, k, alpha_c=1.0, alpha_s=0.9, chunk_n=4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 0 < int(mask.offsets[-1]) < int(dense.offsets[-1])
