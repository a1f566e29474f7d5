"""SampleAttention's two-stage mask selection in plain PyTorch: the definition of correct.

Paper: Zhu et al., arXiv:2406.15486, §4.2, Algorithm 1; decisions: docs/methods.md, SampleAttention. Shapes:
``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]`` with ``Hq % Hkv == 0`` (GQA: query head ``h`` reads KV head
``h // (Hq / Hkv)``). Queries are the last ``Sq`` positions of the ``Sk`` keys (prefill: ``Sq == Sk``), so
query row ``i`` sits at absolute position ``p = Sk - Sq + i`` and sees keys ``0..p``.

Stage 1 (query-guided chunked sampling, :func:`stage1_reductions`): the exact causal softmax of the rows
:func:`sampled_query_rows` picks, summed per key block ``j = k // blk`` (columns) and per slash band
``d = (p - k) // blk`` (``d = 0``: the ``blk`` keys ending at the query itself; ``d < NK``), each divided by
the sampled mass (the number of sampled rows) so that it sums to 1 per (batch, head).

Stage 2 (score-based filtering, :func:`stage2_select`), per (batch, head): the fewest key blocks whose sorted
cumulative mass is ``>= alpha_c``; the diagonal band always, then the fewest further bands, largest first,
until the kept mass (band 0 included) is ``>= alpha_s``; ``alpha_c >= 1`` or ``alpha_s >= 1`` gives the
dense causal mask. The block mask keeps every element of every kept band and column (:func:`slash_block_table`).

CRA (cumulative residual attention, §4.2.2): for a mask, the minimum over query rows of the exact softmax
mass it keeps (:func:`cumulative_residual_attention`, on all rows or on given ones, e.g. the sampled ones).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from runtime_kernels.blocksparse.mask import BlockMask

# Probabilities materialized at once (B * heads * rows * Sk); bounds memory on long prompts.
_MAX_PROB_ELEMENTS = 1 << 26


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (tests); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, T, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of KV heads {k.shape[1]}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"seq_q={q.shape[2]} > seq_k={k.shape[2]}: queries must be the last seq_q of the keys")


def _check_alpha(name: str, alpha: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"{name}={alpha} is outside (0, 1]; use a CRA threshold such as 0.95 (1.0 = dense)")


def sampled_query_rows(seq_q: int, chunk_n: int, blk: int = 64, device: torch.device | str | None = None) -> torch.Tensor:
    """Query rows Stage 1 samples: ``[R]`` int64, ascending, unique.

    Slice ``i = 1..chunk_n`` is rows ``[max(0, e_i - blk), e_i)`` with ``e_i = (i * seq_q) // chunk_n``
    (``itv = seq_q / chunk_n``); overlapping slices are merged.
    """
    if chunk_n < 1 or blk < 1 or seq_q < 1:
        raise ValueError(f"need chunk_n >= 1, blk >= 1 and seq_q >= 1; got {chunk_n}, {blk}, {seq_q}")
    ends = [(i * seq_q) // chunk_n for i in range(1, chunk_n + 1)]
    rows = torch.cat([torch.arange(max(0, e - blk), e, device=device) for e in ends])
    return torch.unique(rows)  # sorted


def _row_probabilities(
    q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float
) -> Iterator[tuple[slice, slice, torch.Tensor, torch.Tensor]]:
    """Exact causal softmax of query ``rows`` against all keys, in memory-bounded pieces.

    Yields ``(heads, row_slice, positions, probs)``: ``heads`` a slice of query heads (one KV group),
    ``row_slice`` a slice into ``rows``, ``positions: [r]`` absolute positions, ``probs: [B, g, r, Sk]``.
    """
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    cdt = _compute_dtype(q.dtype)
    rows = rows.to(q.device)
    step = max(1, _MAX_PROB_ELEMENTS // max(1, b * group * sk))
    kpos = torch.arange(sk, device=q.device)
    for g in range(hkv):
        heads = slice(g * group, (g + 1) * group)
        kg = k[:, g : g + 1].to(cdt)  # [B, 1, Sk, D]
        for start in range(0, rows.numel(), step):
            rs = slice(start, min(start + step, rows.numel()))
            pos = rows[rs] + (sk - sq)  # [r] absolute positions
            qr = q[:, heads, rows[rs]].to(cdt)  # [B, g, r, D]
            s = torch.matmul(qr, kg.transpose(-1, -2)) * scale  # [B, g, r, Sk]
            s = s.masked_fill(kpos[None, :] > pos[:, None], float("-inf"))
            yield heads, rs, pos, torch.softmax(s, dim=-1)


def sample_scores(
    q: torch.Tensor, k: torch.Tensor, *, chunk_n: int, blk: int = 64, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 scores: ``(rows [R], probs [B, Hq, R, Sk])``, exact causal softmax of the sampled rows.

    Materializes all sampled probabilities; for long prompts use :func:`stage1_reductions`.
    """
    _check_qk(q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    rows = sampled_query_rows(q.shape[2], chunk_n, blk, q.device)
    out = torch.empty(q.shape[0], q.shape[1], rows.numel(), k.shape[2], dtype=_compute_dtype(q.dtype), device=q.device)
    for heads, rs, _, probs in _row_probabilities(q, k, rows, scale):
        out[:, heads, rs] = probs
    return rows, out


def stage1_reductions(
    q: torch.Tensor, k: torch.Tensor, *, chunk_n: int, blk: int = 64, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: pooled block reductions of the sampled rows' exact causal attention.

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Sk, D]``; chunk_n: number of query slices; blk: slice
        length, key-block size and slash-band width; scale: default ``1 / sqrt(D)``.

    Returns:
        ``column_mass: [B, Hq, NK]`` (mass per key block ``k // blk``) and ``slash_mass: [B, Hq, NK]``
        (mass per band ``(p - k) // blk``), ``NK = ceil(Sk / blk)``, each normalized to sum 1 per
        (batch, head) (divided by the total sampled mass). Float32 (float64 for float64 inputs).
    """
    column, slash, _ = stage1_row_reductions(q, k, chunk_n=chunk_n, blk=blk, scale=scale)
    return column, slash


def stage1_row_reductions(
    q: torch.Tensor, k: torch.Tensor, *, chunk_n: int, blk: int = 64, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`stage1_reductions` plus each sampled row's mass per key block, ``row_mass: [B, Hq, R, NK]``
    (rows of :func:`sampled_query_rows`, unnormalized: each row sums to 1), from which
    :func:`sampled_cra` gives the CRA of any block mask on those rows without recomputing the softmax."""
    _check_qk(q, k)
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    nk = _ceil_div(sk, blk)
    cdt = _compute_dtype(q.dtype)
    slash = torch.zeros(b, hq, nk, dtype=cdt, device=q.device)
    kpos = torch.arange(sk, device=q.device)
    rows = sampled_query_rows(sq, chunk_n, blk, q.device)
    row_mass = torch.zeros(b, hq, rows.numel(), nk, dtype=cdt, device=q.device)
    for heads, rs, pos, probs in _row_probabilities(q, k, rows, scale):
        padded = torch.nn.functional.pad(probs, (0, nk * blk - sk))  # [B, g, r, NK*blk]
        row_mass[:, heads, rs] = padded.view(*probs.shape[:3], nk, blk).sum(-1)
        band = ((pos[:, None] - kpos[None, :]).clamp(min=0) // blk).expand_as(probs)  # [B, g, r, Sk]
        per_row = torch.zeros(*probs.shape[:3], nk, dtype=cdt, device=q.device)  # [B, g, r, NK]
        slash[:, heads] += per_row.scatter_add_(-1, band, probs).sum(2)
    column = row_mass.sum(2)
    column = column / column.sum(-1, keepdim=True)
    slash = slash / slash.sum(-1, keepdim=True)
    return column, slash, row_mass


def sampled_cra(mask: BlockMask, rows: torch.Tensor, row_mass: torch.Tensor) -> torch.Tensor:
    """CRA of ``mask`` on the sampled ``rows: [R]`` from their per-key-block masses ``row_mass: [B, Hq, R, NK]``
    (:func:`stage1_row_reductions`; key blocks of ``mask.block_k``): min over rows of the kept mass, ``[B, Hq]``.
    Equal to :func:`cumulative_residual_attention` on those rows (the masses above the diagonal are 0)."""
    keep = mask.to(row_mass.device).to_dense()[:, :, rows.to(row_mass.device) // mask.block_q]  # [B, Hq, R, NK]
    return (row_mass * keep).sum(-1).amin(-1)


def select_columns(column_mass: torch.Tensor, alpha_c: float) -> torch.Tensor:
    """Fewest column blocks, largest first, whose mass is ``>= alpha_c`` of the total: ``[..., NK]`` bool."""
    _check_alpha("alpha_c", alpha_c)
    mass = column_mass.double()
    need = alpha_c * mass.sum(-1, keepdim=True)  # [..., 1]
    sorted_mass, order = mass.sort(dim=-1, descending=True, stable=True)
    count = (sorted_mass.cumsum(-1) < need).sum(-1, keepdim=True) + 1  # [..., 1]
    rank = torch.arange(mass.shape[-1], device=mass.device)
    return torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, order, rank < count)


def select_slashes(slash_mass: torch.Tensor, alpha_s: float) -> torch.Tensor:
    """Band 0 plus the fewest further bands, largest first, until the kept mass is ``>= alpha_s`` of
    the total: ``[..., NK]`` bool (index = band ``d``)."""
    _check_alpha("alpha_s", alpha_s)
    mass = slash_mass.double()
    need = alpha_s * mass.sum(-1, keepdim=True)  # [..., 1]
    diag, others = mass[..., :1], mass[..., 1:]
    sorted_mass, order = others.sort(dim=-1, descending=True, stable=True)
    short = diag + sorted_mass.cumsum(-1) < need  # [..., NK-1]
    count = torch.where(diag >= need, 0, short.sum(-1, keepdim=True) + 1)
    rank = torch.arange(others.shape[-1], device=mass.device)
    kept_others = torch.zeros_like(others, dtype=torch.bool).scatter_(-1, order, rank < count)
    return torch.cat([torch.ones_like(diag, dtype=torch.bool), kept_others], -1)


def slash_block_table(kept_bands: torch.Tensor, seq_q: int, seq_k: int, blk: int) -> torch.Tensor:
    """``[B, H, NQ, NK]`` bool: block ``(qb, j)`` holds a causal element of a kept band.

    ``kept_bands: [B, H, NK]`` bool. Query block ``qb`` spans absolute positions ``[P0, P1]``, key block
    ``j`` spans ``[K0, K1]``; their causal differences ``q - k`` cover ``[max(P0 - K1, 0), P1 - K0]``
    (contiguous), i.e. bands ``max(P0 - K1, 0) // blk .. (P1 - K0) // blk``; the block is kept iff one
    of those bands is kept (prefix sums over bands).

    With ``block_q = block_k = blk`` and aligned prefill blocks a band ``d`` touches exactly key blocks
    ``qb - d`` and ``qb - d - 1`` (``q mod blk >= k mod blk`` lands in ``qb - d``, otherwise in
    ``qb - d - 1``), so on each sampled row the mask keeps at least the element mass the selection counted.
    Blocks above the causal diagonal are dropped.
    """
    nq, nk = _ceil_div(seq_q, blk), _ceil_div(seq_k, blk)
    dev = kept_bands.device
    p0 = (seq_k - seq_q) + torch.arange(nq, device=dev) * blk  # [NQ]
    p1 = (seq_k - seq_q) + torch.clamp(torch.arange(1, nq + 1, device=dev) * blk, max=seq_q) - 1
    k0 = torch.arange(nk, device=dev) * blk  # [NK]
    k1 = torch.clamp(torch.arange(1, nk + 1, device=dev) * blk, max=seq_k) - 1
    causal = p1[:, None] >= k0[None, :]  # [NQ, NK]
    d_lo = (p0[:, None] - k1[None, :]).clamp(min=0) // blk
    d_hi = ((p1[:, None] - k0[None, :]).clamp(min=0) // blk).clamp(max=nk - 1)
    prefix = torch.nn.functional.pad(kept_bands.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))  # [B, H, NK+1]
    hits = prefix[..., (d_hi + 1).flatten()] - prefix[..., d_lo.flatten()]  # [B, H, NQ*NK]
    return (hits > 0).view(*kept_bands.shape[:2], nq, nk) & causal


def stage2_select(
    column_mass: torch.Tensor,
    slash_mass: torch.Tensor,
    alpha_c: float,
    alpha_s: float,
    seq_len: int,
    blk: int = 64,
    *,
    seq_q: int | None = None,
) -> BlockMask:
    """Stage 2: merge the selected columns and slash bands into one causal block mask.

    Args:
        column_mass, slash_mass: ``[B, H, NK]`` from :func:`stage1_reductions` (need not be normalized).
        alpha_c, alpha_s: CRA thresholds in ``(0, 1]``; either ``>= 1`` gives the dense causal mask.
        seq_len: number of keys ``Sk``; ``NK == ceil(seq_len / blk)``.
        seq_q: number of queries (the last ``seq_q`` positions); default ``seq_len`` (prefill).

    Returns:
        :class:`BlockMask` with ``block_q = block_k = blk`` over ``[B, H]``.
    """
    _check_alpha("alpha_c", alpha_c)
    _check_alpha("alpha_s", alpha_s)
    seq_q = seq_len if seq_q is None else seq_q
    nq, nk = _ceil_div(seq_q, blk), _ceil_div(seq_len, blk)
    if column_mass.shape != slash_mass.shape or column_mass.dim() != 3 or column_mass.shape[-1] != nk:
        raise ValueError(f"masses {tuple(column_mass.shape)}, {tuple(slash_mass.shape)} must both be "
                         f"[B, H, {nk}] for seq_len={seq_len}, blk={blk}")
    b, h, _ = column_mass.shape
    if alpha_c >= 1.0 or alpha_s >= 1.0:
        keep = torch.ones(b, h, nq, nk, dtype=torch.bool, device=column_mass.device)
    else:
        keep = select_columns(column_mass, alpha_c)[:, :, None, :].expand(b, h, nq, nk)  # [B, H, NQ, NK]
        keep = keep | slash_block_table(select_slashes(slash_mass, alpha_s), seq_q, seq_len, blk)
    return BlockMask.from_dense(keep, seq_q, seq_len, blk, blk)


def sampleattention_select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    alpha_c: float,
    alpha_s: float,
    chunk_n: int,
    blk: int = 64,
    scale: float | None = None,
) -> BlockMask:
    """Both stages: ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]`` -> per-head :class:`BlockMask` ``[B, Hq]``."""
    _check_alpha("alpha_c", alpha_c)
    _check_alpha("alpha_s", alpha_s)
    _check_qk(q, k)
    if alpha_c >= 1.0 or alpha_s >= 1.0:  # dense: skip the sampling entirely
        b, hq, sq = q.shape[:3]
        nq, nk = _ceil_div(sq, blk), _ceil_div(k.shape[2], blk)
        keep = torch.ones(b, hq, nq, nk, dtype=torch.bool, device=q.device)
        return BlockMask.from_dense(keep, sq, k.shape[2], blk, blk)
    column, slash = stage1_reductions(q, k, chunk_n=chunk_n, blk=blk, scale=scale)
    return stage2_select(column, slash, alpha_c, alpha_s, k.shape[2], blk, seq_q=q.shape[2])


def cumulative_residual_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: BlockMask,
    rows: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """CRA: min over query rows of the exact causal softmax mass the mask keeps, ``[B, Hq]``.

    ``rows: [R]`` query-row indices in ``0..Sq-1`` (default all rows). Float32 (float64 for float64 q).
    """
    _check_qk(q, k)
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    if (mask.batch, mask.heads, mask.seq_q, mask.seq_k) != (b, hq, sq, sk):
        raise ValueError(f"mask is for (B, H, Sq, Sk)={(mask.batch, mask.heads, mask.seq_q, mask.seq_k)}, "
                         f"inputs are {(b, hq, sq, sk)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    rows = torch.arange(sq, device=q.device) if rows is None else rows.to(q.device).long()
    keep = mask.to(q.device).to_dense()  # [B, Hq, NQ, NK]
    key_block = torch.arange(sk, device=q.device) // mask.block_k  # [Sk]
    cra = torch.full((b, hq), float("inf"), dtype=_compute_dtype(q.dtype), device=q.device)
    for heads, rs, _, probs in _row_probabilities(q, k, rows, scale):
        kept = keep[:, heads][:, :, rows[rs] // mask.block_q][..., key_block]  # [B, g, r, Sk]
        mass = (probs * kept).sum(-1)  # [B, g, r]; causal: probs are 0 above the diagonal
        cra[:, heads] = torch.minimum(cra[:, heads], mass.amin(-1))
    return cra


@dataclass(frozen=True)
class Selection:
    """A selection with what it keeps: ``mask`` and its CRA on the sampled rows (``[B, Hq]``)."""

    mask: BlockMask
    sampled_rows: torch.Tensor  # [R] int64
    column_mass: torch.Tensor  # [B, Hq, NK]
    slash_mass: torch.Tensor  # [B, Hq, NK]
    sampled_cra: torch.Tensor  # [B, Hq]


def select_and_report(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    alpha_c: float,
    alpha_s: float,
    chunk_n: int,
    blk: int = 64,
    scale: float | None = None,
) -> Selection:
    """:func:`sampleattention_select` plus the exact CRA the mask keeps on the sampled rows (calibration)."""
    _check_alpha("alpha_c", alpha_c)
    _check_alpha("alpha_s", alpha_s)
    column, slash = stage1_reductions(q, k, chunk_n=chunk_n, blk=blk, scale=scale)
    mask = stage2_select(column, slash, alpha_c, alpha_s, k.shape[2], blk, seq_q=q.shape[2])
    rows = sampled_query_rows(q.shape[2], chunk_n, blk, q.device)
    cra = cumulative_residual_attention(q, k, mask, rows, scale=scale)
    return Selection(mask, rows, column, slash, cra)
