"""De-RoPE (runtime_kernels.rope) against rotations written out by hand, and the runtime's two paths."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.rope import derope, derope_at, derope_coefficients, rotate_half


def _hf_cos_sin(positions: torch.Tensor, d: int, theta: float = 10000.0, scaling: float = 1.0):
    """cos, sin ``[..., D]`` float64 in HF's layout (the two halves share frequencies), times ``scaling``."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[..., None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rope_by_hand_d4(x: torch.Tensor, angles: tuple[float, float], scaling: float = 1.0) -> torch.Tensor:
    """RoPE of one ``x [4]`` written out: dims (0, 2) turn by ``angles[0]``, (1, 3) by ``angles[1]``."""
    out = torch.empty(4, dtype=torch.float64)
    for i, a in enumerate(angles):
        u, w = float(x[i]), float(x[i + 2])
        out[i] = scaling * (u * math.cos(a) - w * math.sin(a))
        out[i + 2] = scaling * (w * math.cos(a) + u * math.sin(a))
    return out


@pytest.mark.parametrize("scaling", [1.0, 1.1386], ids=["plain", "yarn-scaled"])
def test_derope_inverts_a_hand_written_rotation_d4(scaling):
    """D = 4, float64: de-RoPE of a rotation written out pair by pair gives ``x`` back, and de-RoPE of any
    vector is the inverse rotation divided by the scaling."""
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 1000, 40000])
    cos, sin = _hf_cos_sin(positions, 4, scaling=scaling)  # [T, 4]
    x = torch.randn(3, len(positions), 4, generator=g, dtype=torch.float64)  # [H, T, D]
    angles = [(float(p), float(p) * 10000.0 ** -0.5) for p in positions]
    post = torch.stack([torch.stack([_rope_by_hand_d4(x[h, t], angles[t], scaling) for t in range(len(positions))])
                        for h in range(3)])
    back = derope(post, cos, sin)
    assert back.dtype == torch.float64
    torch.testing.assert_close(back, x, atol=1e-12, rtol=0)
    y = torch.randn(len(positions), 4, generator=g, dtype=torch.float64)
    inverse = torch.stack([_rope_by_hand_d4(y[t], (-angles[t][0], -angles[t][1])) / scaling
                           for t in range(len(positions))])
    torch.testing.assert_close(derope(y, cos, sin), inverse, atol=1e-12, rtol=0)


def test_rotate_half_and_dtypes():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert rotate_half(x).tolist() == [-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]
    cos, sin = _hf_cos_sin(torch.arange(5), 8)
    xb = torch.randn(2, 5, 8).bfloat16()
    assert derope(xb, cos, sin).dtype == torch.float32  # 16-bit input: float32 arithmetic and result
    assert derope(xb, cos, sin, torch.bfloat16).dtype == torch.bfloat16
    # float32 arithmetic on the float32 values of the input and of cos/sin, whatever their dtypes
    want = derope(xb.float(), cos.float(), sin.float())
    assert torch.equal(derope(xb, cos, sin), want)


def test_derope_coefficients_are_derope_at_one_position():
    """``derope_at(x, derope_coefficients(cos, sin))`` is :func:`derope` of ``x`` at row ``b``'s position."""
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([3, 517, 9000])  # one position per batch row
    cos, sin = _hf_cos_sin(positions, 16, scaling=1.2)  # [B, D]
    coef = derope_coefficients(cos.float(), sin.float())
    assert coef.shape == (3, 2, 16) and coef.dtype == torch.float32
    q = torch.randn(3, 5, 16, generator=g)  # [B, Hq, D]
    want = derope(q.double(), cos[:, None], sin[:, None])  # float64
    got = derope_at(q.bfloat16(), coef)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), derope(q.bfloat16().double(), cos[:, None], sin[:, None]),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(derope_at(q, coef).double(), want, atol=1e-5, rtol=1e-5)


def test_derope_coefficients_undo_a_rotation_by_hand():
    """D = 4 at one position: the coefficients undo :func:`_rope_by_hand_d4`'s rotation (scaled by 0.8)."""
    angles = (0.7, -2.1)
    cos = torch.tensor([[math.cos(angles[0]), math.cos(angles[1])] * 2]) * 0.8  # HF layout: halves share
    sin = torch.tensor([[math.sin(angles[0]), math.sin(angles[1])] * 2]) * 0.8
    x = torch.tensor([0.5, -1.25, 2.0, 3.5], dtype=torch.float64)
    post = _rope_by_hand_d4(x, angles, scaling=0.8)
    got = derope_at(post.float()[None, None], derope_coefficients(cos, sin))[0, 0]
    torch.testing.assert_close(got.double(), x, atol=1e-6, rtol=1e-6)


def test_saap_runtime_paths_agree_with_derope():
    """SAAP de-RoPEs keys element-wise (``_derope``) and the decode query from one step's coefficients
    (``_query_rotation``): both are :func:`derope` of the model's own cos/sin."""
    pytest.importorskip("transformers")
    from runtime_kernels.saap.api import AttentionPositions, SaapDecode
    from tests.runtime.small_models import small_llama

    rotary = small_llama().model.rotary_emb
    rt = SaapDecode([], top_l=1)
    ctx = AttentionPositions(rotary)
    k = torch.randn(2, 2, 6, 16).bfloat16()  # [B, Hkv, T, D] at positions 40 .. 45
    cos, sin = rotary(torch.empty(0), torch.arange(40, 46)[None])  # [1, T, D]
    assert torch.equal(rt._derope(k, ctx, 40), derope(k, cos[:, None], sin[:, None]))
    q = torch.randn(2, 4, 1, 16).bfloat16()  # [B, Hq, 1, D] at position 45
    want = derope(q, cos[:, None, -1:], sin[:, None, -1:])[:, :, 0]
    torch.testing.assert_close(derope_at(q[:, :, 0], rt._query_rotation(1, q, ctx, 45)), want, atol=1e-5, rtol=1e-5)
