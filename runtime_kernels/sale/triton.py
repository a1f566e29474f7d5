"""SALE's Selection-Pass on the GPU in Triton (Ji et al., arXiv:2505.24179, §3.2, §3.4, App. G, J).

Same public functions and results as :mod:`runtime_kernels.sale.reference` (the definition of correct),
with one documented difference: **the estimate is int8 whenever the config asks for 4 or 8 bits** (Triton
has no 4-bit tensor-core ``tl.dot``; int8 runs at twice the bf16 rate). A 4-bit config logs that once;
:func:`gpu_estimator` names the estimator that runs (``"int8"`` or ``"float"``). Three kernels, no host sync:

* ``_sale_quant_kernel``: per ``block`` rows of one head, the int8 quantization (K smoothed by its mean);
* ``_sale_select_kernel``: the block scores, or a keep table plus a count per row, without materializing
  scores (its docstring);
* ``_compact_kernel``: keep table + ``offsets = cumsum(counts)`` (on the device) -> CSR ``indices``;
  ``offsets`` is exact, ``indices`` sized for every causal block and only ``indices[:offsets[-1]]``
  meaningful (:func:`block_table` gives a dense view that handles the padding).

Design notes (performance model, launch-shape sweep): docs/notes/kernels.md
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime_kernels._triton_support import patch_interpreter, scaled_scores
from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels.blocksparse import api as blocksparse_api
from runtime_kernels.blocksparse.mask import BlockMask, causal_block_count
from runtime_kernels.sale import reference
from runtime_kernels.sale.reference import SaleSelectionConfig

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelectLaunch:
    """Launch shape of ``_sale_select_kernel`` (replace ``LAUNCH`` to tune on a GPU; the sweep that chose
    these values: docs/notes/kernels.md)."""

    rows: int = 128  # query rows per program: HPP = rows // block_q heads of one KV group share each K tile
    block_n: int = 128  # keys per walk tile (a multiple of block_k; = block_k avoids the in-tile reshape)
    num_warps: int = 8  # block scores and the float estimate
    keep_warps: int = 4  # the int8 keep-table walk of sale_select (one warpgroup: its reductions stay in it)
    num_stages: int = 3


LAUNCH = SelectLaunch()
POISON = False  # tests: fill kernel-written buffers with NaN / -1 before the launch (every entry must be written)
_warned_int4 = False



patch_interpreter()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def gpu_estimator(config: SaleSelectionConfig) -> str:
    """The estimator this module runs for ``config``: ``"int8"`` (bits 4 or 8) or ``"float"`` (bits None)."""
    return "float" if config.bits is None else "int8"


def _note_estimator(config: SaleSelectionConfig) -> None:
    global _warned_int4
    if config.bits == 4 and not _warned_int4:
        _warned_int4 = True
        _LOG.warning("SALE GPU Selection-Pass: the config asks a 4-bit estimate; running int8 instead "
                     "(no 4-bit tensor-core path on this GPU; the 4-bit estimate stays in the reference)")


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _sale_quant_kernel(x_ptr, kbar_ptr, xq_ptr, scale_ptr, shift_ptr, sxb, sxh, sxt, H, T, NB, G, sm_scale,
                       BLOCK: tl.constexpr, D: tl.constexpr, SMOOTH: tl.constexpr, SHIFT: tl.constexpr):
    """x: [B, H, T, D] (strided, last dim contiguous) -> xq: [B, H, T, D] int8, scale: [B, H, NB],
    (SHIFT) shift: [B, H, T] = sm_scale * x . kbar[b, h // G]; kbar: [B, H // G, D] fp32.

    Per ``block`` rows of one head: (K only) subtract the per-(batch, KV head) key mean ``k_bar``
    (SageAttention2 smoothing; padded rows stay 0), one symmetric scale ``max|x|/127``, round half to even,
    int8. For Q it also writes the shift ``scale * q . k_bar`` (unquantized q)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t = blk * BLOCK + tl.arange(0, BLOCK)
    ok = t < T
    rd = tl.arange(0, D)
    x = tl.load(x_ptr + b * sxb + h * sxh + t[:, None] * sxt + rd[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    if SMOOTH or SHIFT:
        kbar = tl.load(kbar_ptr + (b * (H // G) + h // G) * D + rd)
    if SMOOTH:
        x = tl.where(ok[:, None], x - kbar[None, :], 0.0)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    sc = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    v = tl.math.div_rn(x, sc)
    v = (v + 12582912.0) - 12582912.0  # round half to even (1.5 * 2**23 trick; |v| <= 127)
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    tl.store(xq_ptr + (bh * T + t[:, None]) * D + rd[None, :], v.to(tl.int8), mask=ok[:, None])
    tl.store(scale_ptr + bh * NB + blk, sc)
    if SHIFT:
        tl.store(shift_ptr + bh * T + t, tl.sum(x * kbar[None, :], axis=1) * sm_scale, mask=ok)


@triton.jit
def _online_update(q, kk, ok, m_i, l_i, sm_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One tile of the exact sink/local softmax statistics: returns the new (m, l) of every row."""
    s = tl.where(ok, scaled_scores(q, kk, sm_scale, UPCAST, IEEE), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_new = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
    return m_new, l_new


@triton.jit
def _fill_rest(out_ptr, row_base, hp, start, stop, hi, SCORES: tl.constexpr, HPP: tl.constexpr,
               FILL: tl.constexpr):
    """Blocks ``[start, stop)`` of the program's rows: kept (+inf) iff ``<= hi`` (causal); returns counts."""
    cnt = tl.zeros([HPP], dtype=tl.int32)
    for j0 in range(start, stop, FILL):
        j = j0 + tl.arange(0, FILL)
        inside = j < stop
        ptr = out_ptr + row_base[:, None] + j[None, :]
        keep = (j <= hi)[None, :] & (hp >= 0)[:, None]  # [HPP, FILL]
        msk = inside[None, :] & (hp >= 0)[:, None]
        if SCORES:
            tl.store(ptr, tl.where(keep, float("inf"), float("-inf")), mask=msk)
        else:
            tl.store(ptr, keep.to(tl.int8), mask=msk)
            cnt += tl.sum((keep & msk).to(tl.int32), axis=1)
    return cnt


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _flush_segment(bits, seg0, walk_end, out_ptr, row_base, HPP: tl.constexpr, BQ: tl.constexpr,
                   SEG: tl.constexpr):
    """OR one segment's hit bits ``[M, 4]`` over each head's rows and lanes (one reduction for ``SEG`` key
    blocks), store the segment's keep entries; returns the kept count per head ``[HPP]``."""
    head_bits = tl.reduce(tl.reshape(bits, [HPP, BQ * 4]), 1, _bit_or)  # [HPP]
    j = tl.arange(0, SEG)
    keep = (head_bits[:, None] >> j[None, :]) & 1
    blk = seg0 + j
    ok = (blk < walk_end)[None, :] & (row_base >= 0)[:, None]
    tl.store(out_ptr + row_base[:, None] + blk[None, :], keep.to(tl.int8), mask=ok)
    return tl.sum(tl.where(ok, keep, 0), axis=1)


@triton.jit
def _keep_walk(qv, qrow, shift, c, row_ok, lt_row, kv_base, svkt, ks_base, out_ptr, row_base, n_sink, walk_end,
               Tk, NK, M: tl.constexpr, HPP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The int8 walk of ``sale_select``: kept counts per head ``[HPP]``, keep entries stored per segment.

    App. G's segment-level all-reduce: per tile each thread reduces only the products it holds (a block's
    columns in its registers), dequantizes those few maxima and compares them with its row's threshold; the
    hits go into one bit per key block of an int32 per (row, lane), and a whole segment of 32 key blocks is
    OR-reduced across the program once. The dequantization is monotone, so a block is kept exactly when its
    largest product's score clears ``ln tau``: the same keep table as a per-block maximum."""
    NBT: tl.constexpr = BLOCK_N // BK
    SEG: tl.constexpr = 32  # key blocks per segment: one bit each in an int32
    TPS: tl.constexpr = SEG // NBT
    rd = tl.arange(0, D)
    cc = tl.where(row_ok, c, float("inf"))  # a row past Tq never hits
    cnt = tl.zeros([HPP], dtype=tl.int32)
    bits = tl.zeros([M, 4], dtype=tl.int32)
    n_tiles = (walk_end - n_sink + NBT - 1) // NBT
    for i in range(0, n_tiles):
        kb0 = n_sink + i * NBT
        kt = kb0 * BK + tl.arange(0, BLOCK_N)
        kk = tl.load(kv_base + kt[:, None] * svkt + rd[None, :], mask=(kt < Tk)[:, None], other=0)
        acc = tl.dot(qv, tl.trans(kk), out_dtype=tl.int32)  # [M, BLOCK_N]
        kbs = kb0 + tl.arange(0, NBT)
        ksc = tl.load(ks_base + kbs, mask=kbs < NK, other=1.0)
        # [M, NBT, 4]: per key block, the maxima over column groups a thread holds (exact: < 2**24)
        part = tl.max(tl.max(tl.reshape(acc, [M, NBT, BK // 8, 4, 2]), axis=4), axis=2).to(tl.float32)
        sv = part * ksc[None, :, None] * qrow[:, None, None] + shift[:, None, None]
        hit = (sv - cc[:, None, None]) >= lt_row[:, None, None]
        slot = (i % TPS) * NBT + tl.arange(0, NBT)
        bits |= tl.sum(tl.where(hit, (1 << slot)[None, :, None], 0), axis=1)
        if (i % TPS == TPS - 1) | (i == n_tiles - 1):
            cnt += _flush_segment(bits, n_sink + (i // TPS) * SEG, walk_end, out_ptr, row_base, HPP, BQ, SEG)
            bits = tl.zeros([M, 4], dtype=tl.int32)
    return cnt


@triton.jit
def _sale_select_kernel(
    q_ptr, k_ptr, qv_ptr, kv_ptr, qs_ptr, ks_ptr, shift_ptr, logtau_ptr, out_ptr, count_ptr,
    sqb, sqh, sqt, skb, skh, skt, svqb, svqh, svqt, svkb, svkh, svkt,
    Hq, Tq, Tk, NQ, NK, n_sink, local, sm_scale,
    G: tl.constexpr, HPP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, SINK_PAD: tl.constexpr, LOCAL_N: tl.constexpr, FILL: tl.constexpr,
    INT8: tl.constexpr, SCORES: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (batch x head chunk, query block). out: [B, Hq, NQ, NK].

    One program per (batch, ``HPP`` query heads of one KV group, query block), each int8 K tile loaded once
    for all of them: exact ``m~, l~`` of every row over its causal sink/local keys (float, online), then a
    walk over the key blocks between sink and local window in int8 (``tl.dot`` -> int32) that never
    materializes scores: per tile only maxima of the integer products per key block become float (App. G:
    scales are constant over a (row, key block)). Block score ``max_rows(S~max - m~ - ln l~)``, kept iff
    ``>= ln tau``. Writes the tau-free block scores (``SCORES``: ``sale_block_scores``) or a uint8 keep table
    plus a count per row (``sale_select``; int8: :func:`_keep_walk`, hit bits reduced once per segment);
    sink/local blocks kept, blocks above the diagonal dropped; heads whose programs have every ``tau == 0``
    skip the walk (dense).
    """
    M: tl.constexpr = HPP * BQ
    NBT: tl.constexpr = BLOCK_N // BK
    qb = NQ - 1 - tl.program_id(1)  # grid x = heads: every head's longest rows first, the short ones last
    chunks = Hq // HPP
    b = (tl.program_id(0) // chunks).to(tl.int64)
    h0 = (tl.program_id(0) % chunks) * HPP
    hk = h0 // G
    rm = tl.arange(0, M)
    hp = tl.arange(0, HPP)
    head = h0 + rm // BQ
    t = qb * BQ + rm % BQ
    row_ok = t < Tq
    pos = Tk - Tq + t
    first = Tk - Tq + qb * BQ
    last = Tk - Tq + tl.minimum((qb + 1) * BQ, Tq) - 1
    hi = last // BK
    lo = tl.minimum((tl.maximum(last + 1 - local, 0) + BK - 1) // BK, first // BK)
    rd = tl.arange(0, D)

    # exact m~, l~ over the causal sink (blocks < n_sink, outside the local range) and local keys
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + t[:, None] * sqt + rd[None, :], mask=row_ok[:, None],
                other=0.0)
    k_base = k_ptr + b * skb + hk * skh
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    if SINK_PAD > 0:
        ks_t = tl.arange(0, SINK_PAD)
        in_sink = (ks_t < n_sink * BK) & (ks_t < Tk)
        k_sink = tl.load(k_base + ks_t[:, None] * skt + rd[None, :], mask=in_sink[:, None], other=0.0)
        ok_sink = (in_sink & (ks_t // BK < lo))[None, :] & (ks_t[None, :] <= pos[:, None])
        m_i, l_i = _online_update(q, k_sink, ok_sink, m_i, l_i, sm_scale, UPCAST, IEEE)
    for k0 in range(lo * BK, (hi + 1) * BK, LOCAL_N):
        kt = k0 + tl.arange(0, LOCAL_N)
        inside = (kt < (hi + 1) * BK) & (kt < Tk)
        kk = tl.load(k_base + kt[:, None] * skt + rd[None, :], mask=inside[:, None], other=0.0)
        ok = inside[None, :] & (kt[None, :] <= pos[:, None])
        m_i, l_i = _online_update(q, kk, ok, m_i, l_i, sm_scale, UPCAST, IEEE)
    m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
    c = m_i + tl.log(l_i)  # ln of the sink/local normalizer: block score = S~ - c

    # estimated walk over the key blocks between the sink and the local window
    qv = tl.load(qv_ptr + b * svqb + head[:, None] * svqh + t[:, None] * svqt + rd[None, :],
                 mask=row_ok[:, None], other=0)
    if INT8:
        qrow = tl.load(qs_ptr + (b * Hq + head) * NQ + qb) * sm_scale
        shift = tl.load(shift_ptr + (b * Hq + head) * Tq + t, mask=row_ok, other=0.0)
    else:
        if UPCAST:
            qv = qv.to(tl.float32)
    log_tau = tl.load(logtau_ptr + h0 + hp)  # [HPP]
    walk_end = lo
    if not SCORES:  # every head of the program dense: no walk
        walk_end = tl.where(tl.max(log_tau, axis=0) == float("-inf"), n_sink, lo)
    walk_end = tl.maximum(walk_end, n_sink)
    row_base = ((b * Hq + h0 + hp) * NQ + qb) * NK  # [HPP]
    kv_base = kv_ptr + b * svkb + hk * svkh
    cnt = tl.zeros([HPP], dtype=tl.int32)
    score_walk_end = walk_end
    if INT8 and not SCORES:
        cnt = _keep_walk(qv, qrow, shift, c, row_ok, tl.load(logtau_ptr + head), kv_base, svkt,
                         ks_ptr + (b * (Hq // G) + hk) * NK, out_ptr, row_base, n_sink, walk_end, Tk, NK,
                         M, HPP, BQ, BK, D, BLOCK_N)
        score_walk_end = n_sink
    for kb0 in range(n_sink, score_walk_end, NBT):  # block scores, the float estimate
        kt = kb0 * BK + tl.arange(0, BLOCK_N)
        kk = tl.load(kv_base + kt[:, None] * svkt + rd[None, :], mask=(kt < Tk)[:, None], other=0)
        kbs = kb0 + tl.arange(0, NBT)
        if INT8:
            acc = tl.dot(qv, tl.trans(kk), out_dtype=tl.int32)  # [M, BLOCK_N]
            if NBT == 1:
                rmax = tl.max(acc, axis=1)[:, None].to(tl.float32)
            else:
                rmax = tl.max(tl.reshape(acc, [M, NBT, BK]), axis=2).to(tl.float32)  # exact (< 2**24)
            ksc = tl.load(ks_ptr + (b * (Hq // G) + hk) * NK + kbs, mask=kbs < NK, other=1.0)
            sv = rmax * ksc[None, :] * qrow[:, None] + shift[:, None]
        else:
            if UPCAST:
                kk = kk.to(tl.float32)
            if IEEE:
                acc = tl.dot(qv, tl.trans(kk), input_precision="ieee")
            else:
                acc = tl.dot(qv, tl.trans(kk))
            if NBT == 1:
                sv = tl.max(acc, axis=1)[:, None] * sm_scale
            else:
                sv = tl.max(tl.reshape(acc, [M, NBT, BK]), axis=2) * sm_scale
        sv = tl.where(row_ok[:, None], sv - c[:, None], float("-inf"))
        bs = tl.max(tl.reshape(sv, [HPP, BQ, NBT]), axis=1)  # [HPP, NBT] ln max P~ per block
        in_walk = (kbs < walk_end)[None, :] & (hp >= 0)[:, None]
        ptr = out_ptr + row_base[:, None] + kbs[None, :]
        if SCORES:
            tl.store(ptr, bs, mask=in_walk)
        else:
            keep = (bs >= log_tau[:, None]) & in_walk
            tl.store(ptr, keep.to(tl.int8), mask=in_walk)
            cnt += tl.sum(keep.to(tl.int32), axis=1)
    cnt += _fill_rest(out_ptr, row_base, hp, 0, n_sink, hi, SCORES, HPP, FILL)
    cnt += _fill_rest(out_ptr, row_base, hp, walk_end, NK, hi, SCORES, HPP, FILL)
    if not SCORES:
        tl.store(count_ptr + (b * Hq + h0 + hp) * NQ + qb, cnt)


@triton.jit
def _compact_kernel(keep_ptr, offsets_ptr, indices_ptr, NQ, NK, Tq, Tk, BQ, BK, TILE: tl.constexpr):
    """Row r of the keep table [R, NK] int8 -> indices[offsets[r] : offsets[r + 1]] (ascending)."""
    r = tl.program_id(0).to(tl.int64)
    qb = r % NQ
    n = (Tk - Tq + tl.minimum((qb + 1) * BQ, Tq) - 1) // BK + 1  # causal key blocks of the row
    run = tl.load(offsets_ptr + r)
    for j0 in range(0, n, TILE):
        j = j0 + tl.arange(0, TILE)
        kp = tl.load(keep_ptr + r * NK + j, mask=j < n, other=0).to(tl.int32)
        pos = run + tl.cumsum(kp, axis=0) - 1
        tl.store(indices_ptr + pos, j.to(tl.int32), mask=kp > 0)
        run += tl.sum(kp, axis=0)


# ------------------------------------------------------------------------------------------ host side
def compact_keep_table(keep: torch.Tensor, counts: torch.Tensor, seq_q: int, seq_k: int, block_q: int,
                       block_k: int) -> BlockMask:
    """``keep: [B, H, NQ, NK]`` int8 (entries above the diagonal ignored), ``counts: [B*H*NQ]`` kept
    causal blocks per row -> :class:`BlockMask` without a host sync (indices sized for the worst case)."""
    b, h, nq, nk = keep.shape
    offsets = torch.zeros(b * h * nq + 1, dtype=torch.int64, device=keep.device)
    torch.cumsum(counts.view(-1), 0, out=offsets[1:])
    worst = b * h * causal_block_count(seq_q, seq_k, block_q, block_k)
    indices = _alloc((max(worst, 1),), torch.int32, keep.device, -1)
    _compact_kernel[(b * h * nq,)](keep, offsets, indices, nq, nk, seq_q, seq_k, block_q, block_k, TILE=256)
    return BlockMask(offsets, indices, b, h, seq_q, seq_k, block_q, block_k)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, poison: float) -> torch.Tensor:
    return torch.full(shape, poison, dtype=dtype, device=device) if POISON else torch.empty(shape, dtype=dtype,
                                                                                           device=device)


def _supported(q: torch.Tensor, k: torch.Tensor, cfg: SaleSelectionConfig) -> bool:
    """Shapes and dtypes the kernels take; anything else (float64, odd block sizes) runs the reference."""
    d = q.shape[-1]
    return (_pow2(cfg.block_q) and _pow2(cfg.block_k) and cfg.block_q >= 16 and cfg.block_k >= 16
            and _pow2(d) and d >= 16 and q.dtype in (torch.float16, torch.bfloat16, torch.float32))


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    b, hq, tq, d = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[-1] != d or hq % k.shape[1] or tq > k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} are not [B, Hq, Tq, D] / [B, Hkv, Tk, D] "
                         "with Hq % Hkv == 0 and Tq <= Tk")


def _quantize(x: torch.Tensor, block: int, kbar: torch.Tensor | None, shift_of: torch.Tensor | None,
              group: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int8 blocks of ``x: [B, H, T, D]``: (xq [B, H, T, D], scales [B, H, NB], shift [B, H, T] or None).
    ``kbar``: subtract it (K smoothing); ``shift_of``: the k_bar whose q-shift to compute (Q)."""
    b, h, t, d = x.shape
    nb = _ceil_div(t, block)
    xq = torch.empty(b, h, t, d, dtype=torch.int8, device=x.device)
    scales = _alloc((b, h, nb), torch.float32, x.device, math.nan)
    shift = _alloc((b, h, t), torch.float32, x.device, math.nan) if shift_of is not None else None
    mean = kbar if kbar is not None else shift_of
    _sale_quant_kernel[(nb, b * h)](
        x, mean if mean is not None else scales, xq, scales, shift if shift is not None else scales,
        x.stride(0), x.stride(1), x.stride(2), h, t, nb, group, sm_scale,
        BLOCK=block, D=d, SMOOTH=kbar is not None, SHIFT=shift_of is not None, num_warps=4)
    return xq, scales, shift


def quantize_qk(q: torch.Tensor, k: torch.Tensor, cfg: SaleSelectionConfig, sm_scale: float):
    """int8 Q (per ``block_q``) and smoothed K (per ``block_k``) as the reference's 8-bit estimate:
    ``(q_int [B,Hq,Tq,D], q_scales [B,Hq,NQ], k_int [B,Hkv,Tk,D], k_scales [B,Hkv,NK], shift [B,Hq,Tq])``."""
    hq, hkv = q.shape[1], k.shape[1]
    kbar = k.mean(dim=2, dtype=torch.float32) if cfg.smooth_k else torch.zeros(
        k.shape[0], hkv, k.shape[-1], dtype=torch.float32, device=k.device)  # [B, Hkv, D]
    k_int, k_scales, _ = _quantize(k, cfg.block_k, kbar if cfg.smooth_k else None, None, 1, sm_scale)
    q_int, q_scales, shift = _quantize(q, cfg.block_q, None, kbar, hq // hkv, sm_scale)
    return q_int, q_scales, k_int, k_scales, shift


def _heads_per_program(group: int, block_q: int, rows: int = 128) -> int:
    hpp = max(1, min(group, rows // block_q))
    while group % hpp:
        hpp -= 1
    return hpp


def _launch_select(q: torch.Tensor, k: torch.Tensor, cfg: SaleSelectionConfig, sm_scale: float,
                   log_tau: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the selection kernel: (block scores fp32, None) when ``log_tau`` is None, else
    (keep int8, counts int32), both tables ``[B, Hq, NQ, NK]``."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk, group = _ceil_div(tq, bq), _ceil_div(tk, bk), hq // hkv
    n_sink = min(_ceil_div(cfg.sink, bk), nk)
    int8 = cfg.bits is not None
    if int8:
        qv, qs, kv, ks, shift = quantize_qk(q, k, cfg, sm_scale)
    else:
        qv, qs, kv, ks, shift = q, q, k, q, q  # unused scale/shift pointers
    scores = log_tau is None
    hpp = _heads_per_program(group, bq, LAUNCH.rows)
    if scores:
        out = _alloc((b, hq, nq, nk), torch.float32, q.device, math.nan)
        counts, log_tau = out, torch.zeros(hq, dtype=torch.float32, device=q.device)
    else:
        out = _alloc((b, hq, nq, nk), torch.int8, q.device, -1)
        counts = _alloc((b * hq * nq,), torch.int32, q.device, -1)
    block_n = bk * max(1, LAUNCH.block_n // bk)
    sink_pad = 0 if n_sink == 0 else max(16, triton.next_power_of_2(n_sink * bk))
    up = _interpreting() and q.dtype == torch.bfloat16
    _sale_select_kernel[(b * (hq // hpp), nq)](
        q, k, qv, kv, qs, ks, shift, log_tau, out, counts,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qv.stride(0), qv.stride(1), qv.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
        hq, tq, tk, nq, nk, n_sink, cfg.local, sm_scale,
        G=group, HPP=hpp, BQ=bq, BK=bk, D=d, BLOCK_N=block_n, SINK_PAD=sink_pad, LOCAL_N=64, FILL=128,
        INT8=int8, SCORES=scores, UPCAST=up, IEEE=q.dtype == torch.float32,
        num_warps=(LAUNCH.keep_warps if int8 and not scores else LAUNCH.num_warps) if hpp * bq * block_n >= 64 * 64
        else 4, num_stages=LAUNCH.num_stages)
    return out, None if scores else counts


def _prepare(q: torch.Tensor, k: torch.Tensor, cfg: SaleSelectionConfig,
             scale: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    _check(q, k)
    _note_estimator(cfg)
    k = k.to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    return q, k, 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# ----------------------------------------------------------------------------------------- public API
def sale_block_scores(q: torch.Tensor, k: torch.Tensor, *, config: SaleSelectionConfig = SaleSelectionConfig(),
                      scale: float | None = None, chunk_elems: int = 1 << 26) -> torch.Tensor:
    """Per block ``ln`` of its largest Relative Attention Score, ``[B, Hq, NQ, NK]`` float32 (``+inf``
    sink/local, ``-inf`` above the diagonal); as the reference but int8 for 4 bits. ``chunk_elems`` is
    accepted for signature compatibility (the kernel holds no score matrix)."""
    if not _supported(q, k, config):
        return reference.sale_block_scores(q, k, config=config, scale=scale, chunk_elems=chunk_elems)
    q, k, sm_scale = _prepare(q, k, config, scale)
    return _launch_select(q, k, config, sm_scale, None)[0]


def _log_tau(tau: torch.Tensor | float, hq: int, device: torch.device) -> torch.Tensor:
    """``ln tau`` per query head ``[Hq]`` float32; validated only when it costs no device sync."""
    t = torch.as_tensor(tau, dtype=torch.float32)
    if t.device.type == "cpu" and bool(((t < 0) | (t > 1) | t.isnan()).any()):
        raise ValueError(f"tau must lie in [0, 1]; got {t.tolist()}")
    return torch.log(t.to(device).expand(hq)).contiguous()


def sale_select(q: torch.Tensor, k: torch.Tensor, tau: torch.Tensor | float, *, block_q: int = 64,
                block_k: int = 32, sink: int = 32, local: int = 256, bits: int | None = 4, smooth_k: bool = True,
                scale: float | None = None, chunk_elems: int = 1 << 26) -> BlockMask:
    """SALE Selection-Pass on the GPU: ``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]``, ``tau: [Hq]`` (or one
    float; a device tensor is not range-checked, to avoid a sync) -> BlockMask (heads = Hq). No host sync:
    ``mask.indices`` is sized for every causal block, ``mask.offsets`` exact."""
    cfg = SaleSelectionConfig(block_q=block_q, block_k=block_k, sink=sink, local=local, bits=bits,
                              smooth_k=smooth_k)
    if not _supported(q, k, cfg):
        return reference.sale_select(q, k, tau, block_q=block_q, block_k=block_k, sink=sink, local=local,
                                     bits=bits, smooth_k=smooth_k, scale=scale, chunk_elems=chunk_elems)
    q, k, sm_scale = _prepare(q, k, cfg, scale)
    keep, counts = _launch_select(q, k, cfg, sm_scale, _log_tau(tau, q.shape[1], q.device))
    return compact_keep_table(keep, counts, q.shape[2], k.shape[2], block_q, block_k)


def sale_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor | float, *,
                           config: SaleSelectionConfig = SaleSelectionConfig(),
                           scale: float | None = None) -> torch.Tensor:
    """Selection-Pass + :func:`runtime_kernels.blocksparse.api.block_sparse_attention`:
    ``q: [B, Hq, Tq, D]``, ``k, v: [B, Hkv, Tk, D]`` -> ``[B, Hq, Tq, Dv]``."""
    mask = sale_select(q, k, tau, block_q=config.block_q, block_k=config.block_k, sink=config.sink,
                       local=config.local, bits=config.bits, smooth_k=config.smooth_k, scale=scale)
    return blocksparse_api.block_sparse_attention(q, k, v, mask, scale=scale)


# ------------------------------------------------------------------------------------------ inspection
def block_table(mask: BlockMask) -> torch.Tensor:
    """Dense ``[B, H, NQ, NK]`` bool view of a mask whose ``indices`` may be over-allocated (syncs once)."""
    nnz = int(mask.offsets[-1])
    rows = torch.repeat_interleave(torch.arange(mask.offsets.numel() - 1, device=mask.offsets.device),
                                   mask.offsets[1:] - mask.offsets[:-1], output_size=nnz)
    keep = torch.zeros(mask.offsets.numel() - 1, mask.num_k_blocks, dtype=torch.bool, device=mask.offsets.device)
    keep[rows, mask.indices[:nnz].long()] = True
    return keep.view(mask.batch, mask.heads, mask.num_q_blocks, mask.num_k_blocks)


def selection_recall(mask: BlockMask, reference_mask: BlockMask) -> torch.Tensor:
    """Block recall (paper App. H, Table 5): blocks kept by both / blocks kept by ``reference_mask``
    (e.g. full-precision selection), over all (batch, head, query block); a 0-dim float64 tensor."""
    a, r = block_table(mask), block_table(reference_mask.to(mask.offsets.device))
    if a.shape != r.shape:
        raise ValueError(f"masks differ in shape: {tuple(a.shape)} vs {tuple(r.shape)}")
    return (a & r).sum().double() / r.sum().clamp(min=1).double()
