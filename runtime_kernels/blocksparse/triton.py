"""Block-sparse causal flash-attention forward in Triton, on the project's CSR :class:`BlockMask`.

Same arguments, same result as :func:`runtime_kernels.blocksparse.reference.block_sparse_attention`:
element ``(i, j)`` enters query ``i``'s softmax iff its block ``(i // block_q, j // block_k)`` is listed
in the mask AND ``j <= seq_k - seq_q + i`` (queries are the last ``seq_q`` keys); a row with nothing kept
gets ``out = 0`` and ``lse = -inf``. One kernel, :func:`_blocksparse_attn_fwd_kernel` (its docstring gives
the layout); launch parameters: :func:`default_config`, or autotuned with ``CALIB_BLOCKSPARSE_AUTOTUNE=1``.
The performance model: docs/notes/kernels.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.blocksparse.triton needs the 'triton' package",
                              name="triton") from exc

from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels.blocksparse import reference
from runtime_kernels.blocksparse.mask import BlockMask

LOG2E = 1.4426950408889634
_TUNE_ENV = "CALIB_BLOCKSPARSE_AUTOTUNE"  # "1": autotune over _tune_configs() on CUDA



patch_interpreter()

@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos, k_base, v_base, ind_row, u0, n_units, seq_k, stride_kt, stride_vt, qk_scale,
    offs_n, offs_d, offs_dv,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BK: tl.constexpr, UNIT: tl.constexpr, SLOTS: tl.constexpr, SUB: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr, BIG: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` score tile of units ``u0 .. u0 + SLOTS`` of the row's list.

    A *unit* is ``UNIT = min(block_k, BLOCK_N)`` consecutive keys: list entry ``e`` holds units
    ``e * SUB .. e * SUB + SUB - 1``. ``MASKED`` tiles check slot validity, causality and ``seq_k``;
    unmasked tiles are fully visible to every row of the program (no per-element mask).
    Returns the updated ``(acc [BLOCK_M, BLOCK_DV] fp32, m_i [BLOCK_M], l_i [BLOCK_M])``, ``m_i`` in log2 units.
    """
    if SLOTS == 1:  # one (sub-)block per tile: a scalar index read, contiguous key positions
        kb = tl.load(ind_row + u0 // SUB)
        kpos = kb * BK + (u0 % SUB) * UNIT + offs_n  # [BLOCK_N]
        col_ok = offs_n < UNIT  # all True; keeps the masked path uniform
    else:  # SLOTS list entries gathered into one tile (block_k < BLOCK_N, SUB == 1)
        unit = u0 + offs_n // UNIT  # [BLOCK_N] entry per column
        col_ok = unit < n_units
        kb = tl.load(ind_row + unit, mask=col_ok, other=0)
        kpos = kb * BK + offs_n % UNIT
        kpos = tl.max_contiguous(tl.multiple_of(kpos, UNIT), UNIT)
    dmask = offs_d[None, :] < D
    dvmask = offs_dv[None, :] < DV
    krow = kpos.to(tl.int64) if BIG else kpos  # BIG: row offsets past 2**31 elements
    if MASKED:
        col_ok = col_ok & (kpos < seq_k)
        k = tl.load(k_base + krow[:, None] * stride_kt + offs_d[None, :], mask=col_ok[:, None] & dmask, other=0.0)
    elif BLOCK_D == D:
        k = tl.load(k_base + krow[:, None] * stride_kt + offs_d[None, :])
    else:
        k = tl.load(k_base + krow[:, None] * stride_kt + offs_d[None, :], mask=dmask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N] fp32
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        ok = col_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing kept so far
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if MASKED:
        v = tl.load(v_base + krow[:, None] * stride_vt + offs_dv[None, :], mask=col_ok[:, None] & dvmask, other=0.0)
    elif BLOCK_DV == DV:
        v = tl.load(v_base + krow[:, None] * stride_vt + offs_dv[None, :])
    else:
        v = tl.load(v_base + krow[:, None] * stride_vt + offs_dv[None, :], mask=dvmask, other=0.0)
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _blocksparse_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, off_ptr, ind_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    qk_scale, seq_q, seq_k, HQ, GROUP, NQ,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    W_TAIL: tl.constexpr, IEEE: tl.constexpr, WRITE_LSE: tl.constexpr, BIG: tl.constexpr,
):
    """Grid ``(NQ * (BQ // BLOCK_M) * B * Hq,)``.

    * One program per (``BLOCK_M`` query rows, batch * query head); ``BLOCK_M = min(block_q, 128)``, so a
      program owns one query block (or a slice of a larger one) and walks that block's CSR list. Programs
      are numbered KV-head-major (as FlashAttention orders query blocks within a head): all programs in
      flight read one KV head's K/V, so a kept K/V tile is fetched from HBM about once per wave and then
      served from L2 to the other programs that keep it; within a KV head the query blocks nearest the end
      of the sequence (the longest causal rows) start first and the ``g`` query heads of a block run side
      by side.
    * Key tiles are ``BLOCK_N`` columns: with ``block_k < BLOCK_N`` a tile gathers ``BLOCK_N / block_k``
      consecutive list entries (e.g. two 32-key blocks of SALE per 64-column tile), with ``block_k >
      BLOCK_N`` a list entry is walked in ``block_k / BLOCK_N`` sub-tiles. Only listed K/V rows are loaded.
    * The list is sorted, so the blocks that straddle the causal diagonal (and the ragged last key block)
      form its tail: a short vector read of the last entries counts them, the leading full tiles run with
      no mask at all (no per-element compare), and only the remaining one to three tiles apply the slot /
      causal / sequence-length mask.
    * Online softmax in fp32 on ``exp2`` with ``scale * log2(e)`` folded into one FMA per score; ``tl.dot``
      with fp32 accumulation (bf16/fp16 operands; float32 inputs use IEEE fp32 dots; float64 inputs run
      the reference).
    """
    UNIT: tl.constexpr = BK if BK < BLOCK_N else BLOCK_N
    SLOTS: tl.constexpr = BLOCK_N // UNIT
    SUB: tl.constexpr = BK // UNIT
    MSUB: tl.constexpr = BQ // BLOCK_M
    # Program order: (batch, KV head) slowest, then query slices from the last (longest causal rows
    # first), then the GROUP query heads of the KV head: the programs in flight share one KV head's K/V.
    pid = tl.program_id(0)
    g = pid % GROUP
    rest = pid // GROUP
    n_slices = NQ * MSUB
    qm = n_slices - 1 - rest % n_slices
    bkv = rest // n_slices  # b * (HQ // GROUP) + hkv
    qb, msub = qm // MSUB, qm % MSUB
    bh = bkv * GROUP + g  # b * HQ + h
    b, h = bh // HQ, bh % HQ
    hkv = h // GROUP

    row0 = qb * BQ + msub * BLOCK_M  # first query row of this program
    offs_m = row0 + tl.arange(0, BLOCK_M)
    q_pos = (seq_k - seq_q) + offs_m  # absolute positions
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    start = tl.load(off_ptr + bh.to(tl.int64) * NQ + qb)
    end = tl.load(off_ptr + bh.to(tl.int64) * NQ + qb + 1)
    count = (end - start).to(tl.int32)
    count = tl.where(row0 < seq_q, count, 0)  # a slice past the last query row does nothing
    # The sorted list's tail holds every block a row of this program cannot see whole: key blocks
    # j >= kb_lim end after the first query (diagonal, ragged last block). At most BLOCK_M / BK + 1.
    kb_lim = ((seq_k - seq_q) + row0 + 1) // BK
    w = tl.arange(0, W_TAIL)
    tail = tl.load(ind_ptr + end - 1 - w, mask=w < count, other=-1)
    n_tail = tl.sum((tail >= kb_lim).to(tl.int32), 0)
    n_units = count * SUB
    n_full = ((count - n_tail) * SUB) // SLOTS  # tiles needing no mask
    n_tiles = (n_units + SLOTS - 1) // SLOTS

    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    q_mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < D)
    rows = offs_m.to(tl.int64) if BIG else offs_m
    q = tl.load(q_base + rows[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    ind_row = ind_ptr + start

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for t in range(0, n_full):  # the pipeline depth of this loop is the launch's num_stages
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_base, v_base, ind_row, t * SLOTS, n_units, seq_k, stride_kt, stride_vt,
            qk_scale, offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV, BK, UNIT, SLOTS, SUB, False, IEEE, BIG)
    for t in tl.range(n_full, n_tiles, num_stages=2):  # <= 3 tiles: a shallow pipeline, little smem
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_base, v_base, ind_row, t * SLOTS, n_units, seq_k, stride_kt, stride_vt,
            qk_scale, offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV, BK, UNIT, SLOTS, SUB, True, IEEE, BIG)

    kept = l_i > 0.0
    out = acc / tl.where(kept, l_i, 1.0)[:, None]  # empty rows: acc == 0 -> out 0
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    o_mask = (offs_m[:, None] < seq_q) & (offs_dv[None, :] < DV)
    tl.store(o_base + rows[:, None] * stride_ot + offs_dv[None, :], out.to(o_ptr.dtype.element_ty), mask=o_mask)
    if WRITE_LSE:
        lse = tl.where(kept, (m_i + tl.math.log2(tl.where(kept, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        tl.store(lse_ptr + bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of :func:`_blocksparse_attn_fwd_kernel` (``BLOCK_M`` must divide ``block_q``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _next_pow2(x: int) -> int:
    return 1 << max(4, (x - 1).bit_length())


def default_config(block_q: int, block_k: int, head_dim: int, dtype: torch.dtype) -> KernelConfig:
    """Fixed Hopper choice (sized to compile for sm_90a without spills, 2 CTAs per SM at D = 128).

    One query block per program (<= 128 rows, one warpgroup per 64 rows), 64-column key tiles (a 32-key
    mask gathers two list entries per tile, a 128-key one is walked in two halves). ``num_stages = 5``:
    Triton's pipeliner splits the stages between the index read and the K/V reads it feeds
    ((5 - 1) / 2 = 2 each), which gives 3 K/V buffers and a two-tile-deep prefetch (3 would give one).
    float32 (tests only) uses a shallow pipeline.
    """
    block_m = min(block_q, 128)
    num_warps = 4 if block_m <= 64 else 8
    num_stages = 2 if dtype == torch.float32 or head_dim > 128 else 5
    return KernelConfig(block_m, 64, num_warps, num_stages)


def _tune_configs() -> list["triton.Config"]:
    """Candidates for ``CALIB_BLOCKSPARSE_AUTOTUNE=1`` (pruned to ``BLOCK_M <= block_q``)."""
    out = []
    for bm, bn, warps, stages in [(64, 64, 4, 5), (64, 64, 4, 3), (64, 64, 4, 7), (64, 32, 4, 5),
                                  (64, 64, 8, 5), (64, 128, 8, 3), (128, 64, 8, 5), (32, 64, 4, 5)]:
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages))
    return out


def _prune(configs: list["triton.Config"], nargs: dict, **meta: object) -> list["triton.Config"]:
    """Triton's ``early_config_prune`` hook: keep the configs that fit the mask's blocks."""
    bq, bk = int(meta["BQ"]), int(meta["BK"])  # type: ignore[call-overload]
    kept = [c for c in configs
            if c.kwargs["BLOCK_M"] <= bq and (c.kwargs["BLOCK_N"] % bk == 0 or bk % c.kwargs["BLOCK_N"] == 0)]
    return kept or configs[:1]


_tuned_kernel = triton.autotune(
    configs=_tune_configs(), key=["D", "DV", "BQ", "BK", "IEEE"], prune_configs_by={"early_config_prune": _prune},
)(_blocksparse_attn_fwd_kernel)


def _pow2_block(size: int) -> bool:
    return size >= 16 and size & (size - 1) == 0


def _kernel_covers(q: torch.Tensor, mask: BlockMask, scale: float | None) -> bool:
    """Whether :func:`block_sparse_attention_into` takes these inputs (else the reference runs)."""
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32) and _pow2_block(mask.block_q)
            and _pow2_block(mask.block_k) and (scale is None or scale > 0))


def _check_mask(mask: BlockMask, device: torch.device) -> BlockMask:
    for name, size in (("block_q", mask.block_q), ("block_k", mask.block_k)):
        if not _pow2_block(size):
            raise ValueError(f"the Triton kernel needs {name} a power of two >= 16; got {size} "
                             "(use backend='reference')")
    mask = mask.to(device)
    offsets = mask.offsets if mask.offsets.dtype == torch.int64 else mask.offsets.long()
    indices = mask.indices if mask.indices.dtype == torch.int32 else mask.indices.int()
    return BlockMask(offsets.contiguous(), indices.contiguous(), mask.batch, mask.heads, mask.seq_q,
                     mask.seq_k, mask.block_q, mask.block_k)


def block_sparse_attention_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, out: torch.Tensor,
    lse: torch.Tensor | None = None, *, scale: float | None = None, config: KernelConfig | None = None,
) -> object:
    """Write the block-sparse attention of ``q, k, v`` into ``out: [B, Hq, Tq, Dv]`` (``q.dtype``,
    last dim contiguous) and, when given, ``lse: [B, Hq, Tq]`` float32 contiguous; every element is written.

    ``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]``, ``v: [B, Hkv, Tk, Dv]`` in float16, bfloat16 or float32
    (any strides; a non-unit last-dim stride is copied), blocks powers of two >= 16, ``scale > 0``.
    ``config`` overrides :func:`default_config`. Returns Triton's launch handle (``n_regs``, ``n_spills``,
    ``metadata.shared`` for diagnostics; None when the float32 detour ran). The mask must be a valid :class:`BlockMask` (sorted unique causal entries, as ``from_dense`` builds).
    """
    reference._check_shapes(q, k, v, mask)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton kernel takes float16, bfloat16 or float32; got {q.dtype}")
    if q.dtype == torch.bfloat16 and not q.is_cuda:
        # CPU means Triton's interpreter, whose tl.dot multiplies bf16 bit patterns (numpy has no bf16):
        # run the same kernel in float32 there.
        tmp = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        block_sparse_attention_into(q.float(), k.float(), v.float(), mask, tmp, lse, scale=scale, config=config)
        out.copy_(tmp)
        return None
    k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if out.shape != (b, hq, tq, dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, Hq, Tq, Dv]={(b, hq, tq, dv)} {q.dtype} with a contiguous last dim")
    if lse is not None and (lse.shape != (b, hq, tq) or lse.dtype != torch.float32 or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous float32 [B, Hq, Tq]={(b, hq, tq)} tensor")
    mask = _check_mask(mask, q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"the Triton kernel needs scale > 0; got {scale} (use backend='reference')")
    bq, bk, nq = mask.block_q, mask.block_k, mask.num_q_blocks
    lse_arg = lse if lse is not None else out  # never written when WRITE_LSE is False
    args = (q, k, v, out, lse_arg, mask.offsets, mask.indices,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            scale * LOG2E, tq, tk, hq, hq // hkv, nq)
    meta = dict(D=d, DV=dv, BLOCK_D=_next_pow2(d), BLOCK_DV=_next_pow2(dv), BQ=bq, BK=bk,
                IEEE=q.dtype == torch.float32, WRITE_LSE=lse is not None,
                BIG=max(tk * max(k.stride(2), v.stride(2)), (tq + bq) * max(q.stride(2), out.stride(2))) >= 2**31)
    if config is None and q.is_cuda and bq >= 64 and os.environ.get(_TUNE_ENV) == "1":
        meta["W_TAIL"] = _next_pow2(128 // bk + 2)  # covers every BLOCK_M of the tuning list

        def grid(m: dict) -> tuple[int]:
            return (nq * (bq // m["BLOCK_M"]) * b * hq,)

        return _tuned_kernel[grid](*args, **meta)
    cfg = config or default_config(bq, bk, d, q.dtype)
    if bq % cfg.block_m or (cfg.block_n % bk and bk % cfg.block_n):
        raise ValueError(f"{cfg} does not fit blocks {bq}x{bk}")
    grid = (nq * (bq // cfg.block_m) * b * hq,)
    return _blocksparse_attn_fwd_kernel[grid](
        *args, **meta, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, W_TAIL=_next_pow2(cfg.block_m // bk + 2),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, *, scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over the kept blocks of ``mask``: the reference's signature and result.

    ``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]``, ``v: [B, Hkv, Tk, Dv]`` -> ``out: [B, Hq, Tq, Dv]`` in
    ``q.dtype`` (and ``lse: [B, Hq, Tq]`` float32 with ``return_lse``; ``0`` / ``-inf`` for empty rows).
    What the kernel does not cover runs the PyTorch reference instead: float64 inputs (no float64
    tensor-core path), blocks that are not powers of two >= 16, and a scale <= 0 (the kernel folds the
    scale into the row max).
    """
    if not _kernel_covers(q, mask, scale):
        return reference.block_sparse_attention(q, k, v, mask, scale=scale, return_lse=return_lse)
    b, hq, tq = q.shape[:3]
    out = torch.empty(b, hq, tq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device) if return_lse else None
    block_sparse_attention_into(q, k, v, mask, out, lse, scale=scale)
    return (out, lse) if return_lse else out
