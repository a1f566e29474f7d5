"""Device functions (``@triton.jit`` helpers) of the SANTA decode kernels in
:mod:`runtime_kernels.santa.triton` (whose docstring has the algorithm, the stages and their costs):
the group's queries and a key tile's scores, systematic per-key counts and the gather of sampled V
rows, proportional tile budgets by largest remainder, and the flash path's per-tile partials and
their merge by tile mass (papers/santa.txt §3, App. P, Q)."""

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
def _systematic_counts(w, budget, u):
    """Per-key sample counts of the in-tile weights w [GP, BN] (float32 in [0, 1]).

    budget: [GP] int32 (S_t per head), u: [GP] float64 offsets. Returns ``(counts, c_hi)``, both
    [GP, BN] int32: ``c_hi[n]`` = samples drawn at keys ``<= n`` (``S_t`` at the last key) and
    ``counts[n] = c_hi[n] - c_hi[n-1]``; each row of counts sums to its budget exactly.
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
def _sampled_rows(v_base, keys, ok, D, svn, svd, BLOCK_D: tl.constexpr):
    """``Σ_j V[keys[:, j]]`` [R, BLOCK_D] float32 over the samples with ``ok`` (keys, ok: [R, MAXS])."""
    d = tl.arange(0, BLOCK_D)
    v = tl.load(v_base + keys.to(tl.int64)[:, :, None] * svn + d[None, None, :] * svd,
                mask=ok[:, :, None] & (d < D)[None, None, :], other=0.0)
    return tl.sum(v.to(tl.float32), axis=1)


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
def _gather_by_thresholds(w, budget, u, v_base, tile_start, D, svn, svd,
                          BLOCK_D: tl.constexpr, MAXS: tl.constexpr):
    """:func:`_gather_samples` of :func:`_systematic_counts`'s draw without per-key float64 work.

    Sample j lands at the first key whose ``c_hi`` exceeds j, and ``ceil(S_t·C_n/Z - u) <= j`` iff
    ``C_n <= (j + u)·Z/S_t`` iff ``C_n <= floor((j + u)·Z/S_t)`` (C_n an integer): so one float64
    threshold per sample ([R, MAXS]) and int64 compares replace the per-key conversions, scaling and
    ceilings of ``c_hi`` (float64 rounding of the threshold vs of ``S_t·C_n/Z``: ~1e-16 relative,
    far inside the float32-score tolerance the counts are specified to). The threshold is capped at
    ``Z - 1``, so every sample stays on a key of positive weight. w: [R, BN] in-tile weights,
    budget: [R] int32, u: [R] float64, tile_start: [R, 1] (or scalar) first key of each row's tile.
    """
    wq = (w * 4294967296.0).to(tl.int64)
    cum = tl.cumsum(wq, axis=1)
    z = tl.maximum(tl.max(cum, axis=1), 1)
    step = z.to(tl.float64) / tl.maximum(budget, 1).to(tl.float64)
    j = tl.arange(0, MAXS)
    out = tl.zeros((w.shape[0], BLOCK_D), tl.float32)
    top = tl.max(budget, axis=0)
    j0 = tl.full((), 0, tl.int32)
    while j0 < top:
        jj = j0 + j
        thr = tl.floor((jj.to(tl.float64)[None, :] + u[:, None]) * step[:, None]).to(tl.int64)
        thr = tl.minimum(thr, z[:, None] - 1)
        key = tl.sum((cum[:, None, :] <= thr[:, :, None]).to(tl.int32), axis=2)  # [R, MAXS]
        out += _sampled_rows(v_base, tile_start + key, jj[None, :] < budget[:, None], D, svn, svd, BLOCK_D)
        j0 += MAXS
    return out


@triton.jit
def _gather_by_chunks(s_rows, cm, cl, budget, u, v_base, tile_start, tile, length, D, svn, svd,
                      BK: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr, MAXS: tl.constexpr,
                      COUNTS: tl.constexpr):
    """:func:`_gather_samples`'s draw located chunk first, reading one BK-key chunk of scores per sample.

    Sample j of a tile with budget ``S_t`` and offset u sits at key ``#{n : C_n <= x_j}``, ``x_j = (j + u)·Z/S_t``
    (``C_n`` the inclusive cumulative weight ``Σ exp(s - M)``, M the tile max, Z the total). The score
    pass's chunk statistics give each chunk's weight ``W_c = cl_c·exp(cm_c - M)`` (``cl_c = Σ_chunk
    exp(s - cm_c)``), so the sample's chunk is ``#{c : P_c <= x_j}`` over the chunk prefix sums P (float64,
    [R, MAXS, NCH] compares), and only that chunk's BK stored scores are loaded, exponentiated and summed
    (float32) to find the key: ``[R, MAXS, BK]`` work per step instead of ``[R, MAXS, BN]`` compares plus
    an int64 prefix sum and float64 ceilings over every key of the tile. Exactly ``S_t`` samples, in key
    order, each on a real key: a chunk or key index that rounding pushes past the last positive weight is
    clamped to it. The weights differ from the whole-tile sums by float32 rounding (~1e-7 relative, as
    the scores themselves), so a count differs from the float64 reference only next to a boundary.

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


@triton.jit
def _gather_values(counts, v_base, key, kmask, D, svn, svd, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """``Σ_n counts[:, n] V_n`` [GP, BLOCK_D] float32, loading only rows some head sampled."""
    d = tl.arange(0, BLOCK_D)
    rows = (tl.max(counts, axis=0) > 0) & kmask
    v = tl.load(v_base + key[:, None].to(tl.int64) * svn + d[None, :] * svd,
                mask=rows[:, None] & (d < D)[None, :], other=0.0)
    out = tl.zeros((counts.shape[0], BLOCK_D), tl.float32)
    rem = counts
    mult = tl.full((), 1.0, tl.float32)
    while tl.max(tl.max(rem, axis=1), axis=0) > 0:  # base-256 digits: exact in bf16; once if all < 256
        digit = (rem & 255).to(v.dtype)
        if IEEE:
            part = tl.dot(digit, v, input_precision="ieee")
        else:
            part = tl.dot(digit, v)
        out += mult * part
        rem = rem >> 8
        mult = mult * 256.0
    return out


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
    """Largest-remainder budgets of S·m̄_t for the group's heads; stores [GP, T_all] int32 rows.

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


# ---------------------------------------- flash: per-tile partials and their merge


@triton.jit
def _merge_partials(pm_ptr, pl_ptr, pa_ptr, first, lo, hi, d,
                    GP: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr):
    """Log-sum-exp merge of partial rows ``first + [lo, hi)`` for the columns ``d`` (a [MD] block of
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
    for r in tl.range(lo, hi, CH, num_stages=3):
        rows = first + r + c
        rmask = (r + c) < hi
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
def _store_partial(pm_ptr, pl_ptr, pa_ptr, row, m, ell, acc, GP: tl.constexpr, BLOCK_D: tl.constexpr):
    g = tl.arange(0, GP)
    d = tl.arange(0, BLOCK_D)
    tl.store(pm_ptr + row * GP + g, m)
    tl.store(pl_ptr + row * GP + g, ell)
    tl.store(pa_ptr + (row * GP + g[:, None]) * BLOCK_D + d[None, :], acc)


@triton.jit
def _flash_tile_budget(ns_ptr, b, sns, T_b):
    """flash's per-tile budget ``S_tile = max(1, round_half_up(S / T_b))`` of batch row b."""
    S = tl.load(ns_ptr + b * sns).to(tl.int32)
    return tl.maximum((2 * S + T_b) // (2 * T_b), 1)


@triton.jit
def _store_flash_partial(work_ptr, bh, t, T_all, m_t, l_t, sum_v, s_tile, GP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile t's partial ``(m_t, ℓ_t, ℓ_t · mean of its S_tile samples)`` into the work buffer's three planes."""
    n_tp = tl.num_programs(1).to(tl.int64) * T_all * GP
    _store_partial(work_ptr, work_ptr + n_tp, work_ptr + 2 * n_tp, bh.to(tl.int64) * T_all + t, m_t, l_t,
                   sum_v * (l_t / s_tile.to(tl.float32))[:, None], GP, BLOCK_D)


@triton.jit
def _flash_tile(s, kmask, key, b, kvh, t, bh, G, Hq, D, T_all, Tk_pad, v_ptr, u_ptr, ns_ptr, work_ptr,
                counts_ptr, T_b, tile, svb, svh, svn, svd, sub, suh, sut, sns, GP: tl.constexpr,
                BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WRITE_COUNTS: tl.constexpr, MAXS: tl.constexpr):
    """Tile t's partial ``(m_t, ℓ_t, ℓ_t·μ̂_t)`` from its scores s [GP, BN] (``-inf`` off the tile)."""
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
    if MAXS > 0:  # sampled rows only, MAXS samples per head per step (no V tile staging)
        o = _gather_samples(c_hi, budget, v_base, t * tile, D, svn, svd, BLOCK_D, MAXS)
    else:  # counts @ V over the row-masked V tile (base-256 digits)
        o = _gather_values(counts, v_base, key, kmask, D, svn, svd, BLOCK_D, IEEE)
    _store_flash_partial(work_ptr, bh, t, T_all, m_t, l_t, o, s_tile, GP, BLOCK_D)
    if WRITE_COUNTS:
        row = (b * Hq + kvh * G + g).to(tl.int64)
        tl.store(counts_ptr + row[:, None] * Tk_pad + key[None, :], counts, mask=gmask[:, None] & kmask[None, :])


@triton.jit
def _flash_merge(b, kvh, t, bh, G, D, T_all, T_b, n_groups, work_ptr, cnt_ptr, out_ptr, sob, soh, sod,
                 GP: tl.constexpr, BLOCK_D: tl.constexpr, TPG: tl.constexpr, CH: tl.constexpr):
    """Log-sum-exp merge: the last tile of each group of TPG tiles merges the group, the last group the row.

    work buffer: tile partials (m, L [BH·T_all·GP], A [BH·T_all·GP·BLOCK_D]), then group partials.
    """
    n_bh = tl.num_programs(1)
    n_tp = n_bh.to(tl.int64) * T_all * GP
    n_gp = n_bh.to(tl.int64) * n_groups * GP
    ta_ptr = work_ptr + 2 * n_tp
    gm_ptr = ta_ptr + n_tp * BLOCK_D
    gl_ptr = gm_ptr + n_gp
    ga_ptr = gm_ptr + 2 * n_gp
    grp = t // TPG
    g_lo = grp * TPG
    in_group = tl.minimum(T_all - g_lo, TPG)
    done = tl.atomic_add(cnt_ptr + bh * n_groups + grp, 1)
    if done == in_group - 1:  # last tile of its group: merge the group's tiles
        d = tl.arange(0, BLOCK_D)
        m_g, l_g, a_g = _merge_partials(work_ptr, work_ptr + n_tp, ta_ptr, bh.to(tl.int64) * T_all, g_lo,
                                        tl.minimum(g_lo + TPG, T_b), d, GP, BLOCK_D, CH)
        _store_partial(gm_ptr, gl_ptr, ga_ptr, bh.to(tl.int64) * n_groups + grp, m_g, l_g, a_g, GP, BLOCK_D)
        tl.atomic_xchg(cnt_ptr + bh * n_groups + grp, 0)
        tl.debug_barrier()
        done_groups = tl.atomic_add(cnt_ptr + n_bh * n_groups + bh, 1)
        if done_groups == n_groups - 1:  # last group of this (b, kv head): the output
            _, l_o, a_o = _merge_partials(gm_ptr, gl_ptr, ga_ptr, bh.to(tl.int64) * n_groups, 0, n_groups, d,
                                          GP, BLOCK_D, CH)
            res = a_o / tl.where(l_o > 0, l_o, 1.0)[:, None]
            _store_rows(out_ptr, b, kvh, G, D, sob, soh, sod, res, GP, BLOCK_D)
            tl.atomic_xchg(cnt_ptr + n_bh * n_groups + bh, 0)
