"""SALE's Selection-Pass in plain PyTorch (Ji et al., arXiv:2505.24179, §3.2, §3.4, App. B, H, J).

The definitions, including every decision where the paper is silent or garbled, sit on the functions:

* **Scores** are scaled: ``S = q·k / sqrt(D)`` (or ``scale`` when given). Queries are the last ``Tq``
  positions of the ``Tk`` keys (prefill: ``Tq == Tk``); query row ``i`` sits at ``Tk - Tq + i``.
* **Estimate** ``S~`` of the scores from quantized Q and smoothed K: :func:`approximate_scores`.
* **Sink and local blocks**, always kept: :func:`sink_local_ranges`; their exact row statistics ``m~, l~``:
  :func:`sink_local_stats`.
* **Relative Attention Score** ``P~ = exp(S~ - m~) / l~`` and the kept blocks: :func:`sale_block_scores`,
  :func:`select_blocks`.

Long inputs are processed in chunks of query blocks (:func:`sale_block_scores`), never holding more than
``chunk_elems`` scores at once (at least one query block against its visible keys). Decisions and
deviations: docs/methods.md, SALE.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from runtime_kernels.blocksparse.mask import BlockMask

_PRECISIONS = {4: "int4", 8: "int8", None: "float"}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class SaleSelectionConfig:
    """Hyper-parameters of the Selection-Pass; ``asdict``/``to_dict`` is what an artifact stores."""

    block_q: int = 64  # b_q, queries per block (paper §4.1)
    block_k: int = 32  # b_k, keys per block
    sink: int = 32  # sink tokens (rounded up to whole key blocks)
    local: int = 256  # local window length in tokens (<=), see the module docstring
    bits: int | None = 4  # 4 (paper), 8 (int8 tensor cores, for GPUs without int4 ones), None = exact float scores
    smooth_k: bool = True  # subtract the per-head key mean before quantizing (SageAttention2)

    def __post_init__(self) -> None:
        if self.bits not in _PRECISIONS:
            raise ValueError(f"bits must be 4, 8 or None (float); got {self.bits!r}")
        if self.block_q < 1 or self.block_k < 1 or self.sink < 0 or self.local < 0:
            raise ValueError(f"invalid block sizes / sink / local in {self}")

    @property
    def precision(self) -> str:
        """Estimator precision recorded in artifacts: ``"int4"``, ``"int8"`` or ``"float"``."""
        return _PRECISIONS[self.bits]

    def to_dict(self) -> dict:
        return {**asdict(self), "precision": self.precision}


# ----------------------------------------------------------------------------------------- quantization
def quantize_blockwise(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-block quantization along the token axis.

    ``x: [..., T, D]`` -> ``(x_int: [..., T, D] int8 in [-qmax, qmax], scales: [..., ceil(T/block)])`` with
    ``qmax = 2**(bits-1) - 1`` and ``scales = max|x_block| / qmax`` (1 for an all-zero block); the last
    block may be partial. ``dequantize_blockwise`` inverts it up to rounding.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8; got {bits}")
    qmax = 2 ** (bits - 1) - 1
    t = x.shape[-2]
    nb = _ceil_div(t, block)
    xf = x.to(_compute_dtype(x.dtype))
    padded = F.pad(xf, (0, 0, 0, nb * block - t)).unflatten(-2, (nb, block))  # [..., NB, block, D]
    amax = padded.abs().amax(dim=(-1, -2))  # [..., NB]
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    per_token = scales.repeat_interleave(block, dim=-1)[..., :t, None]  # [..., T, 1]
    x_int = torch.round(xf / per_token).clamp_(-qmax, qmax).to(torch.int8)
    return x_int, scales


def dequantize_blockwise(x_int: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``x_int: [..., T, D]``, ``scales: [..., NB]`` -> ``[..., T, D]`` in the scales' dtype."""
    t = x_int.shape[-2]
    return x_int.to(scales.dtype) * scales.repeat_interleave(block, dim=-1)[..., :t, None]


@dataclass
class _Estimate:
    """What S~ needs, prepared once for all chunks: ``S~ = (q_val @ k_val^T) * q_row * k_col + shift``."""

    q_val: torch.Tensor  # [B, Hq, Tq, D] integer-valued (or exact q for bits=None)
    q_row: torch.Tensor  # [B, Hq, Tq] scale * Q block scale of the row
    k_val: torch.Tensor  # [B, Hkv, Tk, D] integer-valued smoothed K (or exact k)
    k_col: torch.Tensor  # [B, Hkv, Tk] K block scale of the column
    shift: torch.Tensor  # [B, Hq, Tq] scale * q · k_bar


def _prepare_estimate(q: torch.Tensor, k: torch.Tensor, cfg: SaleSelectionConfig, scale: float) -> _Estimate:
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    qf, kf = q.to(cdt), k.to(cdt)
    if cfg.bits is None:
        return _Estimate(qf, torch.full((b, hq, tq), scale, dtype=cdt, device=q.device), kf,
                         torch.ones(b, hkv, tk, dtype=cdt, device=q.device),
                         torch.zeros(b, hq, tq, dtype=cdt, device=q.device))
    k_bar = kf.mean(dim=-2, keepdim=True) if cfg.smooth_k else torch.zeros_like(kf[:, :, :1])  # [B, Hkv, 1, D]
    q_int, q_scales = quantize_blockwise(qf, cfg.block_q, cfg.bits)
    k_int, k_scales = quantize_blockwise(kf - k_bar, cfg.block_k, cfg.bits)
    q_row = q_scales.repeat_interleave(cfg.block_q, dim=-1)[..., :tq] * scale  # [B, Hq, Tq]
    k_col = k_scales.repeat_interleave(cfg.block_k, dim=-1)[..., :tk]  # [B, Hkv, Tk]
    shift = torch.einsum("bngtd,bnd->bngt", qf.view(b, hkv, hq // hkv, tq, d), k_bar[:, :, 0]) * scale
    return _Estimate(q_int.to(cdt), q_row, k_int.to(cdt), k_col, shift.reshape(b, hq, tq))


def _estimate_rows(est: _Estimate, r0: int, r1: int, c1: int) -> torch.Tensor:
    """S~ for query rows ``[r0, r1)`` against keys ``[0, c1)``: ``[B, Hq, r1 - r0, c1]``."""
    b, hq, _, d = est.q_val.shape
    hkv = est.k_val.shape[1]
    g, r = hq // hkv, r1 - r0
    qv = est.q_val[:, :, r0:r1].reshape(b, hkv, g * r, d)  # heads of one KV group stacked
    s = qv @ est.k_val[:, :, :c1].transpose(-1, -2)  # [B, Hkv, G*r, c1]
    s = s.view(b, hkv, g, r, c1) * est.k_col[:, :, None, None, :c1]
    return s.view(b, hq, r, c1) * est.q_row[:, :, r0:r1, None] + est.shift[:, :, r0:r1, None]


def _estimate_block_row_max(est: _Estimate, r0: int, r1: int, c1: int, block_k: int,
                            first_key: int) -> torch.Tensor:
    """Per query row of ``[r0, r1)`` and key block of ``[0, c1)`` the largest causal S~: ``[B, Hq, R, NKc]``.

    Bitwise the key-block max of :func:`_estimate_rows` with keys after the row (position
    ``first_key + row``) at ``-inf``: the per-row factor ``q_row >= 0`` and ``shift`` are applied after
    the max, which commutes with them (rounded ``x * a + b`` is non-decreasing in ``x`` for ``a >= 0``).
    Only the product with the per-key scale touches the ``[R, c1]`` scores, in place.
    """
    b, hq, _, d = est.q_val.shape
    hkv = est.k_val.shape[1]
    g, r, nkc = hq // hkv, r1 - r0, _ceil_div(c1, block_k)
    qv = est.q_val[:, :, r0:r1].reshape(b, hkv, g * r, d)
    s = qv @ est.k_val[:, :, :c1].transpose(-1, -2)  # [B, Hkv, G*r, c1]
    s.view(b, hkv, g, r, c1).mul_(est.k_col[:, :, None, None, :c1])
    s = s.view(b, hq, r, c1)
    lo = max(0, first_key + r0 + 1)  # the first key some row of the chunk must not see
    if lo < c1:
        q_pos = first_key + torch.arange(r0, r1, device=s.device)
        s[..., lo:].masked_fill_(torch.arange(lo, c1, device=s.device)[None, :] > q_pos[:, None], -math.inf)
    if nkc * block_k != c1:
        s = F.pad(s, (0, nkc * block_k - c1), value=-math.inf)
    top = s.view(b, hq, r, nkc, block_k).amax(-1)  # [B, Hq, R, NKc]
    out = top * est.q_row[:, :, r0:r1, None] + est.shift[:, :, r0:r1, None]
    return out.masked_fill_(top == -math.inf, -math.inf)  # no visible key: -inf whatever q_row is


def approximate_scores(
    q: torch.Tensor, k: torch.Tensor, *, bits: int | None = 4, block_q: int = 64, block_k: int = 32,
    smooth_k: bool = True, scale: float | None = None,
) -> torch.Tensor:
    """The estimate S~ for all pairs, ``[B, Hq, Tq, Tk]`` (no causal mask). Small inputs only.

    ``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]``. App. B, with SageAttention2's smoothing of K: ``k_bar`` =
    per-(batch, KV head) mean of K over all ``Tk`` tokens; Q is quantized per ``block_q`` query block and
    K - k_bar per ``block_k`` key block, per (batch, head), with one symmetric scale ``max|x| / qmax`` per
    block (``qmax`` = 7 for int4, 127 for int8; round-half-even, clamp to ``[-qmax, qmax]``). Then
    ``S~ = scale * (deq(Q) · deq(K - k_bar)^T + q · k_bar)``; the shift ``q · k_bar`` uses the *unquantized* q
    (it is constant along a row, so it only re-aligns S~ with the exact m~). ``bits=None`` gives exact float
    scores (the paper's "SALE w/o QK Quant", the recall reference). The integer products are accumulated
    in float32, exact while ``D * qmax**2 < 2**24`` (D <= 1040 at int8).
    """
    cfg = SaleSelectionConfig(block_q=block_q, block_k=block_k, bits=bits, smooth_k=smooth_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _estimate_rows(_prepare_estimate(q, k, cfg, scale), 0, q.shape[2], k.shape[2])


# ------------------------------------------------------------------------------------- sink and local
def sink_local_ranges(seq_q: int, seq_k: int, cfg: SaleSelectionConfig,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per query block the contiguous local key-block range ``[lo, hi]`` (``[NQ]`` int64 each, diagonal
    included, ``hi`` = the block holding the query block's last position) and the number of sink key
    blocks ``n_sink`` (sink block ``j`` is also causal-limited: ``j <= hi``).

    For query block ``i`` (first query at ``s_i``, last at ``e_i``, absolute): sink = key blocks
    ``j < ceil(sink / block_k)``; local = key blocks that *start* inside the window of the ``local`` keys ending
    at ``e_i`` (``e_i + 1 - local <= j * block_k <= e_i``), so the local area is at most ``local`` tokens
    (paper §4.1: "no more than 256"; with 64x32 blocks: exactly the 8 key blocks ending at the block's last
    query, the diagonal included), plus, always, every key block overlapping the query block's own positions
    ``[s_i, e_i]`` (the diagonal), whatever ``local`` is.
    """
    nq = _ceil_div(seq_q, cfg.block_q)
    i = torch.arange(nq, device=device)
    first = (seq_k - seq_q) + i * cfg.block_q
    last = (seq_k - seq_q) + torch.clamp((i + 1) * cfg.block_q, max=seq_q) - 1
    hi = last // cfg.block_k
    window_lo = torch.div((last + 1 - cfg.local).clamp(min=0) + cfg.block_k - 1, cfg.block_k, rounding_mode="floor")
    lo = torch.minimum(window_lo, first // cfg.block_k)
    return lo, hi, _ceil_div(cfg.sink, cfg.block_k)


def sink_local_block_mask(seq_q: int, seq_k: int, cfg: SaleSelectionConfig,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """``[NQ, NK]`` bool: the always-kept (sink or local, causal) blocks."""
    lo, hi, n_sink = sink_local_ranges(seq_q, seq_k, cfg, device)
    j = torch.arange(_ceil_div(seq_k, cfg.block_k), device=device)[None, :]
    return ((j >= lo[:, None]) | (j < n_sink)) & (j <= hi[:, None])


def _sink_local_stats_blocks(q: torch.Tensor, k: torch.Tensor, cfg: SaleSelectionConfig, scale: float,
                             qb0: int, qb1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact m~, l~ for the rows of query blocks ``[qb0, qb1)``: two ``[B, Hq, R]`` tensors."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    bq, bk, g = cfg.block_q, cfg.block_k, hq // hkv
    cdt, dev = _compute_dtype(q.dtype), q.device
    lo, hi, n_sink = sink_local_ranges(tq, tk, cfg, dev)
    lo, hi = lo[qb0:qb1], hi[qb0:qb1]
    nqc, r0, r1 = qb1 - qb0, qb0 * bq, min(qb1 * bq, tq)
    q_pos = (tk - tq) + r0 + torch.arange(nqc * bq, device=dev).view(nqc, bq)  # [nqc, bq]
    q_c = F.pad(q[:, :, r0:r1].to(cdt), (0, 0, 0, nqc * bq - (r1 - r0))).view(b, hkv, g, nqc, bq, d)

    width = int((hi - lo).max()) + 1  # local key blocks of the widest query block
    blk = lo[:, None] + torch.arange(width, device=dev)  # [nqc, W]
    tok = (blk[:, :, None] * bk + torch.arange(bk, device=dev)).flatten(1)  # [nqc, W*bk]
    tok_ok = (blk <= hi[:, None]).repeat_interleave(bk, dim=1) & (tok < tk)
    k_loc = k.to(cdt)[:, :, tok.clamp(max=tk - 1)]  # [B, Hkv, nqc, W*bk, D]
    s_loc = torch.einsum("bngiqd,bnikd->bngiqk", q_c, k_loc) * scale  # [B, Hkv, G, nqc, bq, W*bk]
    ok_loc = tok_ok[:, None, :] & (tok[:, None, :] <= q_pos[:, :, None])  # [nqc, bq, W*bk]

    n_tok = min(n_sink * bk, tk)  # sink keys not already in the local range (counted once)
    s_tok = torch.arange(n_tok, device=dev)
    s_sink = torch.einsum("bngiqd,bnkd->bngiqk", q_c, k[:, :, :n_tok].to(cdt)) * scale
    ok_sink = ((s_tok // bk)[None, :] < lo[:, None])[:, None, :] & (s_tok[None, None, :] <= q_pos[:, :, None])

    s_loc = s_loc.masked_fill(~ok_loc, -math.inf)
    s_sink = s_sink.masked_fill(~ok_sink, -math.inf)
    m = s_loc.amax(-1) if n_tok == 0 else torch.maximum(s_loc.amax(-1), s_sink.amax(-1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # padded rows only
    l = torch.exp(s_loc - m[..., None]).sum(-1) + torch.exp(s_sink - m[..., None]).sum(-1)
    return m.reshape(b, hq, nqc * bq)[..., : r1 - r0], l.reshape(b, hq, nqc * bq)[..., : r1 - r0]


def sink_local_stats(
    q: torch.Tensor, k: torch.Tensor, *, block_q: int = 64, block_k: int = 32, sink: int = 32,
    local: int = 256, scale: float | None = None, chunk_q_blocks: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``(m~, l~)``, each ``[B, Hq, Tq]``: row max and ``sum exp(S - m~)`` of EXACT scores over the causal
    keys (``key <= row position``) of the row's query block's sink and local blocks (:func:`sink_local_ranges`;
    each key counted once). ``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]``.

    Unlike Alg. 1 line 8 the causal mask applies, so m~, l~ describe exactly the mass the kept sink/local
    blocks contribute. Every row sees its own key, so ``l~ >= 1``.
    """
    cfg = SaleSelectionConfig(block_q=block_q, block_k=block_k, sink=sink, local=local)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    nq = _ceil_div(q.shape[2], block_q)
    parts = [_sink_local_stats_blocks(q, k, cfg, scale, i, min(i + chunk_q_blocks, nq))
             for i in range(0, nq, chunk_q_blocks)]
    return torch.cat([p[0] for p in parts], -1), torch.cat([p[1] for p in parts], -1)


# ------------------------------------------------------------------------------------------ selection
def relative_attention_scores(
    q: torch.Tensor, k: torch.Tensor, *, config: SaleSelectionConfig = SaleSelectionConfig(),
    scale: float | None = None,
) -> torch.Tensor:
    """``P~ = exp(S~ - m~) / l~`` for all pairs, ``[B, Hq, Tq, Tk]``, 0 above the causal diagonal.
    Small inputs only (inspection and tests); selection itself uses :func:`sale_block_scores`."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    tq, tk = q.shape[2], k.shape[2]
    s = _estimate_rows(_prepare_estimate(q, k, config, scale), 0, tq, tk)
    m, l = sink_local_stats(q, k, block_q=config.block_q, block_k=config.block_k, sink=config.sink,
                            local=config.local, scale=scale)
    p = torch.exp(s - m[..., None]) / l[..., None]
    causal = torch.arange(tk, device=q.device)[None, :] <= (tk - tq + torch.arange(tq, device=q.device))[:, None]
    return p.masked_fill(~causal, 0.0)


def _block_scores_chunk(est: _Estimate, q: torch.Tensor, k: torch.Tensor, cfg: SaleSelectionConfig,
                        scale: float, qb0: int, qb1: int) -> torch.Tensor:
    """``ln max P~`` per block for query blocks ``[qb0, qb1)``: ``[B, Hq, qb1 - qb0, NK]``."""
    b, hq, tq, _ = q.shape
    tk = k.shape[2]
    bq, bk = cfg.block_q, cfg.block_k
    nqc, nk = qb1 - qb0, _ceil_div(tk, bk)
    r0, r1 = qb0 * bq, min(qb1 * bq, tq)
    c1 = min(tk, tk - tq + r1)  # keys visible to the chunk's last row
    m, l = _sink_local_stats_blocks(q, k, cfg, scale, qb0, qb1)  # [B, Hq, R]
    # max over each block's keys first, then the row terms: ln max P~ = max_rows (max_keys S~ - m~ - ln l~)
    s = _estimate_block_row_max(est, r0, r1, c1, bk, tk - tq)  # [B, Hq, R, nkc]
    s -= (m + torch.log(l))[..., None]  # S~ - m~ - ln l~ = ln P~ (-inf stays -inf)
    nkc = s.shape[-1]
    if nqc * bq != r1 - r0:
        s = F.pad(s, (0, 0, 0, nqc * bq - (r1 - r0)), value=-math.inf)
    blk = s.view(b, hq, nqc, bq, nkc).amax(dim=3)  # [B, Hq, nqc, nkc]
    out = F.pad(blk, (0, nk - nkc), value=-math.inf)
    always = sink_local_block_mask(tq, tk, cfg, q.device)[qb0:qb1]  # [nqc, NK]
    return out.masked_fill_(always, math.inf)


def sale_block_scores(
    q: torch.Tensor, k: torch.Tensor, *, config: SaleSelectionConfig = SaleSelectionConfig(),
    scale: float | None = None, chunk_elems: int = 1 << 26,
) -> torch.Tensor:
    """Per block ``ln`` of its largest Relative Attention Score, ``[B, Hq, NQ, NK]`` (compute dtype).

    ``+inf`` marks sink/local blocks (always kept), ``-inf`` blocks above the causal diagonal. A block is
    kept at threshold ``tau`` iff its score ``>= ln tau`` (:func:`select_blocks`). Query blocks are
    processed in chunks so that at most ``max(chunk_elems, B*Hq*block_q*Tk)`` scores exist at once.

    A non-sink/local causal block is kept iff some causal element of it has ``P~ = exp(S~ - m~) / l~ >= tau``,
    i.e. the single compare ``S~ >= m~ + ln(tau * l~)`` (Eq. 3's ``ln(tau * l~ + m~)`` is a typo), evaluated
    as ``max(S~ - m~ - ln l~) >= ln tau`` per block: the block score ``ln max P~`` does not depend on tau, so
    one estimate serves every tau of a calibration. ``tau = 0`` gives ``ln 0 = -inf``: every causal block kept.
    """
    b, hq, tq, d = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[-1] != d or hq % k.shape[1] or tq > k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} are not [B, Hq, Tq, D] / [B, Hkv, Tk, D] "
                         "with Hq % Hkv == 0 and Tq <= Tk")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    est = _prepare_estimate(q, k, config, scale)
    nq = _ceil_div(tq, config.block_q)
    step = max(1, chunk_elems // max(1, b * hq * config.block_q * k.shape[2]))
    return torch.cat([_block_scores_chunk(est, q, k, config, scale, i, min(i + step, nq))
                      for i in range(0, nq, step)], dim=2)


def select_blocks(block_scores: torch.Tensor, tau: torch.Tensor | float, *, seq_q: int, seq_k: int,
                  block_q: int, block_k: int) -> BlockMask:
    """Threshold ``block_scores: [B, Hq, NQ, NK]`` at per-head ``tau: [Hq]`` (or one float) -> BlockMask.

    Kept iff ``score >= ln tau`` (``tau = 0``: every causal block). ``tau`` must be in ``[0, 1]``.
    """
    hq = block_scores.shape[1]
    tau = torch.as_tensor(tau, dtype=torch.float64, device=block_scores.device).expand(hq)
    if bool(((tau < 0) | (tau > 1) | tau.isnan()).any()):
        raise ValueError(f"tau must lie in [0, 1]; got {tau.tolist()}")
    log_tau = torch.log(tau).to(block_scores.dtype)  # [Hq], -inf where tau == 0
    keep = block_scores >= log_tau[None, :, None, None]
    return BlockMask.from_dense(keep, seq_q, seq_k, block_q, block_k)


def sale_select(
    q: torch.Tensor, k: torch.Tensor, tau: torch.Tensor | float, *, block_q: int = 64, block_k: int = 32,
    sink: int = 32, local: int = 256, bits: int | None = 4, smooth_k: bool = True,
    scale: float | None = None, chunk_elems: int = 1 << 26,
) -> BlockMask:
    """SALE Selection-Pass: ``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]``, ``tau: [Hq]`` -> BlockMask
    (heads = Hq, blocks ``block_q x block_k``). See the module docstring for every definition."""
    cfg = SaleSelectionConfig(block_q=block_q, block_k=block_k, sink=sink, local=local, bits=bits,
                              smooth_k=smooth_k)
    scores = sale_block_scores(q, k, config=cfg, scale=scale, chunk_elems=chunk_elems)
    return select_blocks(scores, tau, seq_q=q.shape[2], seq_k=k.shape[2], block_q=block_q, block_k=block_k)
