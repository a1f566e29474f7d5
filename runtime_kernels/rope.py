"""De-RoPE: the exact inverse of a model's rotary position embedding (HF convention), in one place.

Llama/Qwen-style models rotate each query and key head vector ``x [D]`` at position ``p`` as
``post = x·c + rotate_half(x)·n``, where ``c = s·cos(p·θ)`` and ``n = s·sin(p·θ)`` come from the model's
rotary module (``s``: its ``attention_scaling``, 1 for plain and Llama-3 RoPE) and the two halves of ``D``
share frequencies. Since ``rotate_half`` squared is ``-1``, ``post·c − rotate_half(post)·n = (c² + n²)·x``:
de-RoPE is ``x = (post·c − rotate_half(post)·n) / (c² + n²)``, exact for every RoPE variant as long as
cos/sin are the model's own (its module folds in frequency rescaling and ``s``).

SAAP clusters and classifies de-RoPE'd keys and queries. The runtime de-RoPEs keys with :func:`derope`,
which calibration (``calib.rope``) calls too, so both see the same key vectors; the decode query goes
through :func:`derope_coefficients` (the same formula, one position per batch row, applied by SAAP's
classifier kernel as it loads the query), equal to float32 rounding before its cast to the weights' dtype.
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


def derope_coefficients(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """De-RoPE at one position per batch row as two vectors: ``cos, sin [B, D]`` -> ``[B, 2, D]`` float32
    ``(a, s)`` with ``derope(x)[i] = x[i]·a[i] + x[(i + D/2) mod D]·s[i]`` for any ``x [..., D]`` of row ``b``.

    From :func:`derope`: ``a = c / r`` and ``s = ±n / r`` (``r = c² + n²``; ``+`` on the first half, where
    ``−rotate_half`` brings ``x[i + D/2]``, ``−`` on the second). Two multiply-adds per element, which a
    kernel can apply as it loads the RoPE'd query (SAAP's classifier does, :func:`derope_at` otherwise).
    """
    c, n = cos.float(), sin.float()
    den = c * c + n * n
    s = n / den
    s[..., c.shape[-1] // 2:].neg_()
    return torch.stack((c / den, s), dim=-2)


def derope_at(x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """:func:`derope` of ``x [B, H, D]`` (one position per batch row) from :func:`derope_coefficients`'
    ``[B, 2, D]``, in float32."""
    post = x.float()
    a, s = coefficients[:, None, 0], coefficients[:, None, 1]
    return post * a + torch.roll(post, -(x.shape[-1] // 2), dims=-1) * s
