"""Memory accounting for collection: peak readings, working-set estimates and the GPU hard cap."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def peak_host_rss_bytes() -> int:
    """The process's peak resident set size so far (bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_gpu_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gpu_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def model_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def forward_bytes(config: Any, tokens: int, batch: int, dtype: torch.dtype, attn_impl: str) -> int:
    """A generous estimate of one forward pass's live activations for ``batch`` prompts of ``tokens``.

    Per token: the residual stream and norms (~6 hidden), q/k/v pre and post RoPE plus the pre-RoPE
    copies the capture keeps alive (~3x (Hq + 2 Hkv) D), the MLP (3 intermediate); ``eager``
    attention also materializes a float32 [Hq, T, T] score matrix.
    """
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 6 * config.hidden_size + 3 * (heads + 2 * kv) * head_dim + 3 * config.intermediate_size
    total = batch * tokens * per_token * torch.finfo(dtype).bits // 8
    if attn_impl == "eager":
        total += batch * heads * tokens * tokens * 4
    return int(total)


@contextmanager
def gpu_memory_cap(device: torch.device, max_bytes: int | None) -> Iterator[None]:
    """Make the caching allocator refuse allocations beyond ``max_bytes`` on ``device`` (a hard cap).

    Exceeding it raises ``torch.OutOfMemoryError``. The fraction is reset to 1.0 on exit.
    """
    if device.type != "cuda" or max_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
