"""SAAP's per-step bucket ranking in Triton (Mazaré et al., arXiv:2502.08246, §4, App. F):
from the classifier logits of every query head, the top-ℓ buckets of each KV head by the group's summed
softmax, without a host sync.

One program per (batch, KV head) reads its ``G`` logits rows (``C`` floats each), sums their softmaxes
and takes the top-ℓ of ``score bits << 32 | ~bucket`` keys. A bitonic sort of all C keys costs more
than the rest of the program, so the keys below a threshold that at least ``K_PAD`` keys reach are
dropped first when few remain.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.saap.triton_rank needs the 'triton' package", name="triton") from exc

from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.triton_config import buffer as _buffer
from runtime_kernels.saap.triton_config import pow2 as _pow2

patch_interpreter()

# chunks per K_PAD of the candidate threshold: the K_PAD-th largest of 2·K_PAD chunk maxima (one chunk
# per K_PAD leaves far more candidates, and flat scores then fall back to sorting all C keys)
THRESHOLD_CHUNKS = 2


@triton.jit
def _rank_kernel(
    logits_ptr, sel_ptr, scratch_ptr, n_kv, C, L, sl_b, sl_h, sl_c,
    G: tl.constexpr, G_PAD: tl.constexpr, C_PAD: tl.constexpr, K_PAD: tl.constexpr, CAND: tl.constexpr,
    N_CHUNK: tl.constexpr,
):
    """Top-ℓ buckets of batch row ``b``, KV head ``h`` (``pid = b · Hkv + h``): ``sel[pid, :L]`` int32, best
    first, ties to the lower bucket. Grid: (B · Hkv,).

    logits: [B, Hq, C] float32 (strides ``sl_*``; query heads ``h*G .. h*G+G-1`` of KV head ``h``); sel:
    [B, Hkv, L] contiguous. Score of bucket c = Σ_g softmax(logits[b, h*G+g])[c] (>= 0, so its float bits
    order like the value): key = bits << 32 | (C_PAD - 1 - c), keys distinct; top-K_PAD, the first L kept.

    ``CAND > 0``: the keys are cut into ``N_CHUNK >= K_PAD`` chunks; ``τ`` = the K_PAD-th largest chunk
    maximum, so at least K_PAD keys reach ``τ`` and the top K_PAD are among the keys ``>= τ``. When at
    most CAND keys qualify they are compacted (prefix sum, a store to ``scratch [B·Hkv, CAND]`` and a
    reload) and only those are sorted; otherwise (flat scores) all C_PAD keys are. Same result either way.
    """
    pid = tl.program_id(0)
    b = pid // n_kv
    h = pid % n_kv
    offs_g = tl.arange(0, G_PAD)
    offs_c = tl.arange(0, C_PAD)
    g_ok = offs_g < G
    c_ok = offs_c < C
    ok = g_ok[:, None] & c_ok[None, :]
    ptrs = logits_ptr + b.to(tl.int64) * sl_b + (h * G + offs_g)[:, None] * sl_h + offs_c[None, :] * sl_c
    x = tl.load(ptrs, mask=ok, other=-float("inf"), cache_modifier=".cg")  # written by the previous launch
    row_max = tl.where(g_ok, tl.max(x, 1), 0.0)
    e = tl.exp(x - row_max[:, None])  # padded rows and columns: exp(-inf) = 0
    den = tl.where(g_ok, tl.sum(e, 1), 1.0)
    score = tl.sum(e / den[:, None], 0)  # [C_PAD]
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(c_ok, (bits << 32) | (C_PAD - 1 - offs_c).to(tl.int64), -1)
    if CAND > 0:
        mx = tl.max(tl.reshape(key, [N_CHUNK, C_PAD // N_CHUNK]), axis=1)
        above = tl.sum((mx[None, :] > mx[:, None]).to(tl.int32), axis=1)
        tau = tl.min(tl.where(above < K_PAD, mx, 0x7FFFFFFFFFFFFFFF), axis=0)
        cand = key >= tau
        n_cand = tl.sum(cand.to(tl.int32), axis=0)
        if n_cand <= CAND:
            row = scratch_ptr + pid.to(tl.int64) * CAND
            tl.store(row + tl.cumsum(cand.to(tl.int32), axis=0) - 1, key, mask=cand)
            tl.debug_barrier()  # the compacted candidates, stored by every thread, are visible to all
            offs_k = tl.arange(0, CAND)
            cand_key = tl.load(row + offs_k, mask=offs_k < n_cand, other=-1)
            _store_top(sel_ptr, pid, L, tl.topk(cand_key, K_PAD), C_PAD, K_PAD)
        else:
            _store_top(sel_ptr, pid, L, tl.topk(key, K_PAD), C_PAD, K_PAD)
    else:
        _store_top(sel_ptr, pid, L, tl.topk(key, K_PAD), C_PAD, K_PAD)


@triton.jit
def _store_top(sel_ptr, pid, L, top, C_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """The first L of ``top`` ([K_PAD] keys, descending) as bucket ids in ``sel[pid, :L]``."""
    idx = (C_PAD - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    offs_l = tl.arange(0, K_PAD)
    tl.store(sel_ptr + pid.to(tl.int64) * L + offs_l, idx, mask=offs_l < L)


def saap_rank_buckets_triton(logits: torch.Tensor, group: int, top_l: int) -> torch.Tensor:
    """Top-ℓ buckets per KV head from logits: ``[B, Hq, C]`` -> ``[B, Hkv, min(ℓ, C)]`` int32, best first.

    The same set as :func:`reference.rank_buckets` on ``softmax(logits)``. Exact ties (e.g. probabilities
    that underflow to 0 when fewer than ℓ buckets have mass) go to the lower bucket id; ``torch.topk``'s
    order among exact ties is unspecified, so only there may the two choose different buckets.
    """
    b, hq, c = logits.shape
    hkv = hq // group
    n_l = min(int(top_l), c)
    sel = _buffer((b, hkv, n_l), torch.int32, logits.device)
    if n_l == 0:
        return sel
    c_pad, k_pad = max(2, _pow2(c)), max(2, _pow2(n_l))  # tl.topk needs k >= 2
    cand = _tc.CONFIG.rank_filter * k_pad
    cand = cand if 0 < cand < c_pad else 0  # a filter that keeps everything is no filter
    scratch = _buffer((b * hkv * max(cand, 1),), torch.int64, logits.device)
    _rank_kernel[(b * hkv,)](
        logits, sel, scratch, hkv, c, n_l, *logits.stride(),
        G=group, G_PAD=_pow2(group), C_PAD=c_pad, K_PAD=k_pad, CAND=cand,
        N_CHUNK=min(c_pad, k_pad * THRESHOLD_CHUNKS), num_warps=_tc.CONFIG.rank_warps,
    )
    return sel
