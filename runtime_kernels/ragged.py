"""Ragged batches: which rows prefill together, and a prefill method on a padded call, each row as alone.

The static loop (:mod:`runtime_kernels.generate`) prefills rows of close lengths in one call
(:func:`ragged_runs`), the shorter rows padded after their last token. Dense causal attention is exact on
such a batch; a sparse prefill method is not (its block selection would see the padding in a row's last
query block, its statistics would count it), so a runtime that declares ``ragged_prefill = True`` runs its
attention on each row's own positions (rows of one length in one call) while the model's other layers run
the batch at once.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

RAGGED_PAD_SHARE = 16  # a ragged prefill call pads its rows by at most 1/16 of its longest row
PrefillFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], "torch.Tensor | None"]


def padded_rows(ctx: object, q: torch.Tensor) -> list[int] | None:
    """Each row's own token count when ``ctx`` says the call's rows are padded (``ctx.lengths``), else None."""
    lengths = getattr(ctx, "lengths", None)
    return lengths if lengths is not None and any(n != q.shape[2] for n in lengths) else None


def rows_alone(prefill: PrefillFn, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               lengths: Sequence[int]) -> torch.Tensor:
    """``prefill(layer, q, k, v, scale)`` on each row's first ``lengths[b]`` positions (None from it: dense
    causal attention), zeros in the padding: ``[B, Hq, T, Dv]``. Rows of one length share a call (fewer
    launches): both methods select blocks per (row, head), so a row's result is its own."""
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    by_length: dict[int, list[int]] = {}
    for b, n in enumerate(lengths):
        by_length.setdefault(int(n), []).append(b)
    for n, rows in by_length.items():
        idx = torch.tensor(rows, device=q.device)
        qb, kb, vb = (t.index_select(0, idx)[:, :, :n] for t in (q, k, v))
        got = prefill(layer, qb, kb, vb, scale)
        if got is None:
            got = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        out[rows, :, :n] = got.to(out.dtype)
    return out


def ragged_runs(lengths: Sequence[int], alone: bool = False) -> list[list[int]]:
    """The prefill calls of a ragged batch, each a list of row indices: rows taken shortest first, a run
    growing while its longest row is at most 1/:data:`RAGGED_PAD_SHARE` longer than its shortest (the
    shorter rows padded to it), or one row each (``alone``)."""
    runs: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if runs and not alone and lengths[row] - lengths[runs[-1][0]] <= lengths[row] // RAGGED_PAD_SHARE:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def batch_rows(run: list[int]) -> slice | list[int]:
    """``run`` as a slice where its rows are adjacent and ascending (the cache's views), else the list."""
    return slice(run[0], run[-1] + 1) if run == list(range(run[0], run[-1] + 1)) else run
