"""Synthetic SAAP inputs for the calib tests: Llama-style RoPE and a prompt with long-range structure.

Independent of calib.rope on purpose (that module is another helper's; these tests only need some
exact rotation and its inverse).
"""

from __future__ import annotations

import torch


def rope_cos_sin(t: int, d: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, D]`` (HF Llama layout: the two halves share frequencies)."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., T, D]`` -> RoPE'd (float32)."""
    return (x.double() * cos + _rotate_half(x.double()) * sin).float()


def derope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse rotation of :func:`rope`."""
    return (x.double() * cos - _rotate_half(x.double()) * sin).float()


def synthetic_prompt(t: int = 1024, hkv: int = 2, group: int = 4, d: int = 32, clusters: int = 16,
                     retrieval: float = 0.6, seed: int = 0) -> dict[str, torch.Tensor]:
    """One prompt whose queries retrieve far-back keys.

    Pre-RoPE keys come from ``clusters`` centres placed in the lowest-frequency RoPE dims (so the
    RoPE'd dot product still reflects them across ~1000 tokens); key 0 is a large sink. A fraction
    ``retrieval`` of the queries point (strongly) at the centre of a random earlier key's cluster,
    the rest are noise. Returns q/k pre and post RoPE ([H, T, D]) and v.
    """
    g = torch.Generator().manual_seed(seed)
    half = d // 2
    low = torch.zeros(d, dtype=torch.bool)
    low[half - 4:half] = True
    low[d - 4:d] = True  # the 8 lowest-frequency dims
    centres = torch.zeros(hkv, clusters, d)
    centres[..., low] = torch.randn(hkv, clusters, int(low.sum()), generator=g) * 2.0
    which = torch.randint(clusters, (hkv, t), generator=g)
    k_pre = centres.gather(1, which.unsqueeze(-1).expand(-1, -1, d)) + 0.3 * torch.randn(hkv, t, d, generator=g)
    k_pre[:, 0] = 4.0
    hq = hkv * group
    q_pre = 0.3 * torch.randn(hq, t, d, generator=g)
    kv_of = torch.arange(hq) // group
    for h in range(hq):
        pos = torch.nonzero(torch.rand(t, generator=g) < retrieval).flatten()
        pos = pos[pos > 300]
        src = (torch.rand(pos.numel(), generator=g) * (pos - 200).float()).long() + 1  # a key >= 200 back
        q_pre[h, pos] += 2.5 * centres[kv_of[h], which[kv_of[h], src]]
    cos, sin = rope_cos_sin(t, d)
    return {"q_pre": q_pre, "k_pre": k_pre, "q_rope": rope(q_pre, cos, sin), "k_rope": rope(k_pre, cos, sin),
            "v": torch.randn(hkv, t, d, generator=g), "cos": cos, "sin": sin}
