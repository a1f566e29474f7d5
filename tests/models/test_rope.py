"""RoPE from the model's own rotary module, and de-RoPE as its exact inverse."""

from __future__ import annotations

import math

import pytest
import torch

from calib.models import random_model
from calib.rope import apply_rope, cos_sin_from_inv_freq, derope, rotary_cos_sin, rotary_module
from tests.models.helpers import LLAMA_ARCH, QWEN2_ARCH

FAR = torch.tensor([0, 1, 8191, 8192, 8193, 12000, 16383])  # around and beyond Llama-3's original 8k


def llama3_inv_freq_float64(head_dim: int, theta: float, factor: float, low: float, high: float,
                            original: int) -> torch.Tensor:
    """Llama-3 frequency rescaling, written from the Llama 3 paper's recipe (float64, independent)."""
    inv = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_scaling_comes_from_the_model_rotary_module():
    model = random_model("llama", {**LLAMA_ARCH, "head_dim": 128, "hidden_size": 512})
    cos, sin = rotary_cos_sin(model, FAR)  # [T, 128]
    s = LLAMA_ARCH["rope_scaling"]
    inv = llama3_inv_freq_float64(128, LLAMA_ARCH["rope_theta"], s["factor"], s["low_freq_factor"],
                                  s["high_freq_factor"], s["original_max_position_embeddings"])
    angle = FAR.double()[:, None] * torch.cat([inv, inv])[None]  # [T, 128]
    # float32 angles at position 16k carry ~1e-3 rad of rounding; plain RoPE would be off by O(1)
    assert torch.allclose(cos.double(), angle.cos(), atol=3e-3)
    assert torch.allclose(sin.double(), angle.sin(), atol=3e-3)
    plain = 1.0 / LLAMA_ARCH["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    assert not torch.allclose(rotary_module(model).inv_freq.double(), plain)


@pytest.mark.parametrize("family,arch", [("llama", LLAMA_ARCH), ("qwen2", QWEN2_ARCH)], ids=["llama3", "qwen2"])
def test_derope_inverts_apply_rope(family, arch):
    model = random_model(family, arch)
    positions = torch.arange(arch["max_position_embeddings"] - 300, arch["max_position_embeddings"])
    cos, sin = rotary_cos_sin(model, positions)
    x = torch.randn(3, positions.numel(), arch["head_dim"])
    post = apply_rope(x, cos, sin)
    assert not torch.allclose(post, x)
    assert torch.allclose(derope(post, cos, sin), x, atol=1e-5, rtol=1e-5)
    # a rotation keeps each head vector's norm
    assert torch.allclose(post.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_derope_handles_attention_scaling():
    """YaRN multiplies cos/sin by attention_scaling != 1: de-RoPE must divide it out."""
    arch = {**LLAMA_ARCH, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
    model = random_model("llama", arch)
    scale = rotary_module(model).attention_scaling
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    positions = torch.tensor([5, 4095, 9000, 16000])
    cos, sin = rotary_cos_sin(model, positions)
    x = torch.randn(2, 4, arch["head_dim"])
    post = apply_rope(x, cos, sin)
    assert torch.allclose(post.norm(dim=-1), scale * x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(derope(post, cos, sin), x, atol=1e-5)


def test_cos_sin_from_saved_inv_freq_matches_module():
    model = random_model("llama", LLAMA_ARCH)
    rot = rotary_module(model)
    cos, sin = rotary_cos_sin(model, FAR)
    cos2, sin2 = cos_sin_from_inv_freq(FAR, rot.inv_freq, rot.attention_scaling)
    assert torch.equal(cos, cos2) and torch.equal(sin, sin2)


def test_apply_rope_bf16_matches_hf_arithmetic():
    """apply_rope in bf16 reproduces transformers' own apply_rotary_pos_emb bit for bit."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = random_model("llama", LLAMA_ARCH)
    cos, sin = rotary_cos_sin(model, FAR)
    q = torch.randn(1, 4, FAR.numel(), 16).bfloat16()
    hf_q, _ = apply_rotary_pos_emb(q, q, cos.bfloat16()[None], sin.bfloat16()[None])
    assert torch.equal(apply_rope(q, cos, sin), hf_q)


@pytest.mark.parametrize("family,arch", [("llama", LLAMA_ARCH), ("qwen2", QWEN2_ARCH)], ids=["llama3", "qwen2"])
def test_calibration_and_runtime_derope_are_identical(family, arch):
    """Calibration (``calib.rope``) and SAAP's decode runtime de-RoPE the same keys to the same bits: one
    implementation (``runtime_kernels.rope``), fed the model's cos/sin by either side."""
    from runtime_kernels.saap.api import AttentionPositions, SaapDecode

    model = random_model(family, arch)
    positions = torch.arange(100, 164)
    k = torch.randn(arch["num_kv_heads"], positions.numel(), arch["head_dim"]).bfloat16()  # [Hkv, T, D]
    cos, sin = rotary_cos_sin(model, positions)
    calib_side = derope(k, cos, sin, torch.float32)
    runtime_side = SaapDecode([], top_l=1)._derope(k[None], AttentionPositions(rotary_module(model)), 100)[0]
    assert runtime_side.dtype == torch.float32 and torch.equal(calib_side, runtime_side)
