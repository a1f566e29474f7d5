"""SAAP query classifiers: 2-layer MLPs, one per query head or one per KV head (``group`` query heads
sharing it, the paper's batched search: arXiv:2502.08246, §5), all of a layer as batched weights.

``f_q(q) = W2 · relu(BN(W1 q + b1)) + b2`` -> ``C`` logits (Mazaré et al., arXiv:2502.08246, §6.1: hidden 1024,
batch-norm, ReLU), input the de-RoPE'd query, trained with ``KL(target ‖ softmax f_q(q))`` (Eq. 1) and
Adam. Heads are independent: the loss is the *sum* over heads of each head's batch-mean KL, so head
``h``'s gradient is exactly what training it alone would give, and Adam is element-wise, so one
optimizer step over the batched tensors equals ``Hq`` separate trainings (tested).

Batch-norm is ``F.batch_norm`` over the ``Hq·Hd`` channels of the concatenated hidden layers, i.e.
one ``nn.BatchNorm1d(Hd)`` per head over that head's batch, in one call of PyTorch's fused kernel.
Training mode normalizes with the batch statistics and updates the running ones (momentum 0.1, unbiased variance); eval mode, and the
runtime's :func:`runtime_kernels.saap.classify_queries`, use the running statistics.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from runtime_kernels.saap.reference import SaapLayerParams


class BatchedQueryClassifier(nn.Module):
    """``Hq`` MLPs ``D -> Hd -> C`` evaluated at once: ``x [Hq, N, D]`` -> logits ``[Hq, N, C]``."""

    def __init__(self, heads: int, dim: int, clusters: int, hidden: int = 1024, *, seeds: list[int] | None = None,
                 bn_momentum: float = 0.1, bn_eps: float = 1e-5) -> None:
        super().__init__()
        seeds = list(range(heads)) if seeds is None else list(seeds)
        if len(seeds) != heads:
            raise ValueError(f"{len(seeds)} seeds for {heads} heads")
        self.bn_momentum, self.bn_eps = bn_momentum, bn_eps
        w1, b1, w2, b2 = zip(*(self._init_head(dim, hidden, clusters, s) for s in seeds))
        self.w1 = nn.Parameter(torch.stack(w1))  # [Hq, D, Hd]
        self.b1 = nn.Parameter(torch.stack(b1))  # [Hq, Hd]
        self.w2 = nn.Parameter(torch.stack(w2))  # [Hq, Hd, C]
        self.b2 = nn.Parameter(torch.stack(b2))  # [Hq, C]
        self.bn_weight = nn.Parameter(torch.ones(heads, hidden))
        self.bn_bias = nn.Parameter(torch.zeros(heads, hidden))
        self.register_buffer("bn_mean", torch.zeros(heads, hidden))
        self.register_buffer("bn_var", torch.ones(heads, hidden))

    @staticmethod
    def _init_head(dim: int, hidden: int, clusters: int, seed: int) -> tuple[torch.Tensor, ...]:
        """nn.Linear's default init (U(±1/√fan_in) for weight and bias), from the head's own seed."""
        g = torch.Generator().manual_seed(seed)

        def u(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
            return (torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(fan_in)

        return u((dim, hidden), dim), u((hidden,), dim), u((hidden, clusters), hidden), u((clusters,), hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hq, n, _ = x.shape
        h = torch.baddbmm(self.b1.unsqueeze(1), x, self.w1)  # [Hq, N, Hd]
        hd = h.shape[-1]
        # BatchNorm1d over Hq·Hd channels (= one BN per head): PyTorch's fused kernel, running stats in place
        h = F.batch_norm(h.transpose(0, 1).reshape(n, hq * hd), self.bn_mean.view(-1), self.bn_var.view(-1),
                         self.bn_weight.view(-1), self.bn_bias.view(-1), self.training, self.bn_momentum,
                         self.bn_eps)  # [N, Hq*Hd]
        h = torch.relu(h).view(n, hq, hd).transpose(0, 1)  # [Hq, N, Hd]
        return torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)  # [Hq, N, C]

    def export_params(self) -> dict[str, torch.Tensor]:
        """Float32 CPU tensors named as :class:`SaapLayerParams` fields (``bn_eps`` is a float)."""
        t = {n: getattr(self, n).detach().float().cpu().contiguous()
             for n in ("w1", "b1", "bn_mean", "bn_var", "bn_weight", "bn_bias", "w2", "b2")}
        return t

    def layer_params(self, centroids: torch.Tensor, *, sink: int, recent: int) -> SaapLayerParams:
        """The runtime's per-layer record: these classifiers plus the layer's ``centroids [Hkv, C, D]``."""
        return SaapLayerParams(sink=sink, recent=recent, centroids=centroids.float().cpu().contiguous(),
                               bn_eps=self.bn_eps, **self.export_params())


def kl_loss_per_head(logits: torch.Tensor, targets: torch.Tensor,
                     target_neg_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-mean ``KL(target ‖ softmax(logits))`` per head: ``[Hq, N, C]`` x2 -> ``[Hq]``.

    ``KL = Σ t·log t − Σ t·log q``; the first term does not depend on the logits, so a training loop
    passes it precomputed per row (``target_neg_entropy [Hq, N]``, :func:`target_neg_entropy`) and each
    step computes only the cross term (``xlogy`` over ``[Hq, N, C]`` is a slow CPU kernel).
    """
    if target_neg_entropy is None:
        return F.kl_div(F.log_softmax(logits, -1), targets, reduction="none").sum(-1).mean(-1)
    return (target_neg_entropy - (targets * F.log_softmax(logits, -1)).sum(-1)).mean(-1)


def target_neg_entropy(targets: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """``Σ_c t·log t`` per row (0·log 0 = 0): ``[Hq, N, C]`` -> ``[Hq, N]`` float32, ``chunk`` rows at a time."""
    return torch.cat([torch.xlogy(t, t).sum(-1) for t in targets.float().split(chunk, 1)], 1)


def _prompt_rows(prompt_index: torch.Tensor | None) -> list[torch.Tensor] | None:
    """Row indices of each prompt, in ascending prompt order (None: batches are drawn over all rows)."""
    if prompt_index is None:
        return None
    return [torch.nonzero(prompt_index == p).flatten() for p in torch.unique(prompt_index)]


def _batch_rows(step_gen: torch.Generator, n: int, batch: int,
                prompt_rows: list[torch.Tensor] | torch.Tensor | None) -> torch.Tensor:
    """Rows of one batch: uniform over all rows, or (``prompt_rows``: each prompt's rows, or the
    ``[N]`` prompt index they come from) from one random prompt."""
    if isinstance(prompt_rows, torch.Tensor):
        prompt_rows = _prompt_rows(prompt_rows)
    if prompt_rows is None:
        return torch.randint(n, (min(batch, n),), generator=step_gen)
    rows = prompt_rows[int(torch.randint(len(prompt_rows), (1,), generator=step_gen))]
    pick = torch.randperm(rows.numel(), generator=step_gen)[:batch]
    return rows[pick]


def fit_query_classifiers(x: torch.Tensor, targets: torch.Tensor, *, hidden: int = 1024, lr: float = 1e-3,
                          steps: int = 1000, batch: int = 256, seed: int = 0, head_seeds: list[int] | None = None,
                          group: int = 1,
                          prompt_index: torch.Tensor | None = None, device: str | torch.device | None = None,
                          progress: bool = True, desc: str = "SAAP classifiers",
                          on_step: Callable[[int, torch.Tensor], None] | None = None, bar: Any = None,
                          ) -> tuple[BatchedQueryClassifier, torch.Tensor]:
    """Train every classifier of a layer at once.

    Args:
        x: ``[Hq, N, D]`` de-RoPE'd queries (row ``n`` of every head comes from the same prompt).
        targets: ``[Hq, N, C]`` rows of ``A·H_k`` (:func:`calib.saap.targets.kl_targets`).
        hidden, lr, steps, batch: MLP width, Adam learning rate, optimizer steps, rows per step.
        seed: draws the batches (shared by all heads); ``head_seeds`` (default ``seed + c``) initialize
            classifier ``c``, so training a subset of them alone reproduces the batched result.
        group: query heads per classifier: 1 (one per query head) or ``Hq / Hkv`` (one per KV head, trained
            on the ``batch`` rows of each of its query heads: query heads ``c·group .. c·group + group - 1``).
        prompt_index: ``[N]`` prompt of each row; given, each batch comes from one prompt (the paper).
        device: where to train (default: ``x.device``).
        on_step: called as ``on_step(step, loss_per_head [Hq])`` after every step (for tracking).
        bar: a tqdm bar to advance by one per step (a stage's bar over several layers); without one,
            ``progress`` opens a bar of its own.

    Returns:
        ``(classifier in eval mode on CPU, loss curve [steps, Hq / group] float32)``.
    """
    hq, n, d = x.shape
    if targets.shape[:2] != (hq, n):
        raise ValueError(f"targets {tuple(targets.shape)} do not match queries {tuple(x.shape)}")
    if group < 1 or hq % group:
        raise ValueError(f"group must divide the {hq} query heads, got {group}")
    hc, c = hq // group, targets.shape[2]
    device = x.device if device is None else torch.device(device)
    seeds = [seed + h for h in range(hc)] if head_seeds is None else head_seeds
    model = BatchedQueryClassifier(hc, d, c, hidden, seeds=seeds).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    curve = torch.empty(steps, hc)
    own_bar = bar is None
    bar = _progress(steps, desc, progress) if own_bar else bar
    prompt_rows = _prompt_rows(prompt_index)
    neg_entropy = target_neg_entropy(targets)  # [Hq, N]: the loss's constant term, once per row
    for step in range(steps):
        rows = _batch_rows(gen, n, batch, prompt_rows)
        # [Hq, b, ·] -> [Hc, group·b, ·]: a classifier's batch is the rows of each of its query heads
        xb = x[:, rows].to(device, torch.float32).reshape(hc, -1, d)
        tb = targets[:, rows].to(device, torch.float32).reshape(hc, -1, c)
        loss = kl_loss_per_head(model(xb), tb, neg_entropy[:, rows].to(device).reshape(hc, -1))  # [Hc]
        opt.zero_grad(set_to_none=True)
        loss.sum().backward()  # sum: each head's gradient is its own loss's gradient
        opt.step()
        curve[step] = loss.detach().cpu()
        if bar is not None:
            bar.update(1)
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(kl=f"{curve[step].mean().item():.4f}")
        if on_step is not None:
            on_step(step, curve[step])
    if bar is not None and own_bar:
        bar.close()
    return model.cpu().eval(), curve


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    return tqdm(total=total, desc=desc, leave=False)
