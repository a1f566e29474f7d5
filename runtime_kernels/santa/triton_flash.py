"""S²ANTA-flash (Lee et al., arXiv:2605.01910, §3.3, App. Q Alg. 6-8): per-tile partials in one pass over K, then
their merge.

* ``_flash_stream_kernel``, one program per (tile, KV head) (Alg. 7): the tile's scores in pipelined
  K chunks (as the score pass: ``triton_score``), stored float32; after a CTA barrier the tile's
  systematic counts with the uniform budget ``S_tile = max(1, round_half_up(S / T_b))``, the sampled V
  rows and the partial ``(m_t, ℓ_t, ℓ_t·μ̂_t)``, μ̂_t the mean of the tile's samples. The stored
  scores are re-read from L1/L2, so K is read once. How a sample finds its key is chosen by the host
  from the tile count of the cache allocation (``chunked``): on long caches (few samples per tile),
  chunk first from chunk statistics kept in registers as K streams, one chunk of scores read per
  sample (``_gather_by_chunks``, as prop's gather); on shorter ones, where a tile holds tens of
  samples, the tile's weights are prefix-summed whole in int64 fixed point (``_flash_tile``).
* ``_flash_merge_kernel``, one program per (batch, KV head) and MERGE_COLS output columns (Alg. 8):
  log-sum-exp merge of the row's T_b partials, MERGE_CHUNK per pipelined load step, ``A / L`` in the
  output dtype: ``O = Σ_t W_t μ̂_t / Σ_t W_t`` with ``W_t = exp(m_t - m*)·ℓ_t``.

Tiles past a row's cache length write no partial and the merge reads only the row's T_b tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime_kernels.santa.triton_device import (
    _gather_by_chunks,
    _load_group_q,
    _online_chunk,
    _sampled_rows,
    _tile_keys,
    _tile_scores,
)
from runtime_kernels.santa.triton_layout import SCORE_STAGES, SCORE_WARPS, Geometry, pow2

FLASH_SAMPLES = 16  # whole-tile lookup: samples per head resolved to keys per step
FLASH_CHUNK_SAMPLES = 8  # chunk-first lookup: the same
MERGE_COLS = 16  # output columns per merge program (more programs for small B·Hkv)
MERGE_CHUNK = 128  # tile partials per pipelined merge load step (few dependent steps per row)


@triton.jit
def _systematic_counts(w, budget, u):
    """Per-key sample counts of the in-tile weights w [GP, BN] (float32 in [0, 1]).

    budget: [GP] int32 (S_t per head), u: [GP] float64 offsets. Returns ``(counts, c_hi)``, both
    [GP, BN] int32: ``c_hi[n]`` = samples drawn at keys ``<= n`` (``S_t`` at the last key) and
    ``counts[n] = c_hi[n] - c_hi[n-1]``. The weights become int64 fixed point (``floor(w·2^32)``)
    before the prefix sum, so ``C_{n-1} = C_n - w_n`` exactly: counts are never negative and each row
    sums to its budget exactly; ``S_t·C/Z - u`` is float64, as in the reference.
    """
    wq = (w * 4294967296.0).to(tl.int64)  # fixed point 2^32: the prefix sum below is exact
    cum = tl.cumsum(wq, axis=1)
    z = tl.maximum(tl.max(cum, axis=1), 1)
    ratio = budget.to(tl.float64) / z.to(tl.float64)
    top = budget.to(tl.float64)[:, None]
    c_hi = tl.ceil(cum.to(tl.float64) * ratio[:, None] - u[:, None])
    c_lo = tl.ceil((cum - wq).to(tl.float64) * ratio[:, None] - u[:, None])
    c_hi = tl.minimum(tl.maximum(c_hi, 0.0), top).to(tl.int32)
    c_lo = tl.minimum(tl.maximum(c_lo, 0.0), top).to(tl.int32)
    return c_hi - c_lo, c_hi


@triton.jit
def _gather_samples(c_hi, budget, v_base, tile_start, D, svn, svd,
                    BLOCK_D: tl.constexpr, MAXS: tl.constexpr):
    """``Σ_j V[key_j]`` [GP, BLOCK_D] float32 over each head's samples ``j < budget``, MAXS at a time.

    Sample j sits at key ``#{n : c_hi[n] <= j}``; only the sampled rows are loaded (no V tile staging).
    """
    j = tl.arange(0, MAXS)
    out = tl.zeros((c_hi.shape[0], BLOCK_D), tl.float32)
    top = tl.max(budget, axis=0)
    j0 = tl.full((), 0, tl.int32)
    while j0 < top:
        jj = j0 + j
        key = tl.sum((c_hi[:, None, :] <= jj[None, :, None]).to(tl.int32), axis=2)  # [GP, MAXS]
        out += _sampled_rows(v_base, tile_start + key, jj[None, :] < budget[:, None], D, svn, svd, BLOCK_D)
        j0 += MAXS
    return out


@triton.jit
def _flash_tile_budget(ns_ptr, b, sns, T_b):
    """flash's per-tile budget ``S_tile = max(1, round_half_up(S / T_b))`` of batch row b."""
    S = tl.load(ns_ptr + b * sns).to(tl.int32)
    return tl.maximum((2 * S + T_b) // (2 * T_b), 1)


@triton.jit
def _store_flash_partial(work_ptr, bh, t, T_all, m_t, l_t, sum_v, s_tile, GP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile t's partial ``(m_t, ℓ_t, ℓ_t · mean of its S_tile samples)`` into the work buffer's three
    planes ``m, L [B·Hkv·T_all·GP]``, ``A [B·Hkv·T_all·GP·BLOCK_D]`` (grid axis 1 = B·Hkv)."""
    n_tp = tl.num_programs(1).to(tl.int64) * T_all * GP
    row = bh.to(tl.int64) * T_all + t
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    tl.store(work_ptr + row * GP + g, m_t)
    tl.store(work_ptr + n_tp + row * GP + g, l_t)
    tl.store(work_ptr + 2 * n_tp + (row * GP + g[:, None]) * BLOCK_D + d[None, :],
             sum_v * (l_t / s_tile.to(tl.float32))[:, None])


@triton.jit
def _flash_tile(s, kmask, key, b, kvh, t, bh, G, Hq, D, T_all, Tk_pad, v_ptr, u_ptr, ns_ptr, work_ptr,
                counts_ptr, T_b, tile, svb, svh, svn, svd, sub, suh, sut, sns, GP: tl.constexpr,
                BLOCK_D: tl.constexpr, WRITE_COUNTS: tl.constexpr, MAXS: tl.constexpr):
    """Tile t's partial ``(m_t, ℓ_t, ℓ_t·μ̂_t)`` from its scores s [GP, BN] (``-inf`` off the tile):
    the whole-tile lookup, counts from an exact int64 prefix sum (:func:`_systematic_counts`), then
    only the sampled V rows, MAXS samples per head per step."""
    g = tl.arange(0, GP)
    gmask = g < G
    s_tile = _flash_tile_budget(ns_ptr, b, sns, T_b)
    m_t = tl.max(s, axis=1)
    m_t = tl.where(gmask, m_t, 0.0)  # padding heads: no scores, no samples
    w = tl.exp(s - m_t[:, None])
    l_t = tl.sum(w, axis=1)
    head = (kvh * G + g).to(tl.int64)
    u = tl.load(u_ptr + b.to(tl.int64) * sub + head * suh + t * sut, mask=gmask, other=0.0)
    budget = tl.where(gmask, s_tile, 0)
    counts, c_hi = _systematic_counts(w, budget, u)
    v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    o = _gather_samples(c_hi, budget, v_base, t * tile, D, svn, svd, BLOCK_D, MAXS)
    _store_flash_partial(work_ptr, bh, t, T_all, m_t, l_t, o, s_tile, GP, BLOCK_D)
    if WRITE_COUNTS:
        row = (b * Hq + kvh * G + g).to(tl.int64)
        tl.store(counts_ptr + row[:, None] * Tk_pad + key[None, :], counts, mask=gmask[:, None] & kmask[None, :])


@triton.jit
def _merge_partials(pm_ptr, pl_ptr, pa_ptr, first, n, d,
                    GP: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr):
    """Log-sum-exp merge of partial rows ``first + [0, n)`` for the columns ``d`` (a [MD] block of
    ``[0, BLOCK_D)``), CH rows per software-pipelined step.

    A partial is ``(m, L, A)`` per head: ``L = Σ e^{s-m}``, ``A = Σ e^{s-m}·value``; rows live at
    ``pm/pl[(first + r)·GP + g]`` and ``pa[((first + r)·GP + g)·BLOCK_D + d]``. Returns the merged
    ``(m [GP], L [GP], A [GP, MD])``; no rows gives ``(-inf, 0, 0)``. Loads bypass L1 (``.cg``): the
    partials come from other programs.
    """
    g = tl.arange(0, GP)
    c = tl.arange(0, CH)
    m_run = tl.full((GP,), float("-inf"), tl.float32)
    l_run = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, d.shape[0]), tl.float32)
    for r in tl.range(0, n, CH, num_stages=3):
        rows = first + r + c
        rmask = (r + c) < n
        pm = tl.load(pm_ptr + rows[:, None] * GP + g[None, :], mask=rmask[:, None], other=float("-inf"),
                     cache_modifier=".cg")
        pl = tl.load(pl_ptr + rows[:, None] * GP + g[None, :], mask=rmask[:, None], other=0.0,
                     cache_modifier=".cg")
        pa = tl.load(pa_ptr + (rows[:, None, None] * GP + g[None, :, None]) * BLOCK_D + d[None, None, :],
                     mask=rmask[:, None, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(pm, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        wgt = tl.exp(pm - m_ref[None, :])  # [CH, GP]
        alpha = tl.exp(m_run - m_ref)
        l_run = l_run * alpha + tl.sum(wgt * pl, axis=0)
        acc = acc * alpha[:, None] + tl.sum(wgt[:, :, None] * pa, axis=0)
        m_run = m_new
    return m_run, l_run, acc


@triton.jit
def _flash_stream_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, len_ptr, ns_ptr, s_ptr, work_ptr, counts_ptr,
    scale, G, Hkv, Hq, D, tile, T_all, Tk_pad,
    sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sub, suh, sut, sls, sns,
    GP: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr, IEEE: tl.constexpr, WRITE_COUNTS: tl.constexpr, MAXS: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    """Tile ``program_id(0)``'s partial for the G heads of (batch, KV head) ``program_id(1)``, K read once:
    the tile's scores in NCH software-pipelined chunks of BK keys, stored float32, then, after a CTA
    barrier, its counts, sampled V rows and partial from the scores it just stored. ``CHUNKED``: the
    chunk statistics ``(r_c, Σ exp(s - r_c))`` are kept in registers ([GP, NCH]) as the chunks stream,
    each sample's chunk is located from them and only that chunk of scores is read
    (:func:`_gather_by_chunks`; ``ℓ_t`` is the online sum); else the whole tile is re-read and
    prefix-summed (:func:`_flash_tile`). Tiles past the row's cache length do nothing."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    if t < T_b:
        g = tl.arange(0, GP)
        gmask = g < G
        row = (b * Hq + kvh * G + g).to(tl.int64)
        j = tl.arange(0, BK)
        q = _load_group_q(q_ptr, b, kvh, G, D, sqb, sqh, sqd, GP, BLOCK_D)
        k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        ci = tl.arange(0, NCH)
        cm = tl.zeros((GP, NCH), tl.float32)
        cl = tl.zeros((GP, NCH), tl.float32)
        m_run = tl.full((GP,), float("-inf"), tl.float32)
        l_run = tl.zeros((GP,), tl.float32)
        for c in tl.range(0, NCH, num_stages=STAGES):
            pos = c * BK + j
            key = t * tile + pos
            kmask = (pos < tile) & (key < length)
            s = _tile_scores(q, k_base, key, kmask, D, skn, skd, scale, BLOCK_D, IEEE)
            tl.store(s_ptr + row[:, None] * Tk_pad + key[None, :], s, mask=gmask[:, None] & kmask[None, :])
            if CHUNKED:  # chunk statistics as the score pass's, kept in registers
                m_run, m_ref, l_chunk, l_run = _online_chunk(s, m_run, l_run)
                here = (ci == c)[None, :]
                cm = tl.where(here, m_ref[:, None], cm)
                cl = tl.where(here, l_chunk[:, None], cl)
        tl.debug_barrier()  # the whole tile's scores, stored by every thread of the program, are visible
        key, kmask = _tile_keys(t, tile, length, BN)
        if CHUNKED:
            s_tile = _flash_tile_budget(ns_ptr, b, sns, T_b)
            budget = tl.where(gmask, s_tile, 0)
            u = tl.load(u_ptr + b.to(tl.int64) * sub + (kvh * G + g).to(tl.int64) * suh + t * sut, mask=gmask,
                        other=0.0)
            v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
            o, counts = _gather_by_chunks(s_ptr + (row * Tk_pad + t * tile), cm, cl, budget, u, v_base,
                                          t * tile + 0 * g, tile, length, D, svn, svd, BK, BN, BLOCK_D, MAXS,
                                          WRITE_COUNTS)
            _store_flash_partial(work_ptr, bh, t, T_all, tl.where(gmask, m_run, 0.0), tl.where(gmask, l_run, 0.0),
                                 o, s_tile, GP, BLOCK_D)
            if WRITE_COUNTS:
                tl.store(counts_ptr + row[:, None] * Tk_pad + key[None, :], counts,
                         mask=gmask[:, None] & kmask[None, :])
        else:
            s = tl.load(s_ptr + row[:, None] * Tk_pad + key[None, :], mask=gmask[:, None] & kmask[None, :],
                        other=float("-inf"))
            _flash_tile(s, kmask, key, b, kvh, t, bh, G, Hq, D, T_all, Tk_pad, v_ptr, u_ptr, ns_ptr, work_ptr,
                        counts_ptr, T_b, tile, svb, svh, svn, svd, sub, suh, sut, sns, GP, BLOCK_D,
                        WRITE_COUNTS, MAXS)


@triton.jit
def _flash_merge_kernel(
    work_ptr, len_ptr, out_ptr, G, Hkv, D, tile, T_all, sob, soh, sod, sls,
    GP: tl.constexpr, BLOCK_D: tl.constexpr, MD: tl.constexpr, CH: tl.constexpr,
):
    """Log-sum-exp merge of one (batch, KV head)'s tile partials for MD output columns (grid: (B·Hkv,
    BLOCK_D / MD)): CH partials per software-pipelined load step, then ``A / L`` in the output dtype."""
    bh = tl.program_id(0)
    n_bh = tl.num_programs(0)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    n_tp = n_bh.to(tl.int64) * T_all * GP
    g = tl.arange(0, GP)
    d = tl.program_id(1) * MD + tl.arange(0, MD)
    _, l_run, acc = _merge_partials(work_ptr, work_ptr + n_tp, work_ptr + 2 * n_tp, bh.to(tl.int64) * T_all, T_b, d,
                                    GP, BLOCK_D, CH)
    res = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    ptr = out_ptr + b.to(tl.int64) * sob + (kvh * G + g).to(tl.int64)[:, None] * soh + d[None, :] * sod
    tl.store(ptr, res.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])


def launch_flash_stream(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_samples: torch.Tensor,
                        uniforms: torch.Tensor, cache_len: torch.Tensor, scale: float, geo: Geometry,
                        scores: torch.Tensor, work: torch.Tensor, counts: torch.Tensor | None, chunked: bool) -> None:
    """The tile partials into ``work`` ([B·Hkv·T_all·GP·(2 + BLOCK_D)] float32); ``scores``:
    [B·Hq·Tk_pad] float32 scratch; ``counts`` ([B·Hq·Tk_pad] int32) receives per-key counts when given;
    ``chunked``: the chunk-first sample lookup. Grid ``(T_all, B·Hkv)``: shapes only."""
    _flash_stream_kernel[(geo.T_all, geo.BH)](
        q, k, v, uniforms, cache_len, num_samples, scores, work, counts if counts is not None else scores,
        float(scale), geo.G, geo.Hkv, geo.Hq, geo.D, geo.tile, geo.T_all, geo.Tk_pad,
        *q.stride(), *k.stride(), *v.stride(), *uniforms.stride(), cache_len.stride(0), num_samples.stride(0),
        GP=geo.GP, BK=geo.BK, NCH=geo.NCH, BN=geo.BN, BLOCK_D=geo.BLOCK_D, STAGES=SCORE_STAGES,
        IEEE=q.dtype == torch.float32, WRITE_COUNTS=counts is not None,
        MAXS=FLASH_CHUNK_SAMPLES if chunked else FLASH_SAMPLES, CHUNKED=chunked, num_warps=SCORE_WARPS,
    )


def launch_flash_merge(cache_len: torch.Tensor, geo: Geometry, work: torch.Tensor, out: torch.Tensor) -> None:
    """The merge of ``work``'s partials into ``out`` [B, Hq, D] (any strides). Grid ``(B·Hkv, BLOCK_D / MD)``."""
    md = min(geo.BLOCK_D, MERGE_COLS)
    _flash_merge_kernel[(geo.BH, geo.BLOCK_D // md)](
        work, cache_len, out, geo.G, geo.Hkv, geo.D, geo.tile, geo.T_all, *out.stride(), cache_len.stride(0),
        GP=geo.GP, BLOCK_D=geo.BLOCK_D, MD=md, CH=min(MERGE_CHUNK, pow2(geo.T_all, 2)), num_warps=4,
    )
