"""The reference on CUDA draws what it draws on CPU (same offsets -> same keys), through the dispatch."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels.santa import (
    decode_sample_counts,
    per_row_sample_counts,
    santa_attention,
    santa_decode_attention,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("estimator", ["iid", "strat", "sys"])
def test_prefill_cuda_matches_cpu(estimator):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 37, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 301, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 301, 16, generator=g, dtype=torch.float64)
    shape = (2, 8, 37) if estimator == "sys" else (2, 8, 37, 9)
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    cpu = per_row_sample_counts(q, k, 9, estimator=estimator, uniforms=u)
    gpu = per_row_sample_counts(q.cuda(), k.cuda(), 9, estimator=estimator, uniforms=u.cuda())
    assert torch.equal(cpu, gpu.cpu())
    out_cpu = santa_attention(q, k, v, 9, estimator=estimator, uniforms=u)
    out_gpu = santa_attention(q.cuda(), k.cuda(), v.cuda(), 9, estimator=estimator, uniforms=u.cuda())
    assert out_gpu.is_cuda and torch.allclose(out_cpu, out_gpu.cpu(), rtol=1e-10, atol=1e-10)
    # A CPU generator with CUDA tensors draws on CPU, then moves: same numbers as the CPU call.
    a = santa_attention(q, k, v, 9, estimator=estimator, generator=torch.Generator().manual_seed(3))
    b = santa_attention(q.cuda(), k.cuda(), v.cuda(), 9, estimator=estimator,
                        generator=torch.Generator().manual_seed(3))
    assert torch.allclose(a, b.cpu(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tiling", ["prop", "flash", "none"])
def test_decode_cuda_matches_cpu(tiling):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 8, 64, generator=g, dtype=torch.float64)
    k = torch.randn(3, 2, 1000, 64, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 1000, 64, generator=g, dtype=torch.float64)
    lens = torch.tensor([1000, 513, 7])
    kw = {"uniforms": torch.rand(3, 8, 1, generator=g, dtype=torch.float64)} if tiling == "none" else {
        "tile_uniforms": torch.rand(3, 8, 4, generator=g, dtype=torch.float64)}
    cuda_kw = {name: t.cuda() for name, t in kw.items()}
    s = torch.tensor([64, 0, 5])
    cpu = decode_sample_counts(q, k, s, tiling=tiling, cache_len=lens, **kw)
    gpu = decode_sample_counts(q.cuda(), k.cuda(), s.cuda(), tiling=tiling, cache_len=lens.cuda(), **cuda_kw)
    assert torch.equal(cpu, gpu.cpu())
    out_cpu = santa_decode_attention(q, k, v, s, tiling=tiling, cache_len=lens, **kw)
    out_gpu = santa_decode_attention(q.cuda(), k.cuda(), v.cuda(), s.cuda(), tiling=tiling,
                                     cache_len=lens.cuda(), **cuda_kw)
    assert torch.allclose(out_cpu, out_gpu.cpu(), rtol=1e-10, atol=1e-10)
