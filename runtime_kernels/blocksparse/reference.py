"""Block-sparse causal attention in plain PyTorch: the definition of correct.

Element ``(i, j)`` takes part in query ``i``'s softmax iff its block ``(i // block_q, j // block_k)`` is
listed in the :class:`~runtime_kernels.blocksparse.mask.BlockMask` AND ``j <= seq_k - seq_q + i`` (causal;
queries are the last ``seq_q`` positions). The softmax is exact over exactly those elements.

The computation walks groups of consecutive query blocks and, for all (batch, head) rows at once,
gathers only their kept key blocks (padded to the longest list in the group), so memory per step is
``O(B * H * group * kept * block_k * (D + Dv + block_q))``, bounded by ``chunk_elems`` (or one query
block), and the ``[seq_q, seq_k]`` score matrix is never materialized.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runtime_kernels.blocksparse.mask import BlockMask


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (tests); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, tq, d = q.shape
    bk_, hkv, tk, dk = k.shape
    if k.shape[:3] != v.shape[:3] or bk_ != b or dk != d:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if tq > tk:
        raise ValueError(f"seq_q={tq} > seq_k={tk}: queries must be the last seq_q of the keys")
    got = (mask.batch, mask.heads, mask.seq_q, mask.seq_k)
    if got != (b, hq, tq, tk):
        raise ValueError(f"mask is for (B, H, seq_q, seq_k)={got}, inputs are {(b, hq, tq, tk)}")


def _attend_query_blocks(
    q_blk: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, k_pos: torch.Tensor, allowed_blk: torch.Tensor,
    q_pos: torch.Tensor, seq_k: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax of ``C`` query blocks, each over its own gathered key blocks.

    ``q_blk: [B, H, C, bq, D]``, ``k_sel: [B, H, C, n, bk, D]``, ``v_sel: [B, H, C, n, bk, Dv]``,
    ``k_pos: [B, H, C, n, bk]`` absolute key positions, ``allowed_blk: [B, H, C, n]`` (False = padding slot),
    ``q_pos: [C, bq]`` absolute query positions -> ``(o: [B, H, C, bq, Dv], lse: [B, H, C, bq])``;
    rows with nothing allowed give 0 and -inf.
    """
    s = torch.einsum("bhcrd,bhcjkd->bhcrjk", q_blk, k_sel) * scale  # [B, H, C, bq, n, bk]
    allowed = (allowed_blk[..., None] & (k_pos < seq_k))[:, :, :, None] & (
        k_pos[:, :, :, None] <= q_pos[None, None, :, :, None, None]
    )  # [B, H, C, bq, n, bk]
    s = s.masked_fill(~allowed, -math.inf).flatten(-2)  # [B, H, C, bq, n*bk]
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty rows
    p = torch.exp(s - m)  # masked -> 0
    l = p.sum(-1, keepdim=True)  # [B, H, C, bq, 1]
    o = torch.einsum("bhcrn,bhcnd->bhcrd", p, v_sel.flatten(3, 4))  # [B, H, C, bq, Dv]
    o = torch.where(l > 0, o / l.clamp_min(torch.finfo(o.dtype).tiny), torch.zeros_like(o))
    return o, (m + torch.log(l)).squeeze(-1)  # log 0 = -inf for empty rows


def _group_query_blocks(kmax: list[int], per_slot: int, budget: int) -> list[tuple[int, int, int]]:
    """Consecutive query-block ranges ``(start, stop, n)`` whose padded gather (``count * n * per_slot``
    elements, ``n`` = the largest kept count in the range) stays within ``budget`` (at least one block)."""
    groups, start, n = [], 0, 0
    for qb, c in enumerate(kmax):
        if qb > start and (qb - start + 1) * max(n, c) * per_slot > budget:
            groups.append((start, qb, n))
            start, n = qb, 0
        n = max(n, c)
    groups.append((start, len(kmax), n))
    return groups


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    chunk_elems: int = 1 << 25,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention restricted to the kept blocks of ``mask``; exact softmax over what is kept.

    Args:
        q: ``[B, Hq, Tq, D]`` queries (the last ``Tq`` positions of the ``Tk`` keys).
        k: ``[B, Hkv, Tk, D]`` keys; ``Hq % Hkv == 0`` (GQA: query head ``h`` reads KV head ``h // (Hq/Hkv)``).
        v: ``[B, Hkv, Tk, Dv]`` values.
        mask: block mask with ``heads == Hq``, ``batch == B``, ``seq_q == Tq``, ``seq_k == Tk``.
        scale: score scale; default ``1 / sqrt(D)``.
        return_lse: also return the natural-log sum-exp of the kept scaled scores.
        chunk_elems: consecutive query blocks are processed together while their gathered keys, values
            and scores stay below about this many elements (one query block at least).

    Returns:
        ``out: [B, Hq, Tq, Dv]`` in ``q.dtype`` (computed in float32, float64 for float64 inputs), and
        with ``return_lse`` also ``lse: [B, Hq, Tq]`` in the compute dtype. A query row with no kept
        causal element gets ``out = 0`` and ``lse = -inf``.
    """
    _check_shapes(q, k, v, mask)
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    bq, bk, nq, nk = mask.block_q, mask.block_k, mask.num_q_blocks, mask.num_k_blocks
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cdt, dev = _compute_dtype(q.dtype), q.device
    mask = mask.to(dev)

    k_blocks = F.pad(k.to(cdt), (0, 0, 0, nk * bk - tk)).view(b, hkv, nk, bk, d)  # [B, Hkv, NK, bk, D]
    v_blocks = F.pad(v.to(cdt), (0, 0, 0, nk * bk - tk)).view(b, hkv, nk, bk, dv)  # [B, Hkv, NK, bk, Dv]
    q_blocks = F.pad(q.to(cdt), (0, 0, 0, nq * bq - tq)).view(b, hq, nq, bq, d)  # [B, Hq, NQ, bq, D]
    out = torch.empty(b, hq, nq * bq, dv, dtype=cdt, device=dev)
    lse = torch.empty(b, hq, nq * bq, dtype=cdt, device=dev)
    counts = mask.counts()  # [B, Hq, NQ]
    row_ids = (torch.arange(b, device=dev)[:, None] * hq + torch.arange(hq, device=dev)) * nq  # [B, Hq]
    b_idx = torch.arange(b, device=dev)[:, None, None, None]  # [B, 1, 1, 1]
    kv_idx = (torch.arange(hq, device=dev) // (hq // hkv))[None, :, None, None]  # [1, Hq, 1, 1]
    last_ptr = max(mask.indices.numel() - 1, 0)
    kmax = counts.amax(dim=(0, 1)).tolist()  # one host sync for all query blocks
    for q0, q1, n in _group_query_blocks(kmax, b * hq * bk * (d + dv + bq), chunk_elems):
        rows = slice(q0 * bq, q1 * bq)
        if n == 0:
            out[:, :, rows], lse[:, :, rows] = 0, -math.inf
            continue
        slot = torch.arange(n, device=dev)
        valid = slot < counts[:, :, q0:q1, None]  # [B, Hq, C, n]
        starts = mask.offsets[row_ids[..., None] + torch.arange(q0, q1, device=dev)]  # [B, Hq, C]
        ptr = (starts[..., None] + slot).clamp(max=last_ptr)  # [B, Hq, C, n]
        kb_idx = torch.where(valid, mask.indices[ptr].long(), torch.zeros_like(ptr))  # [B, Hq, C, n]
        o, l = _attend_query_blocks(
            q_blocks[:, :, q0:q1], k_blocks[b_idx, kv_idx, kb_idx], v_blocks[b_idx, kv_idx, kb_idx],
            kb_idx[..., None] * bk + torch.arange(bk, device=dev), valid,
            (tk - tq) + torch.arange(q0 * bq, q1 * bq, device=dev).view(q1 - q0, bq), tk, scale)
        out[:, :, rows], lse[:, :, rows] = o.flatten(2, 3), l.flatten(2, 3)
    out, lse = out[:, :, :tq].to(q.dtype), lse[:, :, :tq]
    return (out, lse) if return_lse else out


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Plain causal attention ``[B, Hq, Tq, Dv]`` (GQA; queries are the last ``Tq`` keys), materializing
    ``[Tq, Tk]``: only for short inputs and tests. Computed in the compute dtype, returned in ``q.dtype``."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cdt = _compute_dtype(q.dtype)
    kk = k.to(cdt).repeat_interleave(hq // hkv, dim=1)
    vv = v.to(cdt).repeat_interleave(hq // hkv, dim=1)
    s = q.to(cdt) @ kk.transpose(-1, -2) * scale  # [B, Hq, Tq, Tk]
    causal = torch.arange(tk, device=q.device)[None, :] <= (tk - tq + torch.arange(tq, device=q.device))[:, None]
    s = s.masked_fill(~causal, -math.inf)
    return (torch.softmax(s, dim=-1) @ vv).to(q.dtype)
