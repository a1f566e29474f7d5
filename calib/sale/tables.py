"""SALE calibration tables: one layer's errors and densities on the whole tau ladder (SPEC §5.2).

Why a table: tau-halving (:func:`calib.sale.halving.halve_thresholds`) needs ``Err(tau)`` of a layer's
heads on EVERY calibration sample at each step, i.e. all samples' tensors of that layer at once — too
much memory at long lengths if several layers or samples are held. But the candidates are known in
advance: ``tau0, tau0/2, ...`` while ``> tau_min``, then 0 (:func:`tau_ladder`, at most 8 values for the
defaults), and ``Err`` at a given tau does not depend on the order of evaluation. So while one dense
forward pass has one (layer, sample) in memory, :func:`evaluate_ladder` estimates the Selection-Pass
block scores once and records the error and density of every head at every ladder value; halving then
runs on the table (:func:`halve_from_table`, exactly the same decisions as a live halving, all heads
at once per step). Cost: one dense forward per sample and at most ``len(ladder)`` block-sparse
attentions per (layer, sample) — the same as the worst case of a live halving, without the L short
forwards (or stored activations) a live halving needs. Memory: one layer of one sample at a time.

For the shared-tau ablation the same pass also counts, per head, the causal blocks whose score
``ln max P~`` clears each value of a fine log-spaced tau grid (:func:`kept_counts`), so the mean density
of ANY shared tau on the grid follows without another pass (:func:`match_shared_tau`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calib.sale.halving import HalvingResult, halve_thresholds, head_errors
from runtime_kernels.blocksparse.api import block_sparse_attention
from runtime_kernels.blocksparse.mask import causal_block_mask
from runtime_kernels.sale.api import sale_block_scores
from runtime_kernels.sale.reference import SaleSelectionConfig, select_blocks


def tau_ladder(tau0: float, tau_min: float) -> list[float]:
    """The thresholds halving can visit, in order: float32 ``tau0, tau0/2, ...`` while ``> tau_min``,
    then 0 (dense). Same float32 arithmetic as :func:`halve_thresholds` (halving is exact)."""
    t = torch.tensor(float(tau0), dtype=torch.float32)
    out: list[float] = []
    while bool(t > tau_min):
        out.append(float(t))
        t = t / 2
    return out + [0.0]


def shared_tau_grid(points: int = 1601, low: float = 1e-8) -> torch.Tensor:
    """``[G]`` float32, ascending, log-spaced in ``[low, 1]``: the candidates of the shared tau."""
    return torch.logspace(torch.log10(torch.tensor(low)).item(), 0.0, points, dtype=torch.float64).float()


@dataclass
class LadderEval:
    """One (layer, sample): every head at every ladder value, plus the shared-tau block counts."""

    err: torch.Tensor  # [K, H] float32, Err(ladder[k]) = ||O - O~||_1 / N per head
    density: torch.Tensor  # [K, H] float32, kept / causal blocks
    kept: torch.Tensor  # [H, G] int64, causal blocks with score >= ln grid[g]
    causal: int  # causal blocks of the sample


def kept_counts(scores: torch.Tensor, grid: torch.Tensor, seq: int, block_q: int, block_k: int) -> torch.Tensor:
    """Per head the number of causal blocks kept at each grid threshold.

    ``scores: [H, NQ, NK]`` block scores (``ln max P~``, ``+inf`` always kept), ``grid: [G]`` float32
    ascending -> ``[H, G]`` int64 on the CPU. Uses the compare of :func:`select_blocks` exactly:
    kept iff ``score >= ln(tau)`` with ``ln`` taken in float64 of the float32 tau, cast to the scores' dtype.
    """
    causal = causal_block_mask(seq, seq, block_q, block_k, scores.device)  # [NQ, NK]
    log_grid = torch.log(grid.to(torch.float64)).to(scores.dtype).to(scores.device)  # [G]
    g = grid.numel()
    rows = []
    for head in scores:  # one head at a time: bounded memory at long lengths
        idx = torch.searchsorted(log_grid, head[causal].contiguous(), right=True)  # [C]: #grid values <= score
        hist = torch.bincount(idx, minlength=g + 1)  # [G + 1]
        rows.append(hist.flip(0).cumsum(0).flip(0)[1:].cpu())  # kept at grid[j] = #(idx > j)
    return torch.stack(rows)


def _ladder_log_taus(ladder: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``ln tau`` per ladder value as :func:`select_blocks` computes it (float64 log, cast): ``[K]``."""
    return torch.log(torch.tensor(ladder, dtype=torch.float32).to(torch.float64)).to(dtype).to(device)


def _row_chunks(n: int, width: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive query-row ranges with about ``budget`` elements of ``width`` each (>= 1 row)."""
    step = max(1, budget // max(1, width))
    return [(r, min(r + step, n)) for r in range(0, n, step)]


def ladder_errors_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_dense: torch.Tensor,
                           scores: torch.Tensor, ladder: list[float], config: SaleSelectionConfig, *,
                           scale: float | None = None, chunk_elems: int | None = None) -> torch.Tensor:
    """``Err`` of every head at every ladder tau from per-key-block softmax partials: ``[K, Hq]`` float32.

    Exactly the block-sparse attention of :func:`block_sparse_attention` (same kept blocks, exact softmax
    over them), computed once for all thresholds: per query row and key block ``j`` the partial max
    ``m_j``, sum ``l_j = sum exp(s - m_j)`` and output ``u_j = sum exp(s - m_j) v`` (causal elements only);
    a threshold keeps a set ``J`` of blocks and ``O~ = sum_J e^(m_j - M) u_j / sum_J e^(m_j - M) l_j`` with
    ``M = max_J m_j``. Cost: one dense attention plus ``K`` cheap ``[rows, NK, D]`` reductions, instead of
    ``K`` block-sparse attentions. Rows are processed in chunks of about ``chunk_elems`` scores + partials,
    each against only the keys its last row can see (default ``2**24``, ``2**28`` on CUDA).
    ``q: [Hq, N, D]``, ``k, v: [Hkv, N, D]``, ``o_dense: [Hq, N, Dv]``,
    ``scores: [Hq, NQ, NK]`` block scores.
    """
    hq, n, d = q.shape
    g, dv, bq, bk = hq // k.shape[0], v.shape[-1], config.block_q, config.block_k
    chunk_elems = chunk_elems or (1 << 28 if q.is_cuda else 1 << 24)
    scale = d ** -0.5 if scale is None else float(scale)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    log_taus = _ladder_log_taus(ladder, scores.dtype, q.device)  # [K]
    nk = -(-n // bk)
    err = torch.zeros(len(ladder), hq, dtype=torch.float64, device=q.device)
    k_pad = torch.nn.functional.pad(k.to(cdt), (0, 0, 0, nk * bk - n))  # [Hkv, NK*bk, D]
    v_blk = torch.nn.functional.pad(v.to(cdt), (0, 0, 0, nk * bk - n)).view(k.shape[0], nk, bk, dv)
    for h in range(hq):
        row_scores = scores[h].repeat_interleave(bq, 0)  # [NQ*bq, NK]: each query row's block scores
        for r0, r1 in _row_chunks(n, n + nk * (dv + 2 * len(ladder)), chunk_elems):
            nkc = -(-r1 // bk)  # key blocks visible to the chunk's last row
            s = q[h, r0:r1].to(cdt) @ k_pad[h // g, : nkc * bk].T  # [R, nkc*bk]
            s.mul_(scale)  # in place: the rounding of ``@ ... * scale``
            pos = torch.arange(r0, r1, device=q.device)
            # causal mask: only keys after the chunk's first row can be future keys of some row
            s[:, r0 + 1:].masked_fill_(torch.arange(r0 + 1, nkc * bk, device=q.device)[None, :] > pos[:, None],
                                       -torch.inf)
            s = s.view(r1 - r0, nkc, bk)
            m = s.amax(-1)  # [R, nkc], -inf for blocks above the diagonal
            m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = s.sub_(m_safe[..., None]).exp_()  # [R, nkc, bk], in place of the scores
            l = p.sum(-1)  # [R, nkc]
            u = torch.einsum("rjk,jkd->rjd", p, v_blk[h // g, :nkc])  # [R, nkc, Dv]
            blk_scores = row_scores[r0:r1, :nkc]  # [R, nkc]
            keep = (blk_scores[None] >= log_taus[:, None, None]) & (l > 0)[None]  # [K, R, nkc]
            top = torch.where(keep, m_safe[None], -torch.inf).amax(-1, keepdim=True)  # [K, R, 1]
            w = torch.where(keep, torch.exp(m_safe[None] - top), 0.0)  # [K, R, nkc]
            den = (w * l[None]).sum(-1, keepdim=True)  # [K, R, 1], > 0: the diagonal block is always kept
            o = torch.einsum("krj,rjd->krd", w, u) / torch.where(den > 0, den, 1.0)  # [K, R, Dv]
            err[:, h] += (o - o_dense[h, r0:r1].to(cdt)[None]).abs().sum((1, 2), dtype=torch.float64)
    return (err / n).to(torch.float32).cpu()


@torch.no_grad()
def evaluate_ladder(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_dense: torch.Tensor, ladder: list[float],
                    config: SaleSelectionConfig, *, scale: float | None = None, grid: torch.Tensor | None = None,
                    impl: str = "partials") -> LadderEval:
    """Errors and densities of one layer's heads on one sample at every ladder value.

    ``q: [Hq, N, D]``, ``k, v: [Hkv, N, D]`` (RoPE'd, as the attention saw them), ``o_dense: [Hq, N, Dv]``
    the model's own attention output before ``o_proj``. The block scores are estimated once.
    ``impl``: ``"partials"`` (:func:`ladder_errors_partials`, one dense pass for all thresholds) or
    ``"blocksparse"`` (one :func:`block_sparse_attention` per threshold; the definition, for tests).
    """
    hq, n = q.shape[0], q.shape[1]
    scores = sale_block_scores(q[None], k[None], config=config, scale=scale)  # [1, Hq, NQ, NK]
    causal = causal_block_mask(n, n, config.block_q, config.block_k, q.device)  # [NQ, NK]
    log_taus = _ladder_log_taus(ladder, scores.dtype, q.device)
    dens = torch.stack([((scores[0] >= lt) & causal).sum((-1, -2)) for lt in log_taus]).float() / causal.sum()
    if impl == "partials":
        errs = ladder_errors_partials(q, k, v, o_dense, scores[0], ladder, config, scale=scale)
    elif impl == "blocksparse":
        rows = []
        for t in ladder:
            mask = select_blocks(scores, torch.full((hq,), t), seq_q=n, seq_k=n, block_q=config.block_q,
                                 block_k=config.block_k)
            o = block_sparse_attention(q[None], k[None], v[None], mask, scale=scale)  # [1, Hq, N, Dv]
            rows.append(head_errors(o_dense[None], o)[0].cpu())
        errs = torch.stack(rows)
    else:
        raise ValueError(f"impl must be 'partials' or 'blocksparse', got {impl!r}")
    kept = (kept_counts(scores[0], grid, n, config.block_q, config.block_k) if grid is not None
            else torch.zeros(hq, 0, dtype=torch.int64))
    return LadderEval(errs, dens.cpu(), kept, int(causal.sum()))


def _lookup(ladder: list[float], tau: torch.Tensor) -> torch.Tensor:
    """Ladder index of every entry of ``tau: [H]`` (exact float32 match)."""
    index = {v: i for i, v in enumerate(ladder)}
    try:
        return torch.tensor([index[float(t)] for t in tau.to(torch.float32)])
    except KeyError as exc:
        raise ValueError(f"tau {exc.args[0]} is not on the ladder {ladder}") from None


def at_tau(table: torch.Tensor, ladder: list[float], tau: torch.Tensor) -> torch.Tensor:
    """``table: [K, S, H]`` read at each head's own tau ``[H]`` -> ``[S, H]``."""
    ks = _lookup(ladder, tau)
    return table.permute(2, 0, 1)[torch.arange(table.shape[2]), ks].T  # [S, H]


def halve_from_table(err: torch.Tensor, ladder: list[float], *, theta: float, tau0: float,
                     tau_min: float) -> HalvingResult:
    """tau-halving of one layer's heads on a precomputed ``err: [K, S, H]`` table (see module docstring)."""
    return halve_thresholds(lambda tau: at_tau(err, ladder, tau), theta=theta, tau0=tau0,
                            num_heads=err.shape[2], tau_min=tau_min)


def match_shared_tau(kept: torch.Tensor, causal: torch.Tensor, grid: torch.Tensor,
                     target_density: float) -> tuple[float, float]:
    """The one tau (grid value, or 0) whose mean density over (layer, sample, head) is closest to
    ``target_density``; ties go to the larger tau. ``kept: [L, S, H, G]``, ``causal: [S]``.

    Returns ``(tau, its mean density)``; the mean density is non-increasing along the grid.
    """
    dens = (kept.double() / causal.double()[None, :, None, None]).mean(dim=(0, 1, 2))  # [G]
    taus = torch.cat([torch.zeros(1), grid.float()])
    dens = torch.cat([torch.ones(1, dtype=dens.dtype), dens])
    gap = (dens - target_density).abs()
    best = int(torch.nonzero(gap == gap.min()).max())  # ties -> the larger tau
    return float(taus[best]), float(dens[best])
