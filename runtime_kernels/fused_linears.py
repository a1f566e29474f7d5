"""Sibling projections that read the same input as one GEMM: a layer's query, key and value projections,
and its MLP's gate and up projections.

A decode step multiplies a few rows by every weight matrix, so each GEMM costs its weight bytes plus a
fixed part (a launch, a split-K reduction, a tail of idle SMs) that a small matrix cannot hide: an 8B
model's key and value projections are 8 MB each. Concatenating the siblings' weights turns three (two)
GEMMs into one that reads the same bytes.

:func:`fuse_projections` rewrites a model in place, without copying its weights: each sibling's weight
becomes a view of the concatenated matrix and the sibling a :class:`FusedPart`, an ``nn.Module`` with the
same ``weight`` / ``bias`` (so ``state_dict`` keys, hooks on the projection and anything that reads its
weight see what they saw) whose forward is its slice of the group's one GEMM. The model's own forward is
untouched: it still calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``; the first call computes the group's
output and the next ones, given the same ``x`` (by identity), return their slices of it. Any other call
order or input recomputes, so the result is always each projection of its own input, provided the input is
not modified in place between the siblings' calls (no transformers model does; a version-counter check
would break torch.compile's graph).

Each output element is the same dot product as before, summed in whatever order the GEMM picks for the
wider matrix, so outputs can differ from the unfused ones by the dtype's rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """The concatenated ``weight [Σ out, in]`` (and ``bias``) of sibling projections, and the last input's
    output split per sibling (held from the first sibling's call to the last one's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] | None = None

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s projection of ``x``: a slice of the group's GEMM on ``x``, computed at the
        first sibling's call and kept until the last sibling's (the same ``x`` object in between)."""
        if self._outputs is None or self._input is not x:
            self._outputs = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
            self._input = x
        out = self._outputs[index]
        if index == len(self.sizes) - 1:  # the last sibling: nothing left to hand out
            self._input = self._outputs = None
        return out


class FusedPart(nn.Module):
    """One sibling of a :class:`FusedGroup`: the projection ``x @ weightᵀ + bias`` as a slice of the group's
    GEMM. ``weight`` and ``bias`` are views of the group's tensors."""

    def __init__(self, linear: nn.Linear, group: FusedGroup, index: int, start: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        stop = start + linear.out_features
        self.weight = nn.Parameter(group.weight[start:stop], requires_grad=linear.weight.requires_grad)
        self.register_parameter("bias", None if group.bias is None else
                                nn.Parameter(group.bias[start:stop], requires_grad=linear.bias.requires_grad))
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group.weight
        if self.weight.device != g.device or self.weight.dtype != g.dtype:
            # moved or cast since fusing (``model.to``): the weight is no longer a view of the group's
            return F.linear(x, self.weight, self.bias)
        return self.group.part(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fused"


def _fusable(linears: list[Any]) -> bool:
    """Plain ``nn.Linear`` siblings (none missing) of one input size, dtype and device, all with a bias or none."""
    if not all(type(m) is nn.Linear for m in linears):
        return False
    first = linears[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in linears)


def _fuse(owner: nn.Module, names: tuple[str, ...]) -> None:
    linears = [getattr(owner, n) for n in names]
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    group = FusedGroup(weight, bias, [m.out_features for m in linears])
    start = 0
    for index, (name, linear) in enumerate(zip(names, linears)):
        setattr(owner, name, FusedPart(linear, group, index, start))
        start += linear.out_features


def fuse_projections(model: nn.Module) -> int:
    """Fuse every module's sibling projections (:data:`SIBLINGS`: plain ``nn.Linear`` of one input size,
    dtype and device) in place; returns the number of groups fused. Idempotent: fused siblings are no
    longer ``nn.Linear`` and are left alone."""
    fused = 0
    for owner in list(model.modules()):
        for names in SIBLINGS:
            if _fusable([getattr(owner, n, None) for n in names]):
                _fuse(owner, names)
                fused += 1
    return fused
