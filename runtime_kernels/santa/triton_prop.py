"""S²ANTA-prop kernels 2 and 3 (Lee et al., arXiv:2605.01910, App. P Alg. 4, 5): tile budgets, then the gather.

* ``_prop_budget_kernel``, one program per query head: quotas ``q_t = S·m̄_t`` from the score pass's
  ``(m_t, ℓ_t)`` (float64), budgets ``S_t = floor(q_t)`` plus one for the ``S - Σ floor(q_t)`` largest
  fractional parts, ranked on a 2^-FRAC_BITS grid by a radix select (ties to the lower tile, as the
  reference's stable sort); it also zeroes the head's output accumulator, so a call needs no memset.
* ``_prop_gather_kernel``, ``gather_tiles(geo)`` tiles of all G heads of a KV head per program: rows
  without budget skip; the others resolve each sample to its key chunk first (from the score pass's
  chunk statistics, one chunk of stored scores read per sample: ``_gather_by_chunks``), load just the
  sampled V rows, sum the program's tiles and add them into the accumulator with float32 atomics; the
  last program of a (batch, KV head) to arrive writes ``acc / S`` (the arrival counter is reset by it).

Tiles without budget never read V (Alg. 5's sparse-V accumulation): per head the gather reads at most
S chunks of scores and S rows of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime_kernels.santa.triton_device import _gather_by_chunks
from runtime_kernels.santa.triton_layout import Geometry, ScoreBuffers, pow2

FRAC_BITS = 20  # fractional parts of the quotas are ranked at 2^-20 resolution (ties: lower tile)
GATHER_TILES = 2  # tiles per gather program: half the atomic adds into each accumulator row
GATHER_SAMPLES = 4  # samples per head resolved to keys per step: [R, 4, NCH] / [R, 4, BK] blocks
GATHER_WARPS = 2  # per tile of a gather program


@triton.jit
def _store_rows(out_ptr, b, kvh, G, D, sob, soh, sod, val, GP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write val [GP, BLOCK_D] (float32) as the output rows of the group's heads, in the output dtype."""
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    ptr = out_ptr + b.to(tl.int64) * sob + (kvh * G + g).to(tl.int64)[:, None] * soh + d[None, :] * sod
    tl.store(ptr, val.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])


@triton.jit
def _prop_budgets(m_ptr, l_ptr, bud_ptr, row, gmask, T_all, T_b, S,
                  BLOCK_T: tl.constexpr, FRAC_BITS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Largest-remainder budgets of ``S·m̄_t`` (App. P Alg. 4) for R rows; stores [R, T_all] int32.

    row: [R] rows of ``B·Hq``; gmask: [R] which rows are real; T_b: the row's tile count; S: its budget.
    The masses ``W_t = exp(m_t - m*)·ℓ_t`` and quotas ``q_t = S·W_t/Z`` are float64.

    The ``rest = S - Σ floor(q_t)`` largest fractional parts (quantized to 2^-FRAC_BITS; ties to the
    lower tile) get one more sample. Their threshold is found by a radix select: each round counts, for
    2^RADIX_BITS candidate thresholds at once, how many fractions reach each, and keeps the largest
    candidate reached by at least ``rest`` of them (FRAC_BITS / RADIX_BITS rounds).
    """
    t = tl.arange(0, BLOCK_T)
    valid = gmask[:, None] & (t < T_b)[None, :]
    offs = row[:, None] * T_all + t[None, :]
    m = tl.load(m_ptr + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
    ell = tl.load(l_ptr + offs, mask=valid, other=0.0, cache_modifier=".cg")
    m_star = tl.max(m, axis=1)
    m_star = tl.where(gmask, m_star, 0.0)
    w = tl.where(valid, tl.exp(m - m_star[:, None]).to(tl.float64) * ell.to(tl.float64), 0.0)
    z = tl.sum(w, axis=1)
    z = tl.where(z > 0, z, 1.0)
    quota = w * (S.to(tl.float64) / z)[:, None]
    floors = tl.floor(quota)
    whole = floors.to(tl.int32)
    rest = S - tl.sum(whole, axis=1)  # samples left for the largest fractional parts
    frac = tl.where(valid, ((quota - floors) * (1 << FRAC_BITS)).to(tl.int32), -1)
    cand = tl.arange(0, 1 << RADIX_BITS)
    thresh = tl.zeros_like(rest)
    for r in tl.static_range(FRAC_BITS // RADIX_BITS):  # largest thresh with #{frac >= thresh} >= rest
        trial = thresh[:, None] + (cand[None, :] << (FRAC_BITS - RADIX_BITS * (r + 1)))  # [GP, C]
        reach = tl.sum((frac[:, :, None] >= trial[:, None, :]).to(tl.int32), axis=1)  # [GP, C]
        step = tl.sum((reach >= rest[:, None]).to(tl.int32), axis=1) - 1
        thresh += step << (FRAC_BITS - RADIX_BITS * (r + 1))
    above = frac > thresh[:, None]
    need = rest - tl.sum(above.to(tl.int32), axis=1)
    tied = frac == thresh[:, None]
    plus = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=1) <= need[:, None]))
    budget = tl.where(valid, whole + plus.to(tl.int32), 0)
    tl.store(bud_ptr + offs, budget, mask=gmask[:, None] & (t < T_all)[None, :])


@triton.jit
def _prop_budget_kernel(
    m_ptr, l_ptr, bud_ptr, acc_ptr, len_ptr, ns_ptr, Hq, tile, T_all, sls, sns,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, FRAC_BITS: tl.constexpr, RADIX_BITS: tl.constexpr,
    GDC: tl.constexpr,
):
    """Budgets of query head ``program_id(0)`` (a row of ``B·Hq``) and its zeroed output accumulator.
    ``GDC``: a programmatic dependent launch after the score pass (waits for it, releases the gather)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    one = tl.arange(0, 1)  # _prop_budgets works on [rows, tiles] blocks: here one row
    head = tl.program_id(0)
    b = head // Hq
    row = (head + one).to(tl.int64)
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    S = tl.load(ns_ptr + b * sns).to(tl.int32)
    _prop_budgets(m_ptr, l_ptr, bud_ptr, row, one < 1, T_all, T_b, S, BLOCK_T, FRAC_BITS, RADIX_BITS)
    d = tl.arange(0, BLOCK_D)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], tl.zeros((1, BLOCK_D), tl.float32))


@triton.jit
def _prop_gather_kernel(
    v_ptr, u_ptr, len_ptr, ns_ptr, s_ptr, cm_ptr, cl_ptr, bud_ptr, acc_ptr, cnt_ptr, out_ptr, counts_ptr,
    G, Hkv, Hq, D, tile, T_all, Tk_pad,
    svb, svh, svn, svd, sub, suh, sut, sob, soh, sod, sls, sns,
    GP: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr, MAXS: tl.constexpr, TPG: tl.constexpr,
    BK: tl.constexpr, NCH: tl.constexpr, WRITE_COUNTS: tl.constexpr, GDC: tl.constexpr,
):
    """Tiles ``TPG·p .. TPG·p + TPG-1`` of (batch, KV head) ``program_id(1)``: ``Σ V[key_j]`` over the
    samples of each head of the group, added into ``acc`` with float32 atomics (one add per head and
    program: its tiles summed first); the last program of the (batch, KV head) writes ``acc / S``.

    Row ``r`` of the program's ``[GP·TPG, ·]`` blocks is head ``r // TPG`` of the group at tile
    ``TPG·p + r % TPG``: all its tiles' budgets, offsets and chunk statistics load in one round trip and
    their samples resolve in one loop. ``WRITE_COUNTS``: per-key counts stored too (``decode_samples``).
    ``GDC``: a programmatic dependent launch after the budgets: the offsets load before ``gdc_wait``,
    budgets and chunk statistics after. Every program arrives at the counter, with or without budget,
    so the grid size (shapes only) fixes the count the last program waits for.
    """
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    r = tl.arange(0, GP * TPG)
    g = r // TPG
    t = tl.program_id(0) * TPG + r % TPG
    rmask = (g < G) & (t < T_all)
    d = tl.arange(0, BLOCK_D)
    row = (b * Hq + kvh * G + g).to(tl.int64)
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    u = tl.load(u_ptr + b.to(tl.int64) * sub + (kvh * G + g).to(tl.int64) * suh + t * sut, mask=rmask, other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
    budget = tl.load(bud_ptr + row * T_all + t, mask=rmask, other=0)
    c = tl.arange(0, NCH)
    cix = row[:, None] * (T_all * NCH) + t[:, None] * NCH + c[None, :]
    cm = tl.load(cm_ptr + cix, mask=rmask[:, None], other=0.0)
    cl = tl.load(cl_ptr + cix, mask=rmask[:, None], other=0.0)
    og = tl.arange(0, GP)  # the group's heads: one accumulator row each
    acc_rows = acc_ptr + (b * Hq + kvh * G + og).to(tl.int64)[:, None] * BLOCK_D + d[None, :]
    acc_mask = (og < G)[:, None]
    if tl.max(budget, axis=0) > 0:
        v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        s_rows = s_ptr + row * Tk_pad + t * tile
        o, counts = _gather_by_chunks(s_rows, cm, cl, budget, u, v_base, t * tile, tile, length, D, svn, svd,
                                      BK, BN, BLOCK_D, MAXS, WRITE_COUNTS)
        o_g = tl.sum(tl.reshape(o, (GP, TPG, BLOCK_D)), axis=1) if TPG > 1 else o
        tl.atomic_add(acc_rows, o_g, mask=acc_mask)
        if WRITE_COUNTS:
            j = tl.arange(0, BN)
            key = t[:, None] * tile + j[None, :]
            kmask = (j < tile)[None, :] & (key < length)
            tl.store(counts_ptr + row[:, None] * Tk_pad + key, counts, mask=rmask[:, None] & kmask)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + bh, 1)
    if done == tl.cdiv(T_all, TPG) - 1:  # every program of this (b, kv head) has added its samples
        acc = tl.load(acc_rows, mask=acc_mask, other=0.0, cache_modifier=".cg")
        inv_s = 1.0 / tl.load(ns_ptr + b * sns).to(tl.float32)
        _store_rows(out_ptr, b, kvh, G, D, sob, soh, sod, acc * inv_s, GP, BLOCK_D)
        tl.atomic_xchg(cnt_ptr + bh, 0)


def _radix_bits(elements: int) -> int:
    """Bits per radix-select round: 16 candidates while the [R, T, C] compare stays <= 8k elements."""
    return 4 if elements <= 512 else 2 if elements <= 2048 else 1


def launch_budgets(num_samples: torch.Tensor, cache_len: torch.Tensor, geo: Geometry, bufs: ScoreBuffers,
                   pdl: bool) -> None:
    """Budgets into ``bufs.budgets`` from ``bufs.m`` / ``bufs.ell``; zeroes ``bufs.acc``. Grid ``(B·Hq,)``."""
    block_t = pow2(geo.T_all, 2)
    _prop_budget_kernel[(geo.B * geo.Hq,)](
        bufs.m, bufs.ell, bufs.budgets, bufs.acc, cache_len, num_samples, geo.Hq, geo.tile, geo.T_all,
        cache_len.stride(0), num_samples.stride(0),
        BLOCK_T=block_t, BLOCK_D=geo.BLOCK_D, FRAC_BITS=FRAC_BITS, RADIX_BITS=_radix_bits(block_t), GDC=pdl,
        num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )


def gather_tiles(geo: Geometry) -> int:
    """Tiles per gather program: GATHER_TILES while the program's ``[GP·tiles, BN]`` block stays <= 8192
    elements, at most the tile count."""
    tpg = GATHER_TILES
    while tpg > 1 and (geo.GP * tpg * geo.BN > 8192 or tpg > geo.T_all):
        tpg //= 2
    return tpg


def launch_prop_gather(v: torch.Tensor, num_samples: torch.Tensor, uniforms: torch.Tensor, cache_len: torch.Tensor,
                       geo: Geometry, bufs: ScoreBuffers, out: torch.Tensor, counts: torch.Tensor | None,
                       counters: torch.Tensor, pdl: bool) -> None:
    """The gather: ``out`` [B, Hq, D] (any strides) from V [B, Hkv, Tk, D], the offsets ``uniforms``
    [B, Hq, T_all] and ``bufs``; ``counts`` ([B·Hq·Tk_pad] int32) receives per-key counts when given.
    ``counters``: >= B·Hkv zeroed int32 arrival counters. Grid ``(ceil(T_all / tiles), B·Hkv)``."""
    tpg = gather_tiles(geo)
    _prop_gather_kernel[(triton.cdiv(geo.T_all, tpg), geo.BH)](
        v, uniforms, cache_len, num_samples, bufs.scores, bufs.chunk_m, bufs.chunk_l, bufs.budgets, bufs.acc,
        counters, out, counts if counts is not None else out,
        geo.G, geo.Hkv, geo.Hq, geo.D, geo.tile, geo.T_all, geo.Tk_pad,
        *v.stride(), *uniforms.stride(), *out.stride(), cache_len.stride(0), num_samples.stride(0),
        GP=geo.GP, BN=geo.BN, BLOCK_D=geo.BLOCK_D, MAXS=GATHER_SAMPLES, TPG=tpg, BK=geo.BK, NCH=geo.NCH,
        WRITE_COUNTS=counts is not None, GDC=pdl, num_warps=GATHER_WARPS * tpg,
        **({"launch_pdl": True} if pdl else {}),
    )
