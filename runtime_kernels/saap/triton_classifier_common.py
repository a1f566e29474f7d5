"""Triton helpers both SAAP classifier paths share: the dot at the classifier's precision and the
eval-mode batch-norm + ReLU of layer 1's epilogue, plus the weights' dtype check.

The ranking must equal the reference's (a flipped bucket moves the attention output by far more than
the kernel's tolerance), so the logits must carry float32 precision although the weights and the tensor
cores take 16-bit operands: float32 activations enter the dots as several stacked 16-bit terms whose
products with 16-bit weights are exact in the fp32 accumulator, and the terms are summed afterwards.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.saap.triton_classifier_common needs the 'triton' package",
                              name="triton") from exc

from runtime_kernels._triton_support import patch_interpreter

patch_interpreter()


def weight_terms(w: torch.Tensor) -> int:
    """Stacked 16-bit terms per float32 activation in a dot with ``w``: 4 for bf16 / fp16 weights, 1 (a
    plain float32 operand) for float32 weights."""
    if w.dtype in (torch.bfloat16, torch.float16):
        return 4
    if w.dtype == torch.float32:
        return 1
    raise TypeError(f"SAAP classifier weights must be bf16, fp16 or float32, got {w.dtype}")


@triton.jit
def dot(x, w, F32: tl.constexpr, TERMS: tl.constexpr):
    """``x @ w`` at the classifier's precision: ``F32`` (the interpreter, whose 16-bit ``tl.dot`` is
    wrong) in IEEE fp32; 16-bit operands (``TERMS == 4``, exact products) on tensor cores; float32
    operands in ``tf32x3``."""
    if F32:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    elif TERMS == 4:
        return tl.dot(x, w)
    else:
        return tl.dot(x, w, input_precision="tf32x3")


@triton.jit
def bn_vectors(vec, ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr):
    """The eval batch-norm's running mean, variance, scale and shift at columns ``vec`` (float32)."""
    mean = tl.load(mean_ptr + vec, mask=ok, other=0.0).to(tl.float32)
    var = tl.load(var_ptr + vec, mask=ok, other=1.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + vec, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + vec, mask=ok, other=0.0).to(tl.float32)
    return mean, var, gamma, beta


@triton.jit
def bn_apply_relu(y, mean, var, gamma, beta, eps):
    """``relu(batch_norm(y))`` over the last axis of ``y`` with the vectors of :func:`bn_vectors`."""
    inv = 1.0 / tl.sqrt(var + eps)
    return tl.maximum((y - mean[None, :]) * (inv * gamma)[None, :] + beta[None, :], 0.0)


@triton.jit
def bn_relu(y, vec, ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps):
    """``relu(batch_norm(y))`` in eval mode over the last axis (columns ``vec``; ``ok`` masks them); ``y``
    has its bias already added. float32."""
    mean, var, gamma, beta = bn_vectors(vec, ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr)
    return bn_apply_relu(y, mean, var, gamma, beta, eps)
