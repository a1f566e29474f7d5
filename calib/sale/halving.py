"""SALE per-head threshold calibration by tau-halving (Ji et al., arXiv:2505.24179, §3.3, App. B, F).

For every head at once: start at ``tau0``; at each step evaluate ``Err(tau) = ||O - O~||_1 / N`` on every
calibration sample; a head whose error is ``<= theta`` on all samples keeps that tau and stops; the
others halve. A tau ``<= tau_min`` (or one reached after ``max_steps`` halvings) becomes 0, i.e. dense,
and is final with its dense error. With ``tau0 = 0.008`` and ``tau_min = 1e-4`` the candidates are
0.008, 0.004, ..., 0.000125, then 0: at most 8 evaluations.

The math is separated from the model: ``halve_thresholds`` only needs ``errors_fn(tau[H]) -> err[S, H]``.
:func:`sale_errors_fn` builds one from a layer's captured (q, k, v) of each sample, estimating the
Selection-Pass block scores once per sample (they do not depend on tau), so each step only thresholds
them and runs block-sparse attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from runtime_kernels.blocksparse.api import block_sparse_attention
from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.sale.api import sale_block_scores
from runtime_kernels.sale.reference import SaleSelectionConfig, select_blocks

ErrorsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HalvingStep:
    """One evaluation: the tau vector tried, its errors, and the heads that stopped at it."""

    step: int
    tau: torch.Tensor  # [H] float32, finished heads hold their final tau
    err: torch.Tensor  # [S, H]
    accepted: torch.Tensor  # [H] bool, heads whose tau became final at this step


class HalvingResult(NamedTuple):
    tau: torch.Tensor  # [H] float32 final thresholds (0 = dense)
    err: torch.Tensor  # [S, H] errors at the final tau
    trace: list[HalvingStep]


def head_errors(o_dense: torch.Tensor, o_sparse: torch.Tensor) -> torch.Tensor:
    """``||O - O~||_1 / N`` per head: ``[..., H, N, d]`` x2 -> ``[..., H]`` float32 (L1 over all N*d
    entries, divided by N; accumulated in float64)."""
    if o_dense.shape != o_sparse.shape:
        raise ValueError(f"shapes differ: {tuple(o_dense.shape)} vs {tuple(o_sparse.shape)}")
    n = o_dense.shape[-2]
    diff = (o_dense.to(torch.float64) - o_sparse.to(torch.float64)).abs()
    return (diff.sum(dim=(-1, -2)) / n).to(torch.float32)


def halve_thresholds(
    errors_fn: ErrorsFn,
    *,
    theta: float,
    tau0: float | torch.Tensor = 0.008,
    num_heads: int | None = None,
    tau_min: float = 1e-4,
    max_steps: int | None = None,
) -> HalvingResult:
    """Per-head tau by halving, all heads evaluated at once per step.

    Args:
        errors_fn: ``tau: [H] float32 -> err: [S, H]`` (one row per calibration sample).
        theta: error bound; a head stops at the first tau with ``err <= theta`` on every sample.
        tau0: start, one float (needs ``num_heads``) or a ``[H]`` tensor.
        tau_min: a candidate ``<= tau_min`` becomes 0 (dense) and is final.
        max_steps: at most this many halvings; heads still above theta then go dense (0). None: no cap.

    Returns:
        ``(tau [H], err [S, H] at that tau, trace)``; ``trace`` lists every evaluation in order.
    """
    if isinstance(tau0, torch.Tensor):
        tau = tau0.detach().to(torch.float32).cpu().clone()
    else:
        if num_heads is None:
            raise ValueError("num_heads is required when tau0 is a float")
        tau = torch.full((num_heads,), float(tau0), dtype=torch.float32)
    if tau.dim() != 1 or bool((tau < 0).any()):
        raise ValueError(f"tau0 must be a non-negative [H] vector; got {tau}")
    done = torch.zeros_like(tau, dtype=torch.bool)
    final_err: torch.Tensor | None = None
    trace: list[HalvingStep] = []
    step = 0
    while True:
        capped = max_steps is not None and step >= max_steps
        tau = torch.where(~done & ((tau <= tau_min) | capped), torch.zeros_like(tau), tau)
        err = errors_fn(tau.clone()).detach().to(torch.float32).cpu()  # [S, H]
        if err.dim() != 2 or err.shape[1] != tau.numel():
            raise ValueError(f"errors_fn returned shape {tuple(err.shape)}, expected [S, {tau.numel()}]")
        final_err = torch.empty_like(err) if final_err is None else final_err
        accepted = ~done & ((err <= theta).all(dim=0) | (tau == 0))
        final_err[:, accepted] = err[:, accepted]
        done |= accepted
        trace.append(HalvingStep(step, tau.clone(), err, accepted))
        if bool(done.all()):
            return HalvingResult(tau, final_err, trace)
        tau = torch.where(done, tau, tau / 2)
        step += 1


def sale_errors_fn(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    config: SaleSelectionConfig = SaleSelectionConfig(),
    o_dense: Sequence[torch.Tensor] | None = None,
    scale: float | None = None,
) -> tuple[ErrorsFn, Callable[[torch.Tensor], torch.Tensor]]:
    """Errors and densities of one layer's heads as functions of tau.

    Args:
        samples: ``(q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, Dv])`` tuples of one layer; each batch
            row is one calibration sample (``S`` = total batch rows), lengths may differ between tuples.
        o_dense: per tuple the reference output ``[B, Hq, N, Dv]`` (e.g. the model's); default: the
            block-sparse attention with every causal block (so tau = 0 has error exactly 0).

    Returns:
        ``errors_fn(tau [Hq]) -> [S, Hq]`` and ``density_fn(tau [Hq]) -> [S, Hq]`` (kept / causal blocks).
        The Selection-Pass block scores are computed once here and kept (``[B, Hq, NQ, NK]`` per tuple).
    """
    scores = [sale_block_scores(q, k, config=config, scale=scale) for q, k, _ in samples]  # [B, Hq, NQ, NK] each

    def mask_for(i: int, tau: torch.Tensor) -> BlockMask:
        q, k, _ = samples[i]
        return select_blocks(scores[i], tau.to(q.device), seq_q=q.shape[2], seq_k=k.shape[2],
                             block_q=config.block_q, block_k=config.block_k)

    if o_dense is None:
        o_dense = [block_sparse_attention(q, k, v, mask_for(i, torch.zeros(q.shape[1])), scale=scale)
                   for i, (q, k, v) in enumerate(samples)]

    def errors_fn(tau: torch.Tensor) -> torch.Tensor:
        rows = []
        for i, (q, k, v) in enumerate(samples):
            o = block_sparse_attention(q, k, v, mask_for(i, tau), scale=scale)
            rows.append(head_errors(o_dense[i], o).cpu())  # [B, Hq]: each batch row is a sample
        return torch.cat(rows)

    def density_fn(tau: torch.Tensor) -> torch.Tensor:
        return torch.cat([mask_for(i, tau).density().cpu() for i in range(len(samples))])

    return errors_fn, density_fn
