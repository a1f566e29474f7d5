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


@triton.jit
def query_rows(x_ptr, rows, c, sx_b, sx_h, G: tl.constexpr):
    """Row pointers of classifier ``c``'s batch: its row ``r = b·G + g`` is query head ``c·G + g`` of batch
    row ``b`` of ``x [B, Hc·G, D]`` (:func:`reference.classifier_rows`; ``G = 1``: one classifier per
    query head, rows are batch rows)."""
    return x_ptr + (rows // G).to(tl.int64) * sx_b + (c * G + rows % G) * sx_h


@triton.jit
def load_query(row_ptrs, r_ok, kk, k_ok, sx_k, rot_ptr, rows, K, G: tl.constexpr, ROPE: tl.constexpr,
               DTYPE: tl.constexpr):
    """The classifier input at columns ``kk`` of the rows at ``row_ptrs`` (:func:`query_rows`). ``ROPE``:
    those rows hold the RoPE'd query, de-RoPE'd here with the batch row's coefficients ``rot [B, 2, K]``
    float32 (:func:`runtime_kernels.rope.derope_coefficients`: ``x[i]·a[i] + x[(i + K/2) mod K]·s[i]``)
    and rounded to ``DTYPE`` (the weights'), as :func:`reference.classifier_input`; else loaded as is."""
    ok = r_ok[:, None] & k_ok[None, :]
    x = tl.load(row_ptrs[:, None] + kk[None, :] * sx_k, mask=ok, other=0.0)
    if ROPE:
        partner = (kk + K // 2) % K
        x2 = tl.load(row_ptrs[:, None] + partner[None, :] * sx_k, mask=ok, other=0.0)
        coef = rot_ptr + (rows // G).to(tl.int64)[:, None] * (2 * K) + kk[None, :]
        a = tl.load(coef, mask=ok, other=0.0)
        s = tl.load(coef + K, mask=ok, other=0.0)
        x = round_to(x.to(tl.float32) * a + x2.to(tl.float32) * s, DTYPE)
    return x


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` in ``DTYPE``, rounded to nearest even as torch's ``.to`` rounds: for bfloat16 on the
    bits (the interpreter's own cast truncates; on the GPU this is the same rounding), else a cast."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def logit_rows(out_ptr, rows, c, n_classifiers, N, G: tl.constexpr):
    """Row pointers into ``out [B, Hc·G, N]`` of classifier ``c``'s batch rows (the layout of
    :func:`query_rows`, i.e. :func:`reference.query_head_logits`)."""
    return out_ptr + (((rows // G).to(tl.int64) * n_classifiers + c) * G + rows % G) * N
