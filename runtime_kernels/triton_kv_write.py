"""A decode step's new keys and values written into a static KV cache in one launch.

Each batch row writes its one new key and value row at its own position (a ragged batch decodes every
row at its own length): ``k_cache[b, h, pos[b]] = k[b, h, 0]`` and the same for V, for every KV head.
``scatter_`` does this as two launches whose index tensor, expanded to every element, is read per element;
this kernel reads each row's position once and writes K and V together. Used by
:meth:`runtime_kernels.static_cache.StaticKVCache.update` on CUDA (:func:`write_step_rows`); it needs Triton,
which CPU-only installs lack (the cache then scatters).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.triton_kv_write needs the 'triton' package", name="triton") from exc

from runtime_kernels._triton_support import patch_interpreter

patch_interpreter()


@triton.jit
def _write_rows_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, n_kv, D,
    sk_b, sk_h, sk_d, sv_b, sv_h, sv_d, skc_b, skc_h, skc_t, svc_b, svc_h, svc_t,
    BLOCK_D: tl.constexpr,
):
    """Program ``b·Hkv + h``: ``kc[b, h, pos[b], :] = k[b, h, :]`` and ``vc[b, h, pos[b], :] = v[b, h, :]``
    (cast to the cache's dtype; the caches' last dimension contiguous). Grid: (B · Hkv,)."""
    pid = tl.program_id(0)
    b = (pid // n_kv).to(tl.int64)
    h = (pid % n_kv).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    k = tl.load(k_ptr + b * sk_b + h * sk_h + d * sk_d, mask=ok)
    v = tl.load(v_ptr + b * sv_b + h * sv_h + d * sv_d, mask=ok)
    tl.store(kc_ptr + b * skc_b + h * skc_h + pos * skc_t + d, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + b * svc_b + h * svc_h + pos * svc_t + d, v.to(vc_ptr.dtype.element_ty), mask=ok)


def write_step_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pos: torch.Tensor) -> None:
    """Write ``k, v [B, Hkv, 1, D]`` into ``k_cache, v_cache [B, Hkv, T, D]`` at position ``pos[b]`` of each
    row ``b`` (``pos [B]`` integer, on the caches' device; every ``pos[b] < T``). One launch, no host sync."""
    b, hkv, n, d = k.shape
    if n != 1 or v.shape != k.shape or k_cache.shape[:2] != (b, hkv) or k_cache.shape[3] != d:
        raise ValueError(f"expected one new row per batch row: k, v {tuple(k.shape)}, {tuple(v.shape)} "
                         f"for caches {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must have one shape and a contiguous last dimension")
    if pos.shape != (b,):
        raise ValueError(f"pos must be [B] = [{b}], got {tuple(pos.shape)}")
    _write_rows_kernel[(b * hkv,)](
        k, v, k_cache, v_cache, pos, hkv, d,
        k.stride(0), k.stride(1), k.stride(3), v.stride(0), v.stride(1), v.stride(3),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_D=triton.next_power_of_2(d), num_warps=1,
    )
