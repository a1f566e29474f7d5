"""SAAP decode attention in Triton, same arguments and result as
:func:`runtime_kernels.saap.reference.saap_decode_attention_reference` (Mazaré et al., arXiv:2502.08246, App. F).

One decode step of one layer is five launches and no host synchronization (grids are sized from tensor
shapes, so the step can be captured in a CUDA graph):

1-2. Classifier and ranking (:mod:`runtime_kernels.saap.triton_classifier`): every query head's MLP,
   float32-exact from 16-bit weights, then per (batch, KV head) the group's summed softmax -> top-ℓ bucket ids.
3. :func:`_partial_kernel`, one program per (batch, KV head, partial): tiles of the dense region
   ``[0, lo) ∪ [hi, T)``, then the visited buckets read through the :class:`BucketIndex` slot array (small
   buckets packed as one key list, :func:`_pack`). Each gathered K/V row serves all ``G`` query heads of the
   group (``tl.dot`` with fp32 accumulation); online softmax in exp2 units; ``(o, m, l)`` in float32, with
   ``m = -inf, l = 0`` for an empty bucket (it weighs nothing in the merge).
4. :func:`_merge_kernel`: exact log-sum-exp merge of the partials per (batch, KV head, output columns).

A dense layer (``params.dense``) is steps 3-4 with the whole cache as the window (flash-decoding). The step
is memory-bound (classifier weights, gathered K/V rows and slots); small buckets are packed because a
program's chain of dependent loads (bucket id, slot start, slots, K/V rows) costs more than its few keys.
Design notes (launch layout, performance model): docs/notes/kernels.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.saap.triton needs the 'triton' package",
                              name="triton") from exc

from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.bucket_index import BucketIndex
from runtime_kernels.saap.reference import (
    SaapLayerParams,
    check_index_fits,
    classifier_input,
    dense_region,
    saap_decode_attention_reference,
)
from runtime_kernels.saap.triton_classifier import (  # public API of this module too (__all__)
    saap_classifier_logits_triton,
    saap_rank_buckets_triton,
    saap_select_buckets_triton,
)
from runtime_kernels.saap.triton_config import ROWS as _ROWS
from runtime_kernels.saap.triton_config import buffer as _buffer
from runtime_kernels.saap.triton_config import pow2 as _pow2

LOG2E = 1.4426950408889634

patch_interpreter()

__all__ = ["saap_classifier_logits_triton", "saap_decode_attention_triton", "saap_rank_buckets_triton",
           "saap_select_buckets_triton", "saap_sparse_attention_triton"]


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _mma(a, b, F32: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``F32``: both operands in fp32, IEEE (the interpreter, whose
    bf16 ``tl.dot`` is wrong, and float32 inputs); else the operands' own dtype on tensor cores."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, start_ptr, count_ptr, slots_ptr, o_ptr, m_ptr, l_ptr, len_ptr,
    n_kv, lo, hi, n_dense, win_tile, n_win, n_part, p_base, L, n_split, n_per, qk_scale,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sst_b, sst_h, sst_c, scn_b, scn_h, scn_c, ssl_b, ssl_h, ssl_s,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, F32: tl.constexpr, PACK: tl.constexpr = 0,
    HAS_LEN: tl.constexpr = False,
):
    """One partial softmax ``(o [G, D], m [G], l [G])`` of the query heads of one (batch, KV head).

    Partial ``p = p_base + program_id(1)``. ``p < n_win``: dense-region keys
    ``j ∈ [p·win_tile, min((p+1)·win_tile, n_dense))`` at position ``j`` if ``j < lo`` else ``j + hi - lo``.
    ``p >= n_win``: with ``r = p - n_win``, the selected buckets ``sel[b, h, e]`` for
    ``e ∈ [(r // n_split)·n_per, +n_per) ∩ [0, L)``, of each bucket ``c`` its ``(r % n_split)``-th chunk of
    ``ceil(count / n_split)`` keys, positions ``slots[b, h, slot_start[b, h, c] + i]``,
    ``i < bucket_count[b, h, c]``. ``m`` is in log2 units (scores times ``scale · log2 e``), ``-inf`` and
    ``l = 0`` when the partial has no key. ``PACK > 0`` (``CONFIG.bkt_pack``, small buckets): bucket
    program ``r`` walks the concatenation of the keys of buckets ``e ∈ [r·PACK, (r+1)·PACK) ∩ [0, L)``
    (``n_per = PACK``, ``n_split = 1``) in ``BLOCK_N``-key steps: their ids, slot starts and counts are
    loaded as vectors at once and a key's slot comes from the counts' prefix sum, so PACK buckets of a
    few keys cost one program and one chain of dependent loads instead of PACK of each.
    ``HAS_LEN`` (a static-cache step): the cache holds ``len[b]`` valid keys of the ``T`` the grid was
    sized for, so the dense region of row ``b`` ends at ``len[b]`` (window tiles past it are empty).
    Partials are contiguous ``o [B, Hkv, P, G, D]``,
    ``m, l [B, Hkv, P, G]`` float32. Grid: (B · Hkv, number of partials of this launch).
    """
    pid = tl.program_id(0)
    p = p_base + tl.program_id(1)
    b = pid // n_kv
    h = pid % n_kv
    b64 = b.to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    q = tl.load(q_ptr + b64 * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, D_PAD]
    k_base = k_ptr + b64 * sk_b + h * sk_h
    v_base = v_ptr + b64 * sv_b + h * sv_h
    # what this program walks: a window tile (arithmetic positions) or buckets (positions from slots)
    is_bkt = p >= n_win
    r = p - n_win
    e0 = (r // n_split) * n_per
    part = r % n_split
    j_first = p * win_tile
    n_dense_b = n_dense
    if HAS_LEN:  # the valid length, read on the device: the grid stays sized for the view
        n_dense_b = (tl.load(len_ptr + b) - hi + lo).to(tl.int32)
    if PACK > 0:
        n_seg = 1
    else:
        n_seg = tl.where(is_bkt, tl.minimum(n_per, L - e0), 1)
    m_i = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for e in range(0, n_seg):
        if PACK > 0:  # PACK buckets as one list: ids, starts, counts as vectors; slot of key i by prefix sum
            e_idx = e0 + tl.arange(0, PACK)
            e_ok = (e_idx < L) & ((e_idx * 0 + p) >= n_win)
            cs = tl.load(sel_ptr + pid.to(tl.int64) * L + e_idx, mask=e_ok, other=0)
            st = tl.load(start_ptr + b64 * sst_b + h * sst_h + cs * sst_c, mask=e_ok, other=0)
            cn = tl.load(count_ptr + b64 * scn_b + h * scn_h + cs * scn_c, mask=e_ok, other=0)
            inc = tl.cumsum(cn, 0)
            exc = inc - cn
            delta = st - exc  # slot of key i of bucket e = i + delta[e] for exc[e] <= i < inc[e]
            slot0 = 0
            n_bkt = tl.sum(cn, 0)
        else:
            c = tl.load(sel_ptr + pid.to(tl.int64) * L + e0 + e, mask=is_bkt, other=0)
            slot0 = tl.load(start_ptr + b64 * sst_b + h * sst_h + c * sst_c, mask=is_bkt, other=0)
            n_bkt = tl.load(count_ptr + b64 * scn_b + h * scn_h + c * scn_c, mask=is_bkt, other=0)
        chunk = (n_bkt + n_split - 1) // n_split
        i_lo = tl.where(is_bkt, part * chunk, 0)
        i_hi = tl.where(is_bkt, tl.minimum(n_bkt, i_lo + chunk), tl.minimum(win_tile, n_dense_b - j_first))
        slot_base = slots_ptr + b64 * ssl_b + h * ssl_h + slot0 * ssl_s
        for n0 in range(i_lo, i_hi, BLOCK_N):
            i = n0 + offs_n
            k_ok = i < i_hi
            j = j_first + i
            pos_w = tl.where(j < lo, j, j + (hi - lo))
            # the scalar flag is broadcast by hand: Triton 3.9's interpreter rejects vector & scalar masks
            if PACK > 0:
                hit = (i[:, None] >= exc[None, :]) & (i[:, None] < inc[None, :])
                slot = i + tl.sum(tl.where(hit, delta[None, :], 0), 1)
            else:
                slot = i
            pos_b = tl.load(slot_base + slot * ssl_s, mask=k_ok & ((i * 0 + p) >= n_win), other=0)
            pos = tl.where(is_bkt, pos_b, pos_w)
            kt = tl.load(k_base + pos[None, :] * sk_t + offs_d[:, None] * sk_d,
                         mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [D_PAD, BLOCK_N]
            s = _mma(q, kt, F32) * qk_scale  # [G_PAD, BLOCK_N], log2 units
            s = tl.where(k_ok[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(v_base + pos[:, None] * sv_t + offs_d[None, :] * sv_d,
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            acc = acc * alpha[:, None] + _mma(pr.to(v.dtype), v, F32)
            m_i = m_new
    row = (pid.to(tl.int64) * n_part + p) * G + offs_g  # [G_PAD] partial row index
    tl.store(o_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)


@triton.jit
def _merge_kernel(
    o_ptr, m_ptr, l_ptr, out_ptr, n_kv, n_part, so_b, so_h, so_d,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """``out[b, h*G + g, d] = Σ_p 2^(m_p - M) o_p / Σ_p 2^(m_p - M) l_p`` (exact log-sum-exp merge; empty
    partials weigh 0). Partials as in :func:`_partial_kernel`, read ``BLOCK_P`` at a time (one vector load
    each, running max); out: [B, Hq, D]. Grid: (B · Hkv, cdiv(D, BLOCK_D))."""
    pid = tl.program_id(0)
    b = pid // n_kv
    h = pid % n_kv
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    g_ok = offs_g < G
    d_ok = offs_d < D
    m_run = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
    den = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, n_part, BLOCK_P):
        pp = p0 + offs_p
        ok = (pp < n_part)[:, None] & g_ok[None, :]  # [BLOCK_P, G_PAD]
        row = (pid.to(tl.int64) * n_part + pp[:, None]) * G + offs_g[None, :]
        m = tl.load(m_ptr + row, mask=ok, other=-float("inf"))
        l_p = tl.load(l_ptr + row, mask=ok, other=0.0)
        o = tl.load(o_ptr + row[:, :, None] * D + offs_d[None, None, :],
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)  # [BLOCK_P, G_PAD, BLOCK_D]
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe[None, :])  # [BLOCK_P, G_PAD], 0 for empty partials
        den = den * alpha + tl.sum(w * l_p, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m_run = m_new
    out = acc / tl.where(g_ok, den, 1.0)[:, None]
    ptrs = out_ptr + b.to(tl.int64) * so_b + (h * G + offs_g)[:, None] * so_h + offs_d[None, :] * so_d
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------


def _index_tensors(state: BucketIndex | None, b: int, hkv: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``slot_start, bucket_count, slots`` of the index (a 1-slot dummy where there is nothing to read)."""
    if state is None:
        z = torch.zeros(b, hkv, 1, dtype=torch.int32, device=device)
        return z, z, z
    slots = state.slots
    if slots.shape[-1] == 0:
        slots = torch.zeros(b, hkv, 1, dtype=torch.int32, device=device)
    for name, t in (("slot_start", state.slot_start), ("bucket_count", state.bucket_count), ("slots", slots)):
        if t.device != device or t.dtype != torch.int32:
            raise ValueError(f"BucketIndex.{name} must be int32 on {device}, got {t.dtype} on {t.device}")
    return state.slot_start, state.bucket_count, slots


@dataclass
class _Partials:
    """How one attention call is cut into partials, and their buffers (see :func:`_partial_kernel`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lo: int
    hi: int
    scale: float
    n_dense: int
    win_tile: int
    n_win: int
    n_bkt_prog: int
    n_per: int  # buckets per bucket program
    o: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor
    pack: int = 0  # > 0: bucket programs walk this many buckets as one key list (_pack)
    cache_len: torch.Tensor | None = None  # [B] valid keys of a static-cache view (the kernel's HAS_LEN)

    @property
    def n_part(self) -> int:
        return self.n_win + self.n_bkt_prog


def _pack(n_keys: int, n_buckets: int | None) -> int:
    """Buckets per bucket program walked as one key list (``0``: one bucket per program).

    ``CONFIG.bkt_pack < 0`` (the default): the largest power of two of buckets whose mean size
    ``n_keys / n_buckets`` (host ints: no sync) fills at most one ``block_n`` key step, 8 at most, none
    below 2 — packed at 8k and 32k with C = 1024 (6 and 30 keys per bucket), not at 128k (126)."""
    cfg = _tc.CONFIG
    if cfg.bkt_pack > 0 and cfg.bkt_pack & (cfg.bkt_pack - 1):
        raise ValueError(f"SaapTritonConfig.bkt_pack must be a power of two, 0 or -1 (auto), got {cfg.bkt_pack}")
    if cfg.bkt_pack >= 0:
        return cfg.bkt_pack
    if not n_buckets or n_keys <= 0:
        return 0
    fit = cfg.block_n * n_buckets // max(1, n_keys)  # buckets of mean size per key step
    pack = 1 << (max(1, min(fit, 8)).bit_length() - 1)
    return pack if pack >= 2 else 0


def _plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_l: int, lo: int, hi: int,
          scale: float, n_buckets: int | None = None, cache_len: torch.Tensor | None = None) -> _Partials:
    """Cut one call into partials: window tiles of at least ``min_win_steps`` key steps, at most
    ``max_win_tiles`` per (batch, KV head) and fewer when ``B · Hkv`` programs already fill the GPU
    (``win_programs``); then ``cdiv(n_l, pack or 1)`` bucket programs."""
    b, hq, d = q.shape
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    cfg = _tc.CONFIG
    n_dense = lo + (t - hi)
    max_tiles = max(1, min(cfg.max_win_tiles, triton.cdiv(cfg.win_programs, b * hkv)))
    win_tile = cfg.block_n * max(cfg.min_win_steps, triton.cdiv(n_dense, max_tiles * cfg.block_n))
    n_win = triton.cdiv(n_dense, win_tile)
    pack = _pack(hi - lo, n_buckets)
    n_per = max(1, pack)
    n_bkt_prog = triton.cdiv(n_l, n_per)
    n_part = n_win + n_bkt_prog
    g = hq // hkv
    o, m, l_ = (_buffer(shape, torch.float32, q.device)
                for shape in ((b, hkv, n_part, g, d), (b, hkv, n_part, g), (b, hkv, n_part, g)))
    return _Partials(q, k_cache, v_cache, lo, hi, float(scale), n_dense, win_tile, n_win, n_bkt_prog, n_per,
                     o, m, l_, pack, cache_len)


def _launch_partials(pl: _Partials, state: BucketIndex | None, buckets: torch.Tensor | None, window: bool,
                     bucket: bool) -> None:
    """Launch :func:`_partial_kernel` for the window partials, the bucket partials, or both."""
    q, k_cache, v_cache = pl.q, pl.k, pl.v
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    p_base = 0 if window else pl.n_win
    n_prog = (pl.n_win if window else 0) + (pl.n_bkt_prog if bucket else 0)
    if n_prog == 0:
        return
    n_l = 0 if buckets is None else int(buckets.shape[-1])
    if n_l and bucket:
        sel = (buckets if buckets.dtype == torch.int32 else buckets.to(torch.int32)).contiguous()
    else:
        sel = torch.zeros(1, dtype=torch.int32, device=q.device)
    start, count, slots = _index_tensors(state if n_l and bucket else None, b, hkv, q.device)
    f32 = _interpreting() or q.dtype == torch.float32
    cfg = _tc.CONFIG
    length = pl.cache_len if pl.cache_len is not None else sel  # any int tensor when HAS_LEN is off
    _partial_kernel[(b * hkv, n_prog)](
        q, k_cache, v_cache, sel, start, count, slots, pl.o, pl.m, pl.l, length,
        hkv, pl.lo, pl.hi, pl.n_dense, pl.win_tile, pl.n_win, pl.n_part, p_base, max(n_l, 1), 1,  # n_split = 1
        pl.n_per, pl.scale * LOG2E, *q.stride(), *k_cache.stride(), *v_cache.stride(), *start.stride(),
        *count.stride(), *slots.stride(),
        G=g, G_PAD=max(_ROWS, _pow2(g)), D=d, D_PAD=_pow2(d), BLOCK_N=cfg.block_n, F32=f32,
        PACK=pl.pack, HAS_LEN=pl.cache_len is not None, num_warps=cfg.attn_warps,
        num_stages=cfg.attn_stages,
    )


def _merge(pl: _Partials) -> torch.Tensor:
    """Launch :func:`_merge_kernel` on the partials: ``[B, Hq, D]`` in q's dtype."""
    q = pl.q
    b, hq, d = q.shape
    hkv = pl.k.shape[1]
    g = hq // hkv
    out = _buffer((b, hq, d), q.dtype, q.device)
    block_d = min(_pow2(d), _tc.CONFIG.merge_block_d)
    _merge_kernel[(b * hkv, triton.cdiv(d, block_d))](
        pl.o, pl.m, pl.l, out, hkv, pl.n_part, *out.stride(),
        G=g, G_PAD=_pow2(g), D=d, BLOCK_D=block_d, BLOCK_P=_tc.CONFIG.merge_block_p, num_warps=4,
    )
    return out


def saap_sparse_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 state: BucketIndex | None, buckets: torch.Tensor | None, lo: int, hi: int,
                                 scale: float, cache_len: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the dense region ``[0, lo) ∪ [hi, T)`` plus all keys of ``buckets``, merged exactly.

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, T, D]; buckets: [B, Hkv, L] int32 bucket ids of ``state``
    (or None: dense region only); ``lo = hi = 0``: the whole cache (flash-decoding). ``cache_len [B]``
    (int64, device): only the first ``cache_len[b]`` keys are valid (the dense region ends there).
    Returns [B, Hq, D] in q.dtype.
    """
    n_l = 0 if buckets is None else int(buckets.shape[-1])
    pl = _plan(q, k_cache, v_cache, n_l, lo, hi, scale, None if state is None else state.bucket_count.shape[-1],
               cache_len)
    _launch_partials(pl, state, buckets, True, True)
    return _merge(pl)


def _sparse_step(q: torch.Tensor, q_classifier: torch.Tensor, query_rotation: torch.Tensor | None,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, state: BucketIndex, params: SaapLayerParams,
                 top_l: int, lo: int, hi: int, scale: float, cache_len: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier (on ``q_classifier``, de-RoPE'd on load with ``query_rotation`` when given) and ranking,
    then the window and bucket partials in one launch, then the merge."""
    hkv = k_cache.shape[1]
    c = params.w2.shape[-1]
    pl = _plan(q, k_cache, v_cache, min(int(top_l), c), lo, hi, scale, c, cache_len)
    buckets = saap_select_buckets_triton(q_classifier, params, q.shape[1] // hkv, top_l, query_rotation)
    _launch_partials(pl, state, buckets, True, True)
    return _merge(pl)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [B, Hq, D], k/v [B, Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[-1] != d or hq % k_cache.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the SAAP kernel takes bf16, fp16 or float32, got {q.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a unit stride along D")


def saap_decode_attention_triton(q: torch.Tensor, q_derope: torch.Tensor | None, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, state: BucketIndex | None,
                                 artifact_layer: SaapLayerParams, *, top_l: int, scale: float | None = None,
                                 cache_len: torch.Tensor | None = None,
                                 query_rotation: torch.Tensor | None = None) -> torch.Tensor:
    """SAAP attention of one decode step, as :func:`saap_decode_attention_reference`.

    q: [B, Hq, D] RoPE'd query; q_derope: [B, Hq, D] (classifier input), or None with ``query_rotation
    [B, 2, D]`` (:func:`runtime_kernels.rope.derope_coefficients`): the classifier de-RoPEs ``q`` as it
    loads it (:func:`reference.classifier_input`); k_cache, v_cache:
    [B, Hkv, T, D] (current token last); state: the layer's :class:`BucketIndex` (its lists may end
    before ``T - recent``: the keys after them are attended with the window, :func:`dense_region`).
    ``cache_len [B]`` (int64, device; a static-cache step): keys past it are not valid. Returns
    [B, Hq, D] in q.dtype. No host synchronization. float64 inputs run the reference.
    """
    if q.dtype == torch.float64:
        if query_rotation is not None and not artifact_layer.dense:
            q_derope = classifier_input(q, query_rotation, artifact_layer)
        if cache_len is not None:
            t = int(cache_len.max())
            k_cache, v_cache = k_cache[:, :, :t], v_cache[:, :, :t]
        return saap_decode_attention_reference(q, q_derope, k_cache, v_cache, state, artifact_layer, top_l, scale)
    _check(q, k_cache, v_cache)
    d = q.shape[-1]
    t = k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    params = artifact_layer
    if params.dense:
        return saap_sparse_attention_triton(q, k_cache, v_cache, None, None, 0, 0, scale, cache_len)
    check_index_fits(state, t, params)
    lo, hi = dense_region(state, params)
    if hi == lo or top_l <= 0:
        return saap_sparse_attention_triton(q, k_cache, v_cache, None, None, lo, hi, scale, cache_len)
    if (q_derope is None) == (query_rotation is None):
        raise ValueError("a non-dense SAAP layer needs exactly one of q_derope and query_rotation")
    q_classifier = q if q_derope is None else q_derope
    return _sparse_step(q, q_classifier, query_rotation, k_cache, v_cache, state, params, top_l, lo, hi, scale,
                        cache_len)
