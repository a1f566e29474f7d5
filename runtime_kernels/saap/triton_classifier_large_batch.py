"""SAAP's query classifier for larger batches (``B > CONFIG.small_batch_max_b``): two tensor-core launches
of :func:`_mlp_layer_kernel`, one per layer, each program a (query head, ``linear_block_n`` output
columns, 16 batch rows) tile. The float32 activations enter each dot as four stacked 16-bit terms
(:func:`_split4`; exact products, float32 logits); layer 1 writes the hidden split the same way for
layer 2. Four terms cost little here: 64 rows is the smallest wgmma M anyway.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.saap.triton_classifier_large_batch needs the 'triton' package",
                              name="triton") from exc

from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.reference import SaapLayerParams
from runtime_kernels.saap.triton_classifier_common import bn_relu, dot, weight_terms
from runtime_kernels.saap.triton_config import ROWS as _ROWS
from runtime_kernels.saap.triton_config import buffer as _buffer

patch_interpreter()


@triton.jit
def _split4(x, dtype: tl.constexpr):
    """``x`` (fp32) as four terms of a 16-bit ``dtype``, ``x = t0 + t1 + t2 + t3`` to fp32 precision."""
    t0 = x.to(dtype)
    r = x - t0.to(tl.float32)
    t1 = r.to(dtype)
    r = r - t1.to(tl.float32)
    t2 = r.to(dtype)
    t3 = (r - t2.to(tl.float32)).to(dtype)
    return t0, t1, t2, t3


@triton.jit
def _mlp_layer_kernel(
    x_ptr, w_ptr, bias_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, out_ptr,
    n_rows, K, N, eps, sx_b, sx_h, sx_k, sw_h, sw_k, sw_n,
    FIRST: tl.constexpr, TERMS: tl.constexpr, OUT_TERMS: tl.constexpr, F32: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One classifier layer of query head ``h`` for 16 batch rows: ``y = x @ w[h] + bias[h]``.

    The float32 activations enter the dot as ``TERMS`` stacked terms of the weights' dtype (4 for bf16 /
    fp16 weights: rows ``t·16 + i`` hold term ``t`` of batch row ``i``; every product is exact in fp32, the
    four row groups are summed after the loop), or as float32 (``TERMS = 1``, fp32 weights, tf32x3 dots).

    ``FIRST`` (layer 1): x is the query ``[B, H, K]`` (strides ``sx_*``, any float dtype), split here;
    ``y`` gets eval batch-norm + ReLU and is stored split into ``OUT_TERMS`` terms of ``out``'s dtype,
    ``out [H, RB, 16·OUT_TERMS, N]`` (RB = cdiv(B, 16)). Else (layer 2): x is that split hidden buffer
    ``[H, RB, 16·TERMS, K]`` and ``y`` (the logits) goes to ``out [B, H, N]`` float32.
    w: [H, K, N]; bias / mean / var / gamma / beta: [H, N] contiguous. Grid: (H, cdiv(N, BLOCK_N), RB).
    """
    ROWS: tl.constexpr = 16 * TERMS
    h = tl.program_id(0)
    n_heads = tl.num_programs(0)
    rb = tl.program_id(2)
    n_rb = tl.num_programs(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    w_head = w_ptr + h.to(tl.int64) * sw_h + offs_n[None, :] * sw_n
    if FIRST:
        bat = rb * 16 + offs_r % 16
        term = offs_r // 16
        x_rows = x_ptr + bat.to(tl.int64)[:, None] * sx_b + h * sx_h
        x_ok = bat < n_rows
    else:
        x_rows = x_ptr + ((h * n_rb + rb).to(tl.int64) * ROWS + offs_r)[:, None] * K
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_head + kk[:, None] * sw_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FIRST:
            x = tl.load(x_rows + kk[None, :] * sx_k, mask=x_ok[:, None] & k_ok[None, :], other=0.0)
            x = x.to(tl.float32)
            if TERMS == 4:
                t0, t1, t2, t3 = _split4(x, w.dtype)
                t = term[:, None]
                x = tl.where(t == 0, t0, tl.where(t == 1, t1, tl.where(t == 2, t2, t3)))
        else:
            x = tl.load(x_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
        acc += dot(x, w, F32, TERMS)
    if TERMS == 4:
        y = tl.sum(tl.reshape(acc, [4, 16, BLOCK_N]), 0)  # [16, BLOCK_N]
    else:
        y = acc
    vec = h * N + offs_n
    y += tl.load(bias_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs_i = tl.arange(0, 16)
    if FIRST:
        y = bn_relu(y, vec, n_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps)
        OUT_ROWS: tl.constexpr = 16 * OUT_TERMS
        out = out_ptr + ((h * n_rb + rb).to(tl.int64) * OUT_ROWS + offs_i)[:, None] * N + offs_n[None, :]
        if OUT_TERMS == 4:
            t0, t1, t2, t3 = _split4(y, out_ptr.dtype.element_ty)
            tl.store(out, t0, mask=n_ok[None, :])
            tl.store(out + 16 * N, t1, mask=n_ok[None, :])
            tl.store(out + 32 * N, t2, mask=n_ok[None, :])
            tl.store(out + 48 * N, t3, mask=n_ok[None, :])
        else:
            tl.store(out, y, mask=n_ok[None, :])
    else:
        bat = rb * 16 + offs_i
        out = out_ptr + (bat.to(tl.int64)[:, None] * n_heads + h) * N + offs_n[None, :]
        tl.store(out, y, mask=(bat < n_rows)[:, None] & n_ok[None, :])


def _mlp_layer(x: torch.Tensor, w: torch.Tensor, vecs: tuple[torch.Tensor, ...], out: torch.Tensor, n_rows: int,
               eps: float, first: bool, out_terms: int) -> None:
    """Launch :func:`_mlp_layer_kernel` for every query head (``w [H, K, N]``) and 16-row batch block."""
    hq, k, n = w.shape
    cfg = _tc.CONFIG
    sx = x.stride() if first else (0, 0, 0)
    grid = (hq, triton.cdiv(n, cfg.linear_block_n), triton.cdiv(n_rows, _ROWS))
    _mlp_layer_kernel[grid](
        x, w, *(t.contiguous() for t in vecs), out, n_rows, k, n, float(eps), *sx, *w.stride(),
        FIRST=first, TERMS=weight_terms(w), OUT_TERMS=out_terms, F32=_interpreting(),
        BLOCK_K=cfg.linear_block_k, BLOCK_N=cfg.linear_block_n,
        num_warps=cfg.linear_warps, num_stages=cfg.linear_stages,
    )


def large_batch_logits(q_derope: torch.Tensor, p: SaapLayerParams) -> torch.Tensor:
    """Classifier logits ``[B, Hq, C]`` float32 of ``q_derope [B, Hq, D]``: layer 1 then layer 2, the hidden
    ``[Hq, cdiv(B, 16), 16·T, Hd]`` (T terms of w2's dtype, or float32 for float32 w2) between them."""
    b, hq, _ = q_derope.shape
    hd, c = p.w2.shape[1], p.w2.shape[2]
    logits = _buffer((b, hq, c), torch.float32, q_derope.device)
    terms2 = weight_terms(p.w2)
    hidden = _buffer((hq, triton.cdiv(b, _ROWS), _ROWS * terms2, hd),
                     p.w2.dtype if terms2 == 4 else torch.float32, q_derope.device)
    _mlp_layer(q_derope, p.w1, (p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias), hidden, b, p.bn_eps,
               True, terms2)
    _mlp_layer(hidden, p.w2, (p.b2,) * 5, logits, b, 0.0, False, 1)
    return logits
