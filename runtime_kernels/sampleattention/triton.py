"""SampleAttention's Stage 1 and Stage 2 on the GPU (Zhu et al., arXiv:2406.15486, §4.2).

Same public functions and results as :mod:`runtime_kernels.sampleattention.reference` (the definition of
correct) up to float rounding, with no host synchronization:

* **Stage 1** (:func:`stage1_reductions`): two small Triton kernels, one program per (key split, slice tile,
  batch x ``HPP`` query heads of one KV group), each K tile loaded once for the heads of its group.
  ``_sa_stats_kernel`` computes every sampled row's softmax max and normalizer over its causal keys in the
  split (combined across splits with torch); ``_sa_reduce_kernel`` recomputes the scores, turns them into
  exact probabilities and reduces each (tile, key block) to its column mass and to the mass of the (at most
  three) slash bands it touches. Nothing of size ``[rows, Sk]`` reaches memory.
* **Stage 2**: the reference's own column / slash selection (torch ops on ``[B, H, NK]``), then
  ``_sa_mask_kernel`` builds the merged causal CSR mask directly (:func:`merged_block_mask`).

Design notes (performance model): docs/notes/kernels.md
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels._triton_support import patch_interpreter, scaled_scores
from runtime_kernels.blocksparse.mask import BlockMask, causal_block_count
from runtime_kernels.sampleattention import reference
from runtime_kernels.sampleattention.reference import _check_alpha, _check_qk, select_columns, select_slashes

patch_interpreter()
POISON = False  # tests: fill kernel-written buffers with NaN / -1 before the launch (every entry must be written)



def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tile_setup(s, pid2, Hq, Sq, Sk, chunk_n, G: tl.constexpr, HPP: tl.constexpr, BLK: tl.constexpr):
    """Rows of slice tile ``s`` for the program's heads: (b, h0, hk, rm, head, row_ok, pos, r0, kmax)."""
    chunks = Hq // HPP
    b = (pid2 // chunks).to(tl.int64)
    h0 = (pid2 % chunks) * HPP
    e = ((s + 1) * Sq) // chunk_n
    r0 = tl.maximum(tl.maximum((s * Sq) // chunk_n, e - BLK), 0)
    rm = tl.arange(0, HPP * BLK)
    head = h0 + rm // BLK
    rr = r0 + rm % BLK
    row_ok = rr < e
    pos = Sk - Sq + rr
    return b, h0, h0 // G, rm, head, rr, row_ok, pos, r0, Sk - Sq + e


@triton.jit
def _sa_stats_kernel(q_ptr, k_ptr, m_ptr, l_ptr, sqb, sqh, sqt, skb, skh, skt,
                     Hq, Sq, Sk, chunk_n, n_splits, split_len, sm_scale,
                     G: tl.constexpr, HPP: tl.constexpr, BLK: tl.constexpr, D: tl.constexpr,
                     UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Per sampled row and key split: softmax max and normalizer -> m, l: [B, Hq, chunk_n, n_splits, BLK]."""
    sp = tl.program_id(0)
    s = tl.program_id(1)
    b, h0, hk, rm, head, rr, row_ok, pos, r0, kmax = _tile_setup(s, tl.program_id(2), Hq, Sq, Sk, chunk_n,
                                                                  G, HPP, BLK)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + rr[:, None] * sqt + rd[None, :], mask=row_ok[:, None],
                other=0.0)
    k_base = k_ptr + b * skb + hk * skh
    m_i = tl.full([HPP * BLK], float("-inf"), tl.float32)
    l_i = tl.zeros([HPP * BLK], tl.float32)
    k_lo = sp * split_len
    for k0 in range(k_lo, tl.minimum(k_lo + split_len, kmax), BLK):
        kt = k0 + tl.arange(0, BLK)
        kk = tl.load(k_base + kt[:, None] * skt + rd[None, :], mask=(kt < Sk)[:, None], other=0.0)
        sc = scaled_scores(q, kk, sm_scale, UPCAST, IEEE)
        sc = tl.where((kt[None, :] <= pos[:, None]) & row_ok[:, None], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(sc - m_safe[:, None]), axis=1)
        m_i = m_new
    out = (((b * Hq + head) * chunk_n + s) * n_splits + sp) * BLK + rm % BLK
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


@triton.jit
def _sa_reduce_kernel(q_ptr, k_ptr, m_ptr, l_ptr, col_ptr, sl_ptr, sqb, sqh, sqt, skb, skh, skt,
                      Hq, Sq, Sk, NK, chunk_n, split_len, sm_scale,
                      G: tl.constexpr, HPP: tl.constexpr, BLK: tl.constexpr, D: tl.constexpr,
                      UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Exact probabilities of the tile's rows, reduced per key block j: col[b, h, s, j] (column mass) and
    sl[b, h, s, j, t] = mass of band ``(p0 + 1) // BLK - 1 - j + t`` (p0 = the tile's first position)."""
    sp = tl.program_id(0)
    s = tl.program_id(1)
    b, h0, hk, rm, head, rr, row_ok, pos, r0, kmax = _tile_setup(s, tl.program_id(2), Hq, Sq, Sk, chunk_n,
                                                                  G, HPP, BLK)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + rr[:, None] * sqt + rd[None, :], mask=row_ok[:, None],
                other=0.0)
    stat = ((b * Hq + head) * chunk_n + s) * BLK + rm % BLK
    m_i = tl.load(m_ptr + stat)
    l_i = tl.load(l_ptr + stat)
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    hp = tl.arange(0, HPP)
    out_row = (b * Hq + h0 + hp) * chunk_n + s  # [HPP]
    p0 = Sk - Sq + r0
    band0 = (p0 + 1) // BLK - 1  # band of (tile row 0 - 63, key block 0)
    r_loc = tl.arange(0, BLK)
    k_base = k_ptr + b * skb + hk * skh
    k_lo = sp * split_len
    for k0 in range(k_lo, tl.minimum(k_lo + split_len, kmax), BLK):
        j = k0 // BLK
        kt = k0 + tl.arange(0, BLK)
        kk = tl.load(k_base + kt[:, None] * skt + rd[None, :], mask=(kt < Sk)[:, None], other=0.0)
        sc = scaled_scores(q, kk, sm_scale, UPCAST, IEEE)
        ok = (kt[None, :] <= pos[:, None]) & row_ok[:, None]
        p = tl.where(ok, tl.exp(sc - m_i[:, None]) * inv_l[:, None], 0.0)  # [HPP*BLK, BLK]
        p3 = tl.reshape(p, [HPP, BLK, BLK])
        tl.store(col_ptr + out_row * NK + j, tl.sum(tl.sum(p3, axis=2), axis=1))
        # band of element (r, c) relative to band0 - j: (p0 - k0 + r - c) // BLK - (band0 - j) in {0, 1, 2}
        rel = (p0 - k0 + r_loc[:, None] - tl.arange(0, BLK)[None, :] - (band0 - j) * BLK) // BLK  # [BLK, BLK]
        for t in tl.static_range(3):
            mass = tl.sum(tl.sum(tl.where((rel == t)[None, :, :], p3, 0.0), axis=2), axis=1)
            tl.store(sl_ptr + (out_row * NK + j) * 3 + t, mass)


@triton.jit
def _sa_mask_kernel(col_ptr, prefix_ptr, counts_ptr, offsets_ptr, indices_ptr, NQ, NK, Sq, Sk,
                    BLK: tl.constexpr, TILE: tl.constexpr, DENSE: tl.constexpr, WRITE: tl.constexpr):
    """Row r = (b*H + h)*NQ + qb of the merged mask: key block j (causal) kept iff column j is kept
    (col: [B*H, NK] int8) or one of the bands ``d_lo..d_hi`` the block touches is (prefix: [B*H, NK+1] int32
    cumsum of kept bands). Count pass (WRITE=False) -> counts[r]; write pass -> indices[offsets[r]:]."""
    r = tl.program_id(0).to(tl.int64)
    bh = r // NQ
    qb = r % NQ
    p0 = Sk - Sq + qb * BLK
    p1 = Sk - Sq + tl.minimum((qb + 1) * BLK, Sq) - 1
    n = p1 // BLK + 1
    if WRITE:
        run = tl.load(offsets_ptr + r)
    else:
        cnt = 0
    for j0 in range(0, n, TILE):
        j = j0 + tl.arange(0, TILE)
        inside = j < n
        if DENSE:
            keep = inside
        else:
            col = tl.load(col_ptr + bh * NK + j, mask=inside, other=0) != 0
            k0 = j * BLK
            k1 = tl.minimum((j + 1) * BLK, Sk) - 1
            d_lo = tl.maximum(p0 - k1, 0) // BLK
            d_hi = tl.minimum(tl.maximum(p1 - k0, 0) // BLK, NK - 1)
            hits = (tl.load(prefix_ptr + bh * (NK + 1) + d_hi + 1, mask=inside, other=0)
                    - tl.load(prefix_ptr + bh * (NK + 1) + d_lo, mask=inside, other=0))
            keep = inside & (col | (hits > 0))
        kp = keep.to(tl.int32)
        if WRITE:
            tl.store(indices_ptr + run + tl.cumsum(kp, axis=0) - 1, j.to(tl.int32), mask=keep)
            run += tl.sum(kp, axis=0)
        else:
            cnt += tl.sum(kp, axis=0)
    if not WRITE:
        tl.store(counts_ptr + r, cnt)


# ------------------------------------------------------------------------------------------ host side
def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, poison: float) -> torch.Tensor:
    return torch.full(shape, poison, dtype=dtype, device=device) if POISON else torch.empty(shape, dtype=dtype,
                                                                                           device=device)


def _supported(q: torch.Tensor, blk: int) -> bool:
    """Shapes and dtypes the kernels take; anything else (float64, odd blk) runs the reference."""
    d = q.shape[-1]
    return _pow2(blk) and blk >= 16 and _pow2(d) and d >= 16 and q.dtype in (torch.float16, torch.bfloat16,
                                                                            torch.float32)


def _heads_per_program(group: int, blk: int) -> int:
    hpp = max(1, min(group, 128 // blk))
    while group % hpp:
        hpp -= 1
    return hpp


def _launch_geometry(b: int, hq: int, hpp: int, chunk_n: int, sk: int, blk: int) -> tuple[int, int]:
    """(n_splits, split_len): enough programs (~4 waves of 132 SMs) even for chunk_n = 1 (a few under the
    interpreter, where every program costs milliseconds)."""
    nk = _ceil_div(sk, blk)
    base = chunk_n * b * (hq // hpp)
    n_splits = max(1, min(nk, _ceil_div(8 if _interpreting() else 528, base)))
    per = _ceil_div(nk, n_splits)
    return _ceil_div(nk, per), per * blk


def _slash_pool(sl: torch.Tensor, sq: int, sk: int, chunk_n: int, blk: int) -> torch.Tensor:
    """``sl: [B, H, S, NK, 3]`` per (tile, key block, relative band) -> ``[B, H, NK]`` mass per band ``d``:
    tile s, key block j, slot t holds band ``c_s - j + t`` with ``c_s = (p0_s + 1) // blk - 1``."""
    b, h, s_n, nk, _ = sl.shape
    dev = sl.device
    s = torch.arange(s_n, device=dev)
    e = ((s + 1) * sq) // chunk_n
    r0 = torch.maximum(torch.maximum((s * sq) // chunk_n, e - blk), torch.zeros_like(e))
    c = (sk - sq + r0 + 1) // blk - 1  # [S]
    t = torch.arange(3, device=dev)
    d = torch.arange(nk, device=dev)
    j = c[:, None, None] + t[None, :, None] - d[None, None, :]  # [S, 3, NK]
    valid = (j >= 0) & (j < nk)
    flat = (s[:, None, None] * nk + j.clamp(0, nk - 1)) * 3 + t[None, :, None]
    g = sl.reshape(b, h, -1).gather(-1, flat.reshape(1, 1, -1).expand(b, h, -1)).view(b, h, s_n, 3, nk)
    return (g * valid).sum((2, 3))


# ----------------------------------------------------------------------------------------- public API
def stage1_reductions(q: torch.Tensor, k: torch.Tensor, *, chunk_n: int, blk: int = 64,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 on the GPU: ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]`` -> ``column_mass, slash_mass:
    [B, Hq, NK]`` float32, each normalized to sum 1 per (batch, head) — as the reference.

    The sampled rows are the disjoint contiguous tiles ``[max(e_{s-1}, e_s - blk, 0), e_s)``,
    ``e_s = ((s + 1) * Sq) // chunk_n`` (``s = 0..chunk_n-1``, ``e_{-1} = 0``): exactly the reference's merged
    slices. The kernels write ``[B, Hq, chunk_n, NK]`` column and ``[B, Hq, chunk_n, NK, 3]`` band masses,
    pooled over tiles here with a gather."""
    _check_qk(q, k)
    if chunk_n < 1 or blk < 1:
        raise ValueError(f"need chunk_n >= 1 and blk >= 1; got {chunk_n}, {blk}")
    if not _supported(q, blk):
        col, sl = reference.stage1_reductions(q, k, chunk_n=chunk_n, blk=blk, scale=scale)
        return col.float(), sl.float()
    k = k.to(q.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    nk, group = _ceil_div(sk, blk), hq // hkv
    hpp = _heads_per_program(group, blk)
    n_splits, split_len = _launch_geometry(b, hq, hpp, chunk_n, sk, blk)
    grid = (n_splits, chunk_n, b * (hq // hpp))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    flags = dict(G=group, HPP=hpp, BLK=blk, D=d, UPCAST=_interpreting() and q.dtype == torch.bfloat16,
                 IEEE=q.dtype == torch.float32, num_warps=4 if hpp * blk <= 64 else 8)
    m_part = _alloc((b, hq, chunk_n, n_splits, blk), torch.float32, q.device, math.nan)
    l_part = _alloc((b, hq, chunk_n, n_splits, blk), torch.float32, q.device, math.nan)
    _sa_stats_kernel[grid](q, k, m_part, l_part, *strides, hq, sq, sk, chunk_n, n_splits, split_len, scale,
                           **flags)
    m = m_part.amax(3)  # [B, Hq, S, BLK]; -inf for rows outside the tile
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l_row = (l_part * torch.exp(m_part - m_safe[:, :, :, None])).sum(3)
    col = torch.zeros(b, hq, chunk_n, nk, dtype=torch.float32, device=q.device)
    sl = torch.zeros(b, hq, chunk_n, nk, 3, dtype=torch.float32, device=q.device)
    _sa_reduce_kernel[grid](q, k, m_safe.contiguous(), l_row.contiguous(), col, sl, *strides, hq, sq, sk, nk,
                            chunk_n, split_len, scale, **flags)
    column = col.sum(2)
    slash = _slash_pool(sl, sq, sk, chunk_n, blk)
    return column / column.sum(-1, keepdim=True), slash / slash.sum(-1, keepdim=True)


def merged_block_mask(kept_columns: torch.Tensor | None, kept_bands: torch.Tensor | None, batch: int,
                      heads: int, seq_q: int, seq_k: int, blk: int, device: torch.device) -> BlockMask:
    """CSR mask: kept columns ``[B, H, NK]`` bool OR kept slash bands ``[B, H, NK]`` bool (both None: every
    causal block), blocks ``blk x blk``, built on ``device`` without a host sync.

    From the kept columns and a prefix sum of the kept bands (count pass, ``cumsum`` -> offsets, write pass),
    never materializing the ``[NQ, NK]`` block table. ``indices`` is sized for every causal block (no sync
    to learn nnz): only ``indices[:offsets[-1]]`` is meaningful; ``offsets`` is exact."""
    nq, nk = _ceil_div(seq_q, blk), _ceil_div(seq_k, blk)
    dense = kept_columns is None or kept_bands is None
    if dense:
        col = prefix = torch.zeros(1, dtype=torch.int32, device=device)
    else:
        col = kept_columns.to(torch.int8).contiguous()
        prefix = torch.nn.functional.pad(kept_bands.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))
        prefix = prefix.contiguous()  # [B, H, NK + 1]
    rows = batch * heads * nq
    counts = _alloc((rows,), torch.int64, device, -1)
    offsets = torch.zeros(rows + 1, dtype=torch.int64, device=device)
    indices = _alloc((max(1, batch * heads * causal_block_count(seq_q, seq_k, blk, blk)),), torch.int32, device, -1)
    args = (col, prefix, counts, offsets, indices, nq, nk, seq_q, seq_k)
    _sa_mask_kernel[(rows,)](*args, BLK=blk, TILE=256, DENSE=dense, WRITE=False)
    torch.cumsum(counts, 0, out=offsets[1:])
    _sa_mask_kernel[(rows,)](*args, BLK=blk, TILE=256, DENSE=dense, WRITE=True)
    return BlockMask(offsets, indices, batch, heads, seq_q, seq_k, blk, blk)


def stage2_select(column_mass: torch.Tensor, slash_mass: torch.Tensor, alpha_c: float, alpha_s: float,
                  seq_len: int, blk: int = 64, *, seq_q: int | None = None) -> BlockMask:
    """Stage 2 as the reference (same selection ops), the merged mask built by ``_sa_mask_kernel``."""
    _check_alpha("alpha_c", alpha_c)
    _check_alpha("alpha_s", alpha_s)
    seq_q = seq_len if seq_q is None else seq_q
    nk = _ceil_div(seq_len, blk)
    if column_mass.shape != slash_mass.shape or column_mass.dim() != 3 or column_mass.shape[-1] != nk:
        raise ValueError(f"masses {tuple(column_mass.shape)}, {tuple(slash_mass.shape)} must both be "
                         f"[B, H, {nk}] for seq_len={seq_len}, blk={blk}")
    if not _pow2(blk) or blk < 16:
        return reference.stage2_select(column_mass, slash_mass, alpha_c, alpha_s, seq_len, blk, seq_q=seq_q)
    b, h, _ = column_mass.shape
    if alpha_c >= 1.0 or alpha_s >= 1.0:
        return merged_block_mask(None, None, b, h, seq_q, seq_len, blk, column_mass.device)
    return merged_block_mask(select_columns(column_mass, alpha_c), select_slashes(slash_mass, alpha_s), b, h,
                             seq_q, seq_len, blk, column_mass.device)


def sampleattention_select(q: torch.Tensor, k: torch.Tensor, *, alpha_c: float, alpha_s: float, chunk_n: int,
                           blk: int = 64, scale: float | None = None) -> BlockMask:
    """Both stages on the GPU: ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]`` -> :class:`BlockMask` ``[B, Hq]``
    (``indices`` sized for every causal block; ``offsets`` exact)."""
    _check_alpha("alpha_c", alpha_c)
    _check_alpha("alpha_s", alpha_s)
    _check_qk(q, k)
    if not _supported(q, blk):
        return reference.sampleattention_select(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n, blk=blk,
                                                scale=scale)
    if alpha_c >= 1.0 or alpha_s >= 1.0:  # dense: skip the sampling entirely
        return merged_block_mask(None, None, q.shape[0], q.shape[1], q.shape[2], k.shape[2], blk, q.device)
    column, slash = stage1_reductions(q, k, chunk_n=chunk_n, blk=blk, scale=scale)
    return stage2_select(column, slash, alpha_c, alpha_s, k.shape[2], blk, seq_q=q.shape[2])
