"""RoPE with the model's own rotary embedding, and its exact inverse (de-RoPE).

Queries and keys of Llama/Qwen-style models are rotated per position: for a head vector ``x: [D]``
at position ``p``, ``post = x * cos(p) + rotate_half(x) * sin(p)``, where ``cos/sin: [D]`` come from
the model's rotary module (``model.model.rotary_emb``). That module already folds in the model's RoPE
variant: Llama-3's frequency rescaling lives in its ``inv_freq`` buffer, and YaRN-style variants
multiply cos/sin by ``attention_scaling``. Taking cos/sin from that module (never re-deriving them
from config numbers) is what makes de-RoPE exact for every variant transformers implements.

De-RoPE itself is the runtime's (:mod:`runtime_kernels.rope`): calibration and decoding invert the
rotation with the same function, so the centroids and classifiers calibrated here see the vectors
the runtime will feed them.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime_kernels.rope import derope as _runtime_derope
from runtime_kernels.rope import rotate_half


def rotary_module(model: nn.Module) -> nn.Module:
    """The model's rotary-embedding module (``model.model.rotary_emb`` for HF Llama/Qwen2)."""
    base = getattr(model, "base_model", model)
    for owner in (base, model):
        module = getattr(owner, "rotary_emb", None)
        if isinstance(module, nn.Module):
            return module
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    raise ValueError(f"{type(model).__name__} has no rotary_emb module: not a RoPE model")


@torch.no_grad()
def rotary_cos_sin(model: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for ``positions`` from the model's own rotary module, in float32.

    positions: [T] integer positions. Returns ``(cos, sin)``, each [T, D] float32 on the rotary
    module's device, attention_scaling included (exactly what the model's forward multiplies by,
    before it casts them to the activation dtype).
    """
    rotary = rotary_module(model)
    device = rotary.inv_freq.device
    probe = torch.empty(0, dtype=torch.float32, device=device)  # only its dtype/device are read
    cos, sin = rotary(probe, positions.to(device=device, dtype=torch.long)[None])  # [1, T, D]
    return cos[0], sin[0]


def cos_sin_from_inv_freq(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin from a saved ``inv_freq`` buffer, computed as HF's rotary forward does (float32).

    positions: [...]; inv_freq: [D/2]. Returns cos, sin: [..., D] float32. Used to rebuild post-RoPE
    tensors from a collected set without the model (the set stores the module's ``inv_freq``).
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [..., T, D]`` by ``cos/sin: [T, D]`` (broadcast over leading dims).

    Computed in ``x``'s dtype with cos/sin cast to it, the same arithmetic as HF's
    ``apply_rotary_pos_emb``, so a bf16 pre-RoPE tensor rotates to the bf16 values the model made.
    """
    cos = cos.to(device=x.device, dtype=x.dtype)
    sin = sin.to(device=x.device, dtype=x.dtype)
    return x * cos + rotate_half(x) * sin


def derope(x_post: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Exact inverse of :func:`apply_rope`: ``x_post: [..., T, D]``, ``cos/sin: [T, D]`` (broadcast).

    :func:`runtime_kernels.rope.derope` (float32 arithmetic, float64 for float64 input; it divides by
    ``cos² + sin²`` = attention_scaling², so scaled variants invert too), in ``dtype`` (default: ``x_post``'s).
    """
    return _runtime_derope(x_post, cos, sin, dtype or x_post.dtype)
