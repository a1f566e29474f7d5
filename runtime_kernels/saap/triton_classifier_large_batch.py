"""SAAP's query classifier for larger batches (``B·G > CONFIG.small_batch_max_b`` rows): two tensor-core
launches of :func:`_mlp_layer_kernel`, one per layer, each program a (classifier, ``linear_block_n`` output
columns, 16 batch rows) tile; rows and the fused de-RoPE as in
:mod:`~runtime_kernels.saap.triton_classifier_small_batch`. The float32 activations enter each dot as
four stacked 16-bit terms (:func:`_split4`; exact products, float32 logits); layer 1 writes the hidden
split the same way for layer 2. Four terms cost little here: 64 rows is the smallest wgmma M anyway.
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
from runtime_kernels.saap.triton_classifier_common import bn_relu, dot, load_query, logit_rows, query_rows, weight_terms
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
    x_ptr, rot_ptr, w_ptr, bias_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, out_ptr,
    n_rows, K, N, eps, sx_b, sx_h, sx_k, sw_h, sw_k, sw_n,
    FIRST: tl.constexpr, TERMS: tl.constexpr, OUT_TERMS: tl.constexpr, F32: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, ROPE: tl.constexpr,
):
    """One layer of classifier ``h`` for 16 of its batch rows (R = B·G rows, :func:`query_rows`):
    ``y = x @ w[h] + bias[h]``.

    The float32 activations enter the dot as ``TERMS`` stacked terms of the weights' dtype (4 for bf16 /
    fp16 weights: rows ``t·16 + i`` hold term ``t`` of batch row ``i``; every product is exact in fp32, the
    four row groups are summed after the loop), or as float32 (``TERMS = 1``, fp32 weights, tf32x3 dots).

    ``FIRST`` (layer 1): x is the query ``[B, H·G, K]`` (strides ``sx_*``, any float dtype; RoPE'd and
    de-RoPE'd on load with ``rot`` when ``ROPE``, :func:`load_query`), split here;
    ``y`` gets eval batch-norm + ReLU and is stored split into ``OUT_TERMS`` terms of ``out``'s dtype,
    ``out [H, RB, 16·OUT_TERMS, N]`` (RB = cdiv(B, 16)). Else (layer 2): x is that split hidden buffer
    ``[H, RB, 16·TERMS, K]`` and ``y`` (the logits) goes to ``out [B, H·G, N]`` float32 (:func:`logit_rows`).
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
        x_rows = query_rows(x_ptr, bat, h, sx_b, sx_h, G)
        x_ok = bat < n_rows
    else:
        x_rows = x_ptr + ((h * n_rb + rb).to(tl.int64) * ROWS + offs_r)[:, None] * K
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_head + kk[:, None] * sw_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FIRST:
            x = load_query(x_rows, x_ok, kk, k_ok, sx_k, rot_ptr, bat, K, G, ROPE, w_ptr.dtype.element_ty).to(tl.float32)
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
        out = logit_rows(out_ptr, bat, h, n_heads, N, G)[:, None] + offs_n[None, :]
        tl.store(out, y, mask=(bat < n_rows)[:, None] & n_ok[None, :])


def _mlp_layer(x: torch.Tensor, rot: torch.Tensor | None, w: torch.Tensor, vecs: tuple[torch.Tensor, ...],
               out: torch.Tensor, n_rows: int, eps: float, first: bool, out_terms: int, g: int) -> None:
    """Launch :func:`_mlp_layer_kernel` for every classifier (``w [Hc, K, N]``) and 16-row block of its
    ``n_rows`` rows."""
    hc, k, n = w.shape
    cfg = _tc.CONFIG
    sx = x.stride() if first else (0, 0, 0)
    grid = (hc, triton.cdiv(n, cfg.linear_block_n), triton.cdiv(n_rows, _ROWS))
    _mlp_layer_kernel[grid](
        x, x if rot is None else rot, w, *(t.contiguous() for t in vecs), out, n_rows, k, n, float(eps), *sx,
        *w.stride(), FIRST=first, TERMS=weight_terms(w), OUT_TERMS=out_terms, F32=_interpreting(),
        BLOCK_K=cfg.linear_block_k, BLOCK_N=cfg.linear_block_n, G=g, ROPE=rot is not None,
        num_warps=cfg.linear_warps, num_stages=cfg.linear_stages,
    )


def large_batch_logits(x: torch.Tensor, p: SaapLayerParams, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier logits ``[B, Hq, C]`` float32 of ``x [B, Hq, D]`` (the de-RoPE'd query, or the RoPE'd one
    with its coefficients ``rotation [B, 2, D]``): layer 1 then layer 2, the hidden
    ``[Hc, cdiv(R, 16), 16·T, Hd]`` (R = B·G rows, T terms of w2's dtype, or float32 for float32 w2) between."""
    b, hq, _ = x.shape
    hc, hd, c = p.w2.shape
    g = hq // hc
    n_rows = b * g
    logits = _buffer((b, hq, c), torch.float32, x.device)
    terms2 = weight_terms(p.w2)
    hidden = _buffer((hc, triton.cdiv(n_rows, _ROWS), _ROWS * terms2, hd),
                     p.w2.dtype if terms2 == 4 else torch.float32, x.device)
    rot = None if rotation is None else rotation.contiguous()
    _mlp_layer(x, rot, p.w1, (p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias), hidden, n_rows, p.bn_eps,
               True, terms2, g)
    _mlp_layer(hidden, None, p.w2, (p.b2,) * 5, logits, n_rows, 0.0, False, 1, g)
    return logits
