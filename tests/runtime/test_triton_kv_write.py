"""The decode step's one-launch K/V write (runtime_kernels.triton_kv_write) against an element-by-element
construction: each row's new key and value land at that row's own position, nothing else changes.
Caches are NaN-poisoned, so a stray or missing write shows; the interpreter runs the kernel on the CPU."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels.static_cache import write_step_kv

kv_write = pytest.importorskip("runtime_kernels.triton_kv_write")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b: int, hkv: int, t: int, d: int, cache_dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """NaN caches, new rows in the cache's dtype (the model's) as a transposed view (the projection's
    layout), distinct positions per row including the first and the last."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.full((b, hkv, t, d), float("nan"), dtype=cache_dtype, device=device) for _ in range(2))
    k, v = (torch.randn(b, 1, hkv, d, generator=g).to(device, cache_dtype).transpose(1, 2) for _ in range(2))
    pos = torch.randperm(t, generator=g)[:b]
    pos[0], pos[-1] = 0, t - 1
    return k_cache, v_cache, k, v, pos.to(device)


def _expected(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    out = cache.clone()
    for b in range(cache.shape[0]):
        for h in range(cache.shape[1]):
            out[b, h, int(pos[b])] = new[b, h, 0].to(cache.dtype)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, hkv, d", [(3, 2, 16), (4, 3, 24)])
def test_each_rows_key_and_value_land_at_its_own_position(b, hkv, d, cache_dtype):
    k_cache, v_cache, k, v, pos = _case(b, hkv, 37, d, cache_dtype)
    want_k, want_v = _expected(k_cache, k, pos), _expected(v_cache, v, pos)
    kv_write.write_step_rows(k_cache, v_cache, k, v, pos)
    assert _same(k_cache, want_k) and _same(v_cache, want_v)


def test_the_cache_scatter_path_writes_the_same():
    k_cache, v_cache, k, v, pos = _case(3, 2, 37, 16, torch.float32)
    k2, v2 = k_cache.clone(), v_cache.clone()
    write_step_kv(k_cache, v_cache, k, v, pos)  # CPU tensors: scatter_
    kv_write.write_step_rows(k2, v2, k, v, pos)
    assert _same(k_cache, k2) and _same(v_cache, v2)


def test_bad_shapes_are_refused():
    k_cache, v_cache, k, v, pos = _case(3, 2, 37, 16, torch.float32)
    with pytest.raises(ValueError, match="one new row per batch row"):
        kv_write.write_step_rows(k_cache, v_cache, torch.cat([k, k], 2), torch.cat([v, v], 2), pos)
    with pytest.raises(ValueError, match="pos must be"):
        kv_write.write_step_rows(k_cache, v_cache, k, v, pos[:2])
    with pytest.raises(ValueError, match="contiguous last dimension"):
        kv_write.write_step_rows(k_cache.transpose(2, 3).contiguous().transpose(2, 3), v_cache, k, v, pos)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_gpu_write_matches_scatter_and_replays_in_a_graph():
    """Llama-3.1-8B cache rows (8 KV heads, D = 128, bf16) at B = 8: the kernel equals scatter_, and a
    captured write replays at the positions in ``pos`` at replay time."""
    k_cache, v_cache, k, v, pos = _case(8, 8, 4096, 128, torch.bfloat16, "cuda")
    want_k, want_v = _expected(k_cache, k, pos), _expected(v_cache, v, pos)
    write_step_kv(k_cache, v_cache, k, v, pos)  # CUDA: the kernel
    assert _same(k_cache, want_k) and _same(v_cache, want_v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_step_kv(k_cache, v_cache, k, v, pos)
    pos.add_(1).clamp_(max=4095)
    want_k, want_v = _expected(k_cache, k, pos), _expected(v_cache, v, pos)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(k_cache, want_k) and _same(v_cache, want_v)
