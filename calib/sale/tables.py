"""SALE calibration tables: one layer's errors and densities on the whole tau ladder (docs/methods.md, SALE).

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


def _causal_counts(r0: int, rows: int, nkc: int, block_k: int, n: int, device: torch.device) -> torch.Tensor:
    """Causal keys of key block ``j`` that query row ``r0 + i`` sees: ``[rows, nkc]`` (0 for padded rows)."""
    pos = torch.arange(r0, r0 + rows, device=device)[:, None]  # [R, 1]
    start = torch.arange(nkc, device=device)[None, :] * block_k  # [1, nkc]
    seen = (pos - start + 1).clamp(0, block_k).clamp_(max=(n - start).clamp(min=0))
    return torch.where(pos < n, seen, torch.zeros_like(seen))


def _nonempty(keep: torch.Tensor, r0: int, n: int, bq: int, bk: int) -> torch.Tensor:
    """Rows of the chunk with at least one kept causal key at each threshold: ``[Hq, nqc, K, bq]`` bool."""
    nqc, nkc = keep.shape[1], keep.shape[3]
    counts = _causal_counts(r0, nqc * bq, nkc, bk, n, keep.device).to(keep.dtype)  # [Rp, nkc]
    return (keep @ counts.view(nqc, bq, nkc).transpose(1, 2)) > 0


def _ladder_chunk(q: torch.Tensor, k_pad: torch.Tensor, v_blk: torch.Tensor, keep: torch.Tensor, r0: int, r1: int,
                  bq: int, bk: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept-block softmax outputs of query rows ``[r0, r1)`` (whole query blocks) at every threshold.

    ``q: [Hkv, G, N, D]`` (compute dtype), ``k_pad: [Hkv, NK*bk, D]``, ``v_blk: [Hkv, NK, bk, Dv]``,
    ``keep: [Hq, nqc, K, nkc]`` (compute dtype 0/1) -> ``(num: [Hq, nqc, K, bq, Dv], den: [Hq, nqc, K, bq])``:
    per threshold the sums over kept causal keys of ``exp(s - M) v`` and ``exp(s - M)``, ``M`` the row's
    max over ALL its causal keys (one exponential for every threshold; the ratio is the kept softmax).
    """
    hkv, g, _, d = q.shape
    nqc, nkc, kk = keep.shape[1], keep.shape[3], keep.shape[2]
    rp, c, dv = nqc * bq, nkc * bk, v_blk.shape[-1]
    qc = torch.nn.functional.pad(q[:, :, r0:r1], (0, 0, 0, rp - (r1 - r0)))  # [Hkv, G, Rp, D]
    s = (qc.reshape(hkv, g * rp, d) @ k_pad[:, :c].transpose(1, 2)).view(hkv, g, rp, c)
    s.mul_(scale)  # in place: the rounding of ``@ ... * scale``
    pos = torch.arange(r0, r0 + rp, device=q.device)
    s[..., r0 + 1:].masked_fill_(torch.arange(r0 + 1, c, device=q.device)[None, :] > pos[:, None], -torch.inf)
    p = s.sub_(s.amax(-1, keepdim=True)).exp_()  # [Hkv, G, Rp, C]; every row sees key 0, so the max is finite
    p_blk = p.view(hkv, g, nqc, bq, nkc, bk)
    den_rows = p_blk.sum(-1).view(hkv * g, nqc, bq, nkc)  # [Hq, nqc, bq, nkc]
    # per KV head: each key block's partial outputs u_j = p_j @ v_j for all rows of its query heads (one
    # bmm over key blocks reading p in place), then per (head, query block) the keep matmul over key blocks
    keep_kv = keep.view(hkv, g * nqc, kk, nkc)
    num = torch.stack([torch.bmm(keep_kv[i], torch.bmm(p[i].view(g * rp, nkc, bk).transpose(0, 1), v_blk[i, :nkc])
                                 .view(nkc, g * nqc, bq * dv).transpose(0, 1)) for i in range(hkv)])
    num = num.view(hkv * g, nqc, kk, bq, dv)  # [Hq, nqc, K, bq, Dv]
    den = (den_rows @ keep.transpose(-1, -2)).transpose(-1, -2)  # [Hq, nqc, K, bq]
    return num, den


def _ladder_chunk_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, r0: int, r1: int,
                        n: int, bq: int, bk: int, scale: float) -> torch.Tensor:
    """:func:`_ladder_chunk`'s ratio by SDPA over each threshold's kept causal elements (its own softmax
    max), for the rare rows whose kept mass underflows against the row max. ``q: [Hq, N, D]``,
    ``k, v: [Hkv, N, D]``, ``keep: [Hq, nqc, K, nkc]`` -> ``[Hq, nqc, K, bq, Dv]`` (0 for empty rows)."""
    hq, nqc, kk, nkc = keep.shape
    rp, c = nqc * bq, min(n, nkc * bk)
    qc = torch.nn.functional.pad(q[:, r0:r1], (0, 0, 0, rp - (r1 - r0)))  # [Hq, Rp, D]
    pos = torch.arange(r0, r0 + rp, device=q.device)
    causal = torch.arange(c, device=q.device)[None, :] <= pos[:, None]  # [Rp, C]
    outs = []
    for t in range(kk):
        allowed = keep[:, :, t].bool().repeat_interleave(bq, 1).repeat_interleave(bk, 2)[:, :, :c] & causal
        o = torch.nn.functional.scaled_dot_product_attention(qc, k[:, :c], v[:, :c], attn_mask=allowed,
                                                              scale=scale, enable_gqa=True)  # [Hq, Rp, Dv]
        outs.append(torch.where(allowed.any(-1, keepdim=True), o, 0.0).view(hq, nqc, bq, -1))
    return torch.stack(outs, 2)


def ladder_errors_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_dense: torch.Tensor,
                           scores: torch.Tensor, ladder: list[float], config: SaleSelectionConfig, *,
                           scale: float | None = None, chunk_elems: int | None = None) -> torch.Tensor:
    """``Err`` of every head at every ladder tau from per-key-block softmax partials: ``[K, Hq]`` float32.

    Exactly the block-sparse attention of :func:`block_sparse_attention` (same kept blocks, exact softmax
    over them), computed once for all thresholds and all heads: per query row the scores against its
    causal keys, ``p = exp(s - M)`` with ``M`` the row's max over all of them, and per key block ``j`` the
    partials ``l_j = sum p`` and ``u_j = sum p v``; a threshold keeps a set ``J`` of blocks (the same for
    every row of a query block) and ``O~ = sum_J u_j / sum_J l_j``: one matmul of the 0/1 keep matrix
    ``[K, NK]`` with the partials per (head, query block). Exact as long as the kept mass ``sum_J l_j`` does
    not underflow; rows where it falls below ``sqrt(tiny)`` of the compute dtype (the kept blocks' max more
    than ~40 (float32) below the row max, where float32 ``exp`` would lose them) are recomputed by SDPA over
    the kept elements with their own max (:func:`_ladder_chunk_exact`). Cost: one dense attention plus
    ``K / block_k`` of one, instead of ``K`` block-sparse attentions. Rows go in chunks of whole query
    blocks with about ``chunk_elems`` scores for all heads (default ``2**24``, ``2**28`` on CUDA), each
    against only the keys its last row can see.
    ``q: [Hq, N, D]``, ``k, v: [Hkv, N, D]``, ``o_dense: [Hq, N, Dv]``, ``scores: [Hq, NQ, NK]`` block scores.
    """
    hq, n, d = q.shape
    hkv, dv, bq, bk = k.shape[0], v.shape[-1], config.block_q, config.block_k
    chunk_elems = chunk_elems or (1 << 28 if q.is_cuda else 1 << 24)
    scale = d ** -0.5 if scale is None else float(scale)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    safe = torch.finfo(cdt).tiny ** 0.5
    log_taus = _ladder_log_taus(ladder, scores.dtype, q.device)  # [K]
    nq, nk = -(-n // bq), -(-n // bk)
    err = torch.zeros(len(ladder), hq, dtype=torch.float64, device=q.device)
    qg = q.to(cdt).view(hkv, hq // hkv, n, d)
    k_pad = torch.nn.functional.pad(k.to(cdt), (0, 0, 0, nk * bk - n))  # [Hkv, NK*bk, D]
    v_blk = torch.nn.functional.pad(v.to(cdt), (0, 0, 0, nk * bk - n)).view(hkv, nk, bk, dv)
    step = max(1, chunk_elems // max(1, hq * bq * nk * bk))  # query blocks per chunk
    for qb0 in range(0, nq, step):
        qb1 = min(nq, qb0 + step)
        r0, r1 = qb0 * bq, min(n, qb1 * bq)
        nkc = -(-r1 // bk)  # key blocks visible to the chunk's last row
        keep = (scores[None, :, qb0:qb1, :nkc] >= log_taus[:, None, None, None]).permute(1, 2, 0, 3).to(cdt)
        num, den = _ladder_chunk(qg, k_pad, v_blk, keep, r0, r1, bq, bk, scale)  # [Hq, nqc, K, bq(, Dv)]
        o = num / torch.where(den > 0, den, 1.0)[..., None]
        low = den < safe  # underflow, or no kept causal key (then 0, as the reference; never with sink/local)
        if bool(low.any()) and bool((low & _nonempty(keep, r0, n, bq, bk)).any()):
            exact = _ladder_chunk_exact(q.to(cdt), k.to(cdt), v.to(cdt), keep, r0, r1, n, bq, bk, scale)
            o = torch.where((den < safe)[..., None], exact, o)
        rows = (torch.arange(r0, r0 + (qb1 - qb0) * bq, device=q.device) < n).view(qb1 - qb0, 1, bq, 1)
        ref = torch.nn.functional.pad(o_dense[:, r0:r1].to(cdt), (0, 0, 0, (qb1 - qb0) * bq - (r1 - r0)))
        diff = (o - ref.view(hq, qb1 - qb0, 1, bq, dv)).abs() * rows  # [Hq, nqc, K, bq, Dv]
        err += diff.sum((1, 3, 4), dtype=torch.float64).T
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
