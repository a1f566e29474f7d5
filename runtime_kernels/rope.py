"""De-RoPE: the exact inverse of a model's rotary position embedding (HF convention), in one place.

Llama/Qwen-style models rotate each query and key head vector ``x [D]`` at position ``p`` as
``post = x·c + rotate_half(x)·n``, where ``c = s·cos(p·θ)`` and ``n = s·sin(p·θ)`` come from the model's
rotary module (``s``: its ``attention_scaling``, 1 for plain and Llama-3 RoPE) and the two halves of ``D``
share frequencies. Since ``rotate_half`` squared is ``-1``, ``post·c − rotate_half(post)·n = (c² + n²)·x``:
de-RoPE is ``x = (post·c − rotate_half(post)·n) / (c² + n²)``, exact for every RoPE variant as long as
cos/sin are the model's own (its module folds in frequency rescaling and ``s``).

SAAP clusters and classifies de-RoPE'd keys and queries. The runtime de-RoPEs while it decodes and the
calibration (``calib.rope``) calls these same functions, so both see the same vectors.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (HF's convention: halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def derope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """Pre-RoPE vectors of ``x [..., T, D]`` (post-RoPE), ``cos, sin`` broadcastable to ``x``: ``[T, D]``,
    or HF's ``[B, T, D]`` against ``x [B, H, T, D]`` passed as ``cos[:, None]``.

    Computed in float32 (float64 for a float64 ``x``); returns ``dtype``, by default the compute dtype.
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    post = x.to(work)
    c = cos.to(device=post.device, dtype=work)
    n = sin.to(device=post.device, dtype=work)
    pre = (post * c - rotate_half(post) * n) / (c * c + n * n)
    return pre if dtype is None else pre.to(dtype)


_HALF: dict[tuple[int, str], torch.Tensor] = {}


def _rotate_half_matrix(d: int, device: torch.device) -> torch.Tensor:
    """``R [D, D]`` float32 with ``rotate_half(x) = x @ R`` (cached per device: built once, never in a graph)."""
    key = (d, str(device))
    if key not in _HALF:
        i = torch.arange(d // 2)
        half = torch.zeros(d, d)
        half[i + d // 2, i] = -1.0
        half[i, i + d // 2] = 1.0
        _HALF[key] = half.to(device)
    return _HALF[key]


def derope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """De-RoPE at one position per batch row as a linear map: ``cos, sin [B, D]`` -> ``M [B, D, D]``
    float32 with ``derope(x) = x @ M[b]`` for any ``x [..., D]`` of row ``b``.

    ``M = diag(c / r) − R·diag(n / r)`` with ``r = c² + n²`` and ``R`` the matrix of :func:`rotate_half`:
    one batched matmul per use instead of a dozen element-wise kernels (SAAP de-RoPEs every layer's
    decode query at the same position).
    """
    c, n = cos.float(), sin.float()
    den = c * c + n * n
    return torch.diag_embed(c / den) - _rotate_half_matrix(c.shape[-1], c.device)[None] * (n / den)[:, None, :]
