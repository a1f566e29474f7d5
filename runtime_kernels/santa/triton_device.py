"""``@triton.jit`` helpers shared by the SANTA decode stages (``triton_score``, ``triton_prop``,
``triton_flash``; the algorithm is in :mod:`runtime_kernels.santa.triton`'s docstring): the group's
queries, a key tile's or chunk's scores, the online tile statistics ``(m_t, ℓ_t)`` of Lee et al.
(arXiv:2605.01910, App. P Alg. 3), and the systematic draw of App. P Alg. 5 / App. Q Alg. 7 resolved chunk
first, with the gather of the sampled V rows.

The G query heads of a KV head are processed together (a [GP, ·] block, GP = G padded to a power of
two), so each K chunk and each sampled V row is loaded once for the group (GQA)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_group_q(q_ptr, b, kvh, G, D, sqb, sqh, sqd, GP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query rows of the G heads of KV head ``kvh``: [GP, BLOCK_D] (zero padding rows / columns)."""
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    ptr = q_ptr + b.to(tl.int64) * sqb + (kvh * G + g)[:, None].to(tl.int64) * sqh + d[None, :] * sqd
    return tl.load(ptr, mask=(g < G)[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _tile_keys(t, tile, length, BN: tl.constexpr):
    """Key indices [BN] of tile ``t`` and which of them are real keys of the cache (``< length``)."""
    j = tl.arange(0, BN)
    key = t * tile + j
    return key, (j < tile) & (key < length)


@triton.jit
def _tile_scores(q, k_base, key, kmask, D, skn, skd, scale, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Scores [GP, BN] float32 of one tile for all heads of the group; ``-inf`` on keys outside it."""
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_base + key[:, None].to(tl.int64) * skn + d[None, :] * skd,
                mask=kmask[:, None] & (d < D)[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    return tl.where(kmask[None, :], s, float("-inf"))


@triton.jit
def _online_chunk(s, m_run, l_run):
    """One K chunk's scores s [GP, BK] into the running tile max / sum: returns ``(m_new, r, l_chunk,
    l_new)`` with ``r`` the chunk's reference (the running max, 0 while the tile has no key yet),
    ``l_chunk = Σ exp(s - r)`` and ``l_new = l_run·exp(m_run - r) + l_chunk``."""
    m_new = tl.maximum(m_run, tl.max(s, axis=1))
    r = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_chunk = tl.sum(tl.exp(s - r[:, None]), axis=1)
    return m_new, r, l_chunk, l_run * tl.exp(m_run - r) + l_chunk


@triton.jit
def _sampled_rows(v_base, keys, ok, D, svn, svd, BLOCK_D: tl.constexpr):
    """``Σ_j V[keys[:, j]]`` [R, BLOCK_D] float32 over the samples with ``ok`` (keys, ok: [R, MAXS])."""
    d = tl.arange(0, BLOCK_D)
    v = tl.load(v_base + keys.to(tl.int64)[:, :, None] * svn + d[None, None, :] * svd,
                mask=ok[:, :, None] & (d < D)[None, None, :], other=0.0)
    return tl.sum(v.to(tl.float32), axis=1)


@triton.jit
def _gather_by_chunks(s_rows, cm, cl, budget, u, v_base, tile_start, tile, length, D, svn, svd,
                      BK: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr, MAXS: tl.constexpr,
                      COUNTS: tl.constexpr):
    """The systematic draw of R tile rows, located chunk first: one BK-key chunk of scores read per sample.

    Sample j of a tile with budget ``S_t`` and offset u sits at key ``#{n : C_n <= x_j}``, ``x_j = (j + u)·Z/S_t``
    (``C_n`` the inclusive cumulative weight ``Σ exp(s - M)``, M the tile max, Z the total). The score
    pass's chunk statistics give each chunk's weight ``W_c = cl_c·exp(cm_c - M)`` (``cl_c = Σ_chunk
    exp(s - cm_c)``), so the sample's chunk is ``#{c : P_c <= x_j}`` over the chunk prefix sums P (float64,
    [R, MAXS, NCH] compares), and only that chunk's BK stored scores are loaded, exponentiated and summed
    (float32) to find the key: ``[R, MAXS, BK]`` work per step instead of ``[R, MAXS, BN]`` compares plus
    an int64 prefix sum and float64 ceilings over every key of the tile. Exactly ``S_t`` samples, in key
    order, each on a real key: a chunk or key index that rounding pushes past the last positive weight is
    clamped to it. The weights differ from the whole-tile sums by float32 rounding (as the scores
    themselves), so a count differs from the float64 reference only next to a boundary.

    s_rows: [R] pointers to each row's tile scores; cm, cl: [R, NCH] chunk statistics (rows without
    budget: any finite values); budget: [R] int32; u: [R] float64; tile_start: [R] first key of the tile;
    tile: keys per tile; length: the cache length. Returns ``(Σ_j V[key_j] [R, BLOCK_D] float32, counts)``,
    counts [R, BN] int32 per key of the tile with ``COUNTS`` (else a [1] placeholder).
    """
    c = tl.arange(0, cm.shape[1])
    k = tl.arange(0, BK)
    live = budget > 0
    m_t = tl.max(tl.where(live[:, None], cm, 0.0), axis=1)
    w_c = tl.where(live[:, None], cl, 0.0) * tl.exp(tl.where(live[:, None], cm - m_t[:, None], float("-inf")))
    p_c = tl.cumsum(w_c.to(tl.float64), axis=1)
    z = tl.max(p_c, axis=1)
    step = z / tl.maximum(budget, 1).to(tl.float64)
    last_c = tl.max(tl.where(w_c > 0, c[None, :], 0), axis=1)
    j = tl.arange(0, MAXS)
    out = tl.zeros((cm.shape[0], BLOCK_D), tl.float32)
    if COUNTS:
        counts = tl.zeros((cm.shape[0], BN), tl.int32)
        n = tl.arange(0, BN)
    else:
        counts = tl.zeros((1,), tl.int32)
    top = tl.max(budget, axis=0)
    j0 = tl.full((), 0, tl.int32)
    while j0 < top:
        jj = j0 + j
        ok = jj[None, :] < budget[:, None]  # [R, MAXS]
        x = (jj.to(tl.float64)[None, :] + u[:, None]) * step[:, None]
        chunk = tl.sum((p_c[:, None, :] <= x[:, :, None]).to(tl.int32), axis=2)
        chunk = tl.minimum(chunk, last_c[:, None])
        before = tl.sum(tl.where(c[None, None, :] < chunk[:, :, None], w_c.to(tl.float64)[:, None, :], 0.0), axis=2)
        x_in = (x - before).to(tl.float32)
        pos = chunk[:, :, None] * BK + k[None, None, :]  # [R, MAXS, BK] keys in the tile
        kmask = ok[:, :, None] & (pos < tile) & (tile_start[:, None, None] + pos < length)
        s = tl.load(s_rows[:, None, None] + pos, mask=kmask, other=float("-inf"))
        w = tl.exp(s - m_t[:, None, None])
        cum = tl.cumsum(w, axis=2)
        off = tl.sum((cum <= x_in[:, :, None]).to(tl.int32), axis=2)
        off = tl.minimum(off, tl.max(tl.where(w > 0, k[None, None, :], 0), axis=2))
        in_tile = chunk * BK + off
        out += _sampled_rows(v_base, tile_start[:, None] + in_tile, ok, D, svn, svd, BLOCK_D)
        if COUNTS:
            hit = (in_tile[:, :, None] == n[None, None, :]) & ok[:, :, None]
            counts += tl.sum(hit.to(tl.int32), axis=1)
        j0 += MAXS
    return out, counts


