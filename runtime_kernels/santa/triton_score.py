"""S²ANTA-prop pass 1 (Lee et al., arXiv:2605.01910, App. P Alg. 3): scores and tile statistics, K read once.

One program per (tile, KV head) streams the tile's keys in chunks of ``geo.BK`` keys through a
software-pipelined loop (``SCORE_STAGES`` chunks in flight) and, for the G query heads of the group:

* stores the float32 scores ``s = q·k·scale`` (``[B·Hq, Tk_pad]``: the "u-stash" of Alg. 3 line 7,
  kept as scores so the gather recomputes ``exp(s - m_t)`` from an exact copy);
* keeps ``m_t`` and ``ℓ_t = Σ exp(s - m_t)`` online over the chunks and stores them per tile (ℓ_t
  differs from a one-shot sum by float32 rounding only; counts are computed from the stored scores);
* stores per chunk its reference ``r_c`` (the tile's running max after the chunk) and
  ``Σ_chunk exp(s - r_c)``: the terms the online ``ℓ_t`` already forms, two stores and no extra
  exponentials per chunk, so the gather can locate a sample's chunk without re-reading the tile.

Memory-bound: it reads all of K (``N·Hkv·D`` elements per batch row) and writes ``N·Hq`` float32
scores plus ``2·N/BK·Hq`` chunk statistics (1/16 of the scores at BK = 32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime_kernels.santa.triton_device import _load_group_q, _online_chunk, _tile_scores
from runtime_kernels.santa.triton_layout import SCORE_STAGES, SCORE_WARPS, Geometry, ScoreBuffers


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, len_ptr, s_ptr, m_ptr, l_ptr, cm_ptr, cl_ptr,
    scale, G, Hkv, Hq, D, tile, T_all, Tk_pad,
    sqb, sqh, sqd, skb, skh, skn, skd, sls,
    GP: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr, IEEE: tl.constexpr, RELEASE: tl.constexpr,
):
    """Scores, ``(m_t, ℓ_t)`` and chunk statistics of tile ``program_id(0)`` of one KV head's group.

    Tiles past the row's cache length (``t >= T_b``) run no chunk and store nothing. ``RELEASE``: the
    next launch (programmatic dependent launch) may start once every program has begun.
    """
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    g = tl.arange(0, GP)
    gmask = g < G
    row = (b * Hq + kvh * G + g).to(tl.int64)
    j = tl.arange(0, BK)
    n_chunks = tl.minimum(T_b - t, 1) * NCH  # <= 0: the tile holds no key of this row
    q = _load_group_q(q_ptr, b, kvh, G, D, sqb, sqh, sqd, GP, BLOCK_D)
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    m_run = tl.full((GP,), float("-inf"), tl.float32)
    l_run = tl.zeros((GP,), tl.float32)
    for c in tl.range(0, n_chunks, num_stages=STAGES):
        pos = c * BK + j
        key = t * tile + pos
        kmask = (pos < tile) & (key < length)
        s = _tile_scores(q, k_base, key, kmask, D, skn, skd, scale, BLOCK_D, IEEE)
        tl.store(s_ptr + row[:, None] * Tk_pad + key[None, :], s, mask=gmask[:, None] & kmask[None, :])
        m_run, m_ref, l_chunk, l_run = _online_chunk(s, m_run, l_run)
        cix = row * (T_all * NCH) + t * NCH + c
        tl.store(cm_ptr + cix, m_ref, mask=gmask)
        tl.store(cl_ptr + cix, l_chunk, mask=gmask)
    if t < T_b:
        tl.store(m_ptr + row * T_all + t, m_run, mask=gmask)
        tl.store(l_ptr + row * T_all + t, l_run, mask=gmask)


def launch_scores(q: torch.Tensor, k: torch.Tensor, cache_len: torch.Tensor, scale: float, geo: Geometry,
                  bufs: ScoreBuffers, release: bool) -> None:
    """The score pass into ``bufs`` (scores, ``m``, ``ell``, ``chunk_m``, ``chunk_l``).

    q: [B, Hq, D]; k: [B, Hkv, Tk, D] (any strides); cache_len: [B] int64 (any stride); ``release``:
    the next launch is a programmatic dependent launch. Grid ``(T_all, B·Hkv)``: shapes only.
    """
    _score_kernel[(geo.T_all, geo.BH)](
        q, k, cache_len, bufs.scores, bufs.m, bufs.ell, bufs.chunk_m, bufs.chunk_l,
        float(scale), geo.G, geo.Hkv, geo.Hq, geo.D, geo.tile, geo.T_all, geo.Tk_pad,
        *q.stride(), *k.stride(), cache_len.stride(0),
        GP=geo.GP, BK=geo.BK, NCH=geo.NCH, BLOCK_D=geo.BLOCK_D, STAGES=SCORE_STAGES,
        IEEE=q.dtype == torch.float32, RELEASE=release, num_warps=SCORE_WARPS,
    )
