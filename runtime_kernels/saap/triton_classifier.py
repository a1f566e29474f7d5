"""SAAP's per-step bucket ranking in Triton: the query classifier MLP and the top-ℓ over its group
sums (papers/saap.txt §4, App. F), on the GPU without a host sync. Used by :mod:`runtime_kernels.saap.triton`
(whose docstring has the whole decode step and its performance model); tile sizes and switches live in
:data:`runtime_kernels.saap.triton_config.CONFIG`.

1. Classifier. ``CONFIG.cls_fused = 1``: :func:`_mlp_fused_kernel`, the classifier MLP of every query head (``q_derope @ w1 + b1``, batch-norm in
eval mode, ReLU; then ``@ w2 + b2``) in one launch: one program per (query head, 64 hidden units,
16 batch rows) computes its hidden slice and that slice's share of all C logits (split-K over the
hidden dimension: 512 programs of 144 KB at Llama shapes, no hidden round trip); the last program of a
head to finish (an arrival counter) sums the partial logits in a fixed order (deterministic). The
ranking must equal the reference's (a flipped bucket moves the output by far more than 2e-2), so the
float32 activations enter the dots as four stacked bf16/fp16 terms (``x = t0 + t1 + t2 + t3``, rows
``t·16 + i``; each product exact in fp32, the four row groups summed after the dot): logits to ~1e-7
relative at bf16 tensor-core speed. Four terms cost nothing for B ≤ 16: 64 rows is the smallest wgmma
M anyway, and the tensor work (4.3 GFLOP, ~6 µs) hides under the 75 MB weight stream. float32 weights
use ``tf32x3`` dots instead. (fp16 weights: hidden activations above 65504 would overflow the split; not
a realistic range after batch-norm.) ``CONFIG.cls_fused = 0``: the first version's two launches of
:func:`_mlp_layer_kernel` (one per layer, hidden written split for layer 2).
2. :func:`_rank_kernel`: one program per (batch, KV head): softmax of each query head's logits, sum over
the ``G`` heads of the group, top-ℓ by a bitonic ``tl.topk`` over ``score bits << 32 | ~bucket`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.saap.triton_classifier needs the 'triton' package",
                              name="triton") from exc

from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels.saap.reference import SaapLayerParams
from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.triton_config import ROWS as _ROWS, buffer as _buffer, pow2 as _pow2

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
def _split3(x, dtype: tl.constexpr):
    """``x`` (fp32) as three terms of a 16-bit ``dtype``: ``x - (t0 + t1 + t2)`` is below fp32's last bit
    for bf16 (8 + 8 + 8 significant bits), so products with 16-bit weights summed in fp32 keep the
    float32 classifier's precision."""
    t0 = x.to(dtype)
    r = x - t0.to(tl.float32)
    t1 = r.to(dtype)
    t2 = (r - t1.to(tl.float32)).to(dtype)
    return t0, t1, t2


@triton.jit
def _dot(x, w, F32: tl.constexpr, TERMS: tl.constexpr):
    """``x @ w`` at the classifier's precision: float32 weights in ieee fp32; 16-bit weights with four
    stacked activation terms (exact products) on tensor cores; else ``tf32x3``."""
    if F32:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    elif TERMS == 4:
        return tl.dot(x, w)
    else:
        return tl.dot(x, w, input_precision="tf32x3")


@triton.jit
def _bn_vectors(vec, ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr):
    """The eval batch-norm's running mean, variance, scale and shift at columns ``vec`` (float32)."""
    mean = tl.load(mean_ptr + vec, mask=ok, other=0.0).to(tl.float32)
    var = tl.load(var_ptr + vec, mask=ok, other=1.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + vec, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + vec, mask=ok, other=0.0).to(tl.float32)
    return mean, var, gamma, beta


@triton.jit
def _bn_apply_relu(y, mean, var, gamma, beta, eps):
    inv = 1.0 / tl.sqrt(var + eps)
    return tl.maximum((y - mean[None, :]) * (inv * gamma)[None, :] + beta[None, :], 0.0)


@triton.jit
def _bn_relu(y, vec, ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps):
    """``relu(batch_norm(y))`` in eval mode over the last axis (columns ``vec``; ``ok`` masks them); y has
    its bias already added. float32."""
    mean, var, gamma, beta = _bn_vectors(vec, ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr)
    return _bn_apply_relu(y, mean, var, gamma, beta, eps)


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
        acc += _dot(x, w, F32, TERMS)
    if TERMS == 4:
        y = tl.sum(tl.reshape(acc, [4, 16, BLOCK_N]), 0)  # [16, BLOCK_N]
    else:
        y = acc
    vec = h * N + offs_n
    y += tl.load(bias_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs_i = tl.arange(0, 16)
    if FIRST:
        y = _bn_relu(y, vec, n_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps)
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


@triton.jit
def _mlp_fused_kernel(
    x_ptr, w1_ptr, b1_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, w2_ptr, b2_ptr, part_ptr, cnt_ptr, out_ptr,
    n_rows, n_heads, K, HD, N, n_chunk, n_split, eps, sx_b, sx_h, sx_k, s1_h, s1_k, s1_n, s2_h, s2_k, s2_n,
    TERMS: tl.constexpr, F32: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, N_SPLIT: tl.constexpr,
):
    """Both classifier layers of query head ``h`` for hidden units ``[s·BLOCK_H, (s+1)·BLOCK_H)``, logit
    columns ``[ns·n_chunk, (ns+1)·n_chunk)`` and 16 batch rows (grid: (H, n_split, RB · N_SPLIT), program
    axis 2 = ``rb · N_SPLIT + ns``).

    Layer 1 (``K = D`` inputs): ``hid = relu(bn(x @ w1[h, :, slice] + b1))`` [16, BLOCK_H], exact in fp32
    (x as ``TERMS`` stacked bf16/fp16 terms, see :func:`_mlp_layer_kernel`); layer 2: its ``TERMS``-term
    split times ``w2[h, slice, cols]`` -> ``part[s, b, h, cols]`` (float32 partial logits). The program
    that increments ``cnt[(h · RB + rb) · N_SPLIT + ns]`` last sums the ``n_split`` partials in order
    ``s = 0, 1, ...``, adds ``b2`` and writes ``out [B, H, N]`` float32 (counters zeroed by the caller).
    """
    ROWS: tl.constexpr = 16 * TERMS
    h = tl.program_id(0)
    s = tl.program_id(1)
    rb = tl.program_id(2) // N_SPLIT
    ns = tl.program_id(2) % N_SPLIT
    offs_r = tl.arange(0, ROWS)
    offs_i = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    offs_h = s * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < HD
    bat_r = rb * 16 + offs_r % 16
    term = (offs_r // 16)[:, None]
    x_rows = x_ptr + bat_r.to(tl.int64)[:, None] * sx_b + h * sx_h
    w1_head = w1_ptr + h.to(tl.int64) * s1_h + offs_h[None, :] * s1_n
    acc1 = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w1_head + kk[:, None] * s1_k, mask=k_ok[:, None] & h_ok[None, :], other=0.0)
        x = tl.load(x_rows + kk[None, :] * sx_k, mask=(bat_r < n_rows)[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        if TERMS == 4:
            t0, t1, t2, t3 = _split4(x, w.dtype)
            x = tl.where(term == 0, t0, tl.where(term == 1, t1, tl.where(term == 2, t2, t3)))
        acc1 += _dot(x, w, F32, TERMS)
    vec = h * HD + offs_h
    bias1 = tl.load(b1_ptr + vec, mask=h_ok, other=0.0).to(tl.float32)
    if TERMS == 4:
        hid = tl.sum(tl.reshape(acc1, [4, 16, BLOCK_H]), 0) + bias1[None, :]  # [16, BLOCK_H]
        hid = _bn_relu(hid, vec, h_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps)
        hid = tl.where(h_ok[None, :], hid, 0.0)
        hid = tl.reshape(tl.broadcast_to(hid[None, :, :], [4, 16, BLOCK_H]), [ROWS, BLOCK_H])
        t0, t1, t2, t3 = _split4(hid, w2_ptr.dtype.element_ty)
        a = tl.where(term == 0, t0, tl.where(term == 1, t1, tl.where(term == 2, t2, t3)))
    else:
        hid = _bn_relu(acc1 + bias1[None, :], vec, h_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps)
        a = tl.where(h_ok[None, :], hid, 0.0)
    # layer 2: this hidden slice's share of the logit columns [n_lo, n_hi)
    bat = rb * 16 + offs_i
    b_ok = bat < n_rows
    n_lo = ns * n_chunk
    n_hi = tl.minimum(N, n_lo + n_chunk)
    w2_rows = w2_ptr + h.to(tl.int64) * s2_h + offs_h[:, None] * s2_k
    part_rows = part_ptr + ((s * n_rows + bat).to(tl.int64)[:, None] * n_heads + h) * N
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_hi
        w = tl.load(w2_rows + offs_n[None, :] * s2_n, mask=h_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(a, w, F32, TERMS)
        if TERMS == 4:
            y = tl.sum(tl.reshape(acc, [4, 16, BLOCK_N]), 0)
        else:
            y = acc
        tl.store(part_rows + offs_n[None, :], y, mask=b_ok[:, None] & n_ok[None, :])
    # the last program of this (head, rows, column range) reduces the n_split partials in a fixed order
    cnt = cnt_ptr + (h * tl.num_programs(2) + tl.program_id(2))
    done = tl.atomic_add(cnt, 1, sem="acq_rel")
    if done == n_split - 1:
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            ok = b_ok[:, None] & (offs_n < n_hi)[None, :]
            y = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            for sp in range(0, n_split):
                rows = ((sp * n_rows + bat).to(tl.int64)[:, None] * n_heads + h) * N
                y += tl.load(part_ptr + rows + offs_n[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            y += tl.load(b2_ptr + h * N + offs_n, mask=offs_n < n_hi, other=0.0).to(tl.float32)[None, :]
            out = out_ptr + (bat.to(tl.int64)[:, None] * n_heads + h) * N + offs_n[None, :]
            tl.store(out, y, mask=ok)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, out_ptr, init_ptr, init_bias_ptr,
    n_rows, n_heads, K, N, k_chunk, eps, n_init, sx_b, sx_h, sx_k, sw_h, sw_k, sw_n,
    FIRST: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr,
    OUT_TERMS: tl.constexpr = 0,
):
    """One classifier layer of query head ``h`` for ``n_rows <= R`` batch rows on CUDA cores (small-batch
    decode: a weight-streaming GEMV, no tensor-core padding to 64 rows).

    ``y[b, n] = Σ_k x[b, h, k] · w[h, k, n]`` over ``k ∈ [ks·k_chunk, min(K, (ks+1)·k_chunk))``, float32
    products and accumulation (the weights upcast; ~1e-7 relative, like the reference's float32 matmul).
    Products are accumulated per (row, k lane, column) and reduced over k once at the end.
    ``FIRST`` (layer 1, one k chunk): ``+ b1``, batch-norm (eval), ReLU -> ``out [B, H, N]`` float32, or
    with ``OUT_TERMS`` 1 / 3 (the cuBLAS layer 2, :func:`_bmm_partials`) ``out [H, OUT_TERMS, B, N]`` in
    out's dtype (3: the three 16-bit terms of :func:`_split3`; 1: float32 as is).
    Else (layer 2, split-K): the partial logits of chunk ``ks`` -> ``out [KS, B, H, N]`` float32; the
    ranking kernel sums the chunks in order and adds ``b2``.
    ``ATOMIC`` (``CONFIG.gemv_atomic``): layer 2 instead adds its chunk into ``out [B, H, N]`` with float32
    atomics (order of the chunk sums not fixed: logits vary in the last bits between calls), which
    layer 1 initialized to ``b2`` (``init_ptr [B, H, n_init]`` from ``init_bias_ptr [H, n_init]``, its
    programs striding over the columns); the ranking then reads one tensor.
    w: [H, K, N] (unit stride on N for coalesced rows); x: [B, H, K] (strides ``sx_*``).
    Grid: (H, cdiv(N, BLOCK_N), KS).
    """
    h = tl.program_id(0)
    ks = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    r_ok = offs_r < n_rows
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    w_head = w_ptr + h.to(tl.int64) * sw_h + offs_n[None, :] * sw_n
    x_rows = x_ptr + offs_r.to(tl.int64)[:, None] * sx_b + h * sx_h
    acc = tl.zeros([R, BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        w = tl.load(w_head + kk[:, None] * sw_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + kk[None, :] * sx_k, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += x[:, :, None] * w[None, :, :]
    y = tl.sum(acc, 1)  # [R, BLOCK_N]
    if FIRST:
        vec = h * N + offs_n
        bias = tl.load(bias_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)
        y = _bn_relu(y + bias[None, :], vec, n_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps)
        rows = offs_r.to(tl.int64)
        if OUT_TERMS > 0:  # [H, OUT_TERMS, B, N]: the rows of one head's bmm operand
            _store_terms(out_ptr, y, h, rows, r_ok, offs_n, n_ok, n_rows, N, OUT_TERMS)
        if ATOMIC:  # logits <- b2 for layer 2's atomics; this program's share of the columns
            stride = tl.num_programs(1) * BLOCK_N
            for c0 in range(tl.program_id(1) * BLOCK_N, n_init, stride):
                cc = c0 + tl.arange(0, BLOCK_N)
                c_ok = cc < n_init
                b2 = tl.load(init_bias_ptr + h * n_init + cc, mask=c_ok, other=0.0).to(tl.float32)
                dst = init_ptr + (rows[:, None] * n_heads + h) * n_init + cc[None, :]
                tl.store(dst, tl.broadcast_to(b2[None, :], [R, BLOCK_N]), mask=r_ok[:, None] & c_ok[None, :])
    else:
        rows = offs_r.to(tl.int64) if ATOMIC else ks.to(tl.int64) * n_rows + offs_r
    out = out_ptr + (rows[:, None] * n_heads + h) * N + offs_n[None, :]
    if ATOMIC and not FIRST:
        tl.atomic_add(out, y, mask=r_ok[:, None] & n_ok[None, :], sem="relaxed")
    elif OUT_TERMS == 0:
        tl.store(out, y, mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _store_terms(out_ptr, y, h, rows, r_ok, offs_n, n_ok, n_rows, N, OUT_TERMS: tl.constexpr):
    """Hidden ``y [R, BLOCK_N]`` (float32) of head h as the layer-2 ``bmm`` operand ``out [H, OUT_TERMS, B,
    N]``: three 16-bit terms of out's dtype (:func:`_split3`), or float32 as is (``OUT_TERMS = 1``)."""
    ok = r_ok[:, None] & n_ok[None, :]
    dst = out_ptr + ((h * OUT_TERMS).to(tl.int64) * n_rows + rows[:, None]) * N + offs_n[None, :]
    if OUT_TERMS == 3:
        t0, t1, t2 = _split3(y, out_ptr.dtype.element_ty)
        tl.store(dst, t0, mask=ok)
        tl.store(dst + n_rows * N, t1, mask=ok)
        tl.store(dst + 2 * n_rows * N, t2, mask=ok)
    else:
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _layer1_dot_kernel(
    x_ptr, w_ptr, bias_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, out_ptr,
    n_rows, K, N, eps, sx_b, sx_h, sx_k, sw_h, sw_k, sw_n,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, OUT_TERMS: tl.constexpr, F32: tl.constexpr,
):
    """Layer 1 of query head ``h`` (program 0) for ``BLOCK_N`` hidden units (program 1) and ``ROWS`` batch
    rows (program 2) on tensor cores, for a query of the weights' own 16-bit dtype: every bf16 / fp16
    product is exact in the fp32 accumulator, so this is the GEMV's float32 result up to summation order.
    Epilogue as :func:`_gemv_kernel`'s (``+ b1``, eval batch-norm, ReLU, the hidden stored as ``OUT_TERMS``
    terms). ``F32``: both operands in fp32, IEEE (the interpreter, whose 16-bit ``tl.dot`` is wrong)."""
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    r_ok = offs_r < n_rows
    x_rows = x_ptr + offs_r.to(tl.int64)[:, None] * sx_b + h * sx_h
    w_head = w_ptr + h.to(tl.int64) * sw_h + offs_n[None, :] * sw_n
    # the epilogue's vectors are requested with the first tiles, not after the dot (one dependent memory
    # round trip less: H200 2026-11-21 run 61, step 128k B=1 45.6 -> 44.8 us, 8k B=1 43.1 -> 41.9)
    vec = h * N + offs_n
    bias = tl.load(bias_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)
    mean, var, gamma, beta = _bn_vectors(vec, n_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :] * sx_k, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_head + kk[:, None] * sw_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += _dot(x, w, F32, 4)
    y = _bn_apply_relu(acc + bias[None, :], mean, var, gamma, beta, eps)
    _store_terms(out_ptr, y, h, offs_r.to(tl.int64), r_ok, offs_n, n_ok, n_rows, N, OUT_TERMS)


@triton.jit
def _layer2_kernel(
    h_ptr, w_ptr, b2_ptr, out_ptr, n_rows, n_q, K, N, sh_h, sh_r, sh_k, sw_h, sw_k, sw_n,
    BP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr, BIAS: tl.constexpr,
):
    """Layer 2 of query head ``h`` (program 0) for ``BLOCK_N`` logits (program 1) and ``BP`` batch rows
    (program 2) from the three-term hidden of :func:`_layer1_dot_kernel` / :func:`_gemv_kernel`
    (``h [Hq, 3·B, Hd]``, rows ``t·B + i``): the tile's row ``4·j + t`` holds term ``t`` of batch row
    ``j`` (row ``4·j + 3`` is zero), so one ``tl.dot`` per k step multiplies every term by the streamed
    ``w2 [BLOCK_K, BLOCK_N]`` tile (exact products, fp32 accumulation) and the epilogue sums each row's
    three terms: ``out [B, Hq, N]`` float32 = the cuBLAS path's three partials summed (to float32
    rounding). The w2 tiles are the whole cost: ``num_stages`` deep cp.async pipelines over
    ``Hq · N / BLOCK_N`` programs. ``F32``: operands in fp32, IEEE (the interpreter).

    ``BIAS`` (``CONFIG.l2_bias``): ``b2 [Hq, N]`` added in the epilogue, requested before the k loop, so
    its DRAM round trip hides under the stream instead of opening the ranking (the same float32 add).
    """
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 4 * BP)
    row_b = tl.program_id(2) * BP + offs_r // 4
    term = offs_r % 4
    r_ok = (term < 3) & (row_b < n_rows)
    n_ok = offs_n < N
    if BIAS:
        bias = tl.load(b2_ptr + h * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    x_rows = h_ptr + h.to(tl.int64) * sh_h + (term * n_rows + row_b).to(tl.int64) * sh_r
    w_head = w_ptr + h.to(tl.int64) * sw_h + offs_n[None, :] * sw_n
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([4 * BP, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_rows[:, None] + kk[None, :] * sh_k, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_head + kk[:, None] * sw_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += _dot(x, w, F32, 4)
    logits = tl.sum(tl.reshape(acc, [BP, 4, BLOCK_N]), axis=1)  # t0 + t1 + t2 (+ the zero row)
    if BIAS:
        logits += bias[None, :]
    rows = tl.program_id(2) * BP + tl.arange(0, BP)
    dst = out_ptr + (rows.to(tl.int64)[:, None] * n_q + h) * N + offs_n[None, :]
    tl.store(dst, logits, mask=(rows < n_rows)[:, None] & n_ok[None, :])


@triton.jit
def _rank_kernel(
    logits_ptr, bias_ptr, sel_ptr, scratch_ptr, n_kv, C, L, sl_b, sl_h, sl_c, sl_p,
    G: tl.constexpr, G_PAD: tl.constexpr, C_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PART: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAND: tl.constexpr, COUNT: tl.constexpr = False, N_CHUNK: tl.constexpr = 0,
    STOP: tl.constexpr = 0,
):
    """Top-ℓ buckets of one (batch, KV head) per program (:func:`_rank_row`). Grid: (B · Hkv,)."""
    pid = tl.program_id(0)
    _rank_row(logits_ptr, bias_ptr, sel_ptr, scratch_ptr, pid, pid // n_kv, pid % n_kv, C, L, sl_b, sl_h, sl_c,
              sl_p, G, G_PAD, C_PAD, K_PAD, N_PART, HAS_BIAS, CAND, COUNT, N_CHUNK, STOP)


@triton.jit
def _rank_row(
    logits_ptr, bias_ptr, sel_ptr, scratch_ptr, pid, b, h, C, L, sl_b, sl_h, sl_c, sl_p,
    G: tl.constexpr, G_PAD: tl.constexpr, C_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PART: tl.constexpr,
    HAS_BIAS: tl.constexpr, CAND: tl.constexpr, COUNT: tl.constexpr, N_CHUNK: tl.constexpr,
    STOP: tl.constexpr,
):
    """Top-ℓ buckets of batch row ``b``, KV head ``h``: ``sel[pid, :L]`` (``pid = b · Hkv + h``; int32,
    best first; ties: lower bucket).

    logits: [N_PART, B, Hq, C] float32 (query heads ``h*G .. h*G+G-1`` of KV head ``h``), summed over the
    ``N_PART`` split-K chunks in order (stride ``sl_p``) plus ``bias [Hq, C]`` when ``HAS_BIAS`` (the GEMV
    classifier's partial logits; a plain logits tensor is ``N_PART = 1``, no bias); sel: [B, Hkv, L]
    contiguous. Score of bucket c = Σ_g softmax(logits[b, h*G+g])[c] (>= 0, so its float bits order like
    the value): key = bits << 32 | (C_PAD - 1 - c), bitonic top-K_PAD, the first L kept.

    ``CAND > 0`` (``CONFIG.rank_filter``): the keys are cut into K_PAD chunks; every chunk's largest key is
    at least ``τ`` = the smallest chunk maximum, so at least K_PAD (distinct) keys reach ``τ`` and the top
    K_PAD are among the keys ``>= τ``. When at most CAND keys qualify they are compacted (prefix sum, a
    store to ``scratch [B·Hkv, CAND]`` and a reload) and only those are sorted; otherwise (flat scores,
    padded chunks) all C_PAD keys are, as without the filter. Same result either way.

    ``N_CHUNK > K_PAD`` (``CONFIG.rank_chunks`` · K_PAD chunks): ``τ`` = the K_PAD-th largest of the
    N_CHUNK chunk maxima (K_PAD distinct keys reach it, so the top K_PAD are still among the keys ``>= τ``;
    the smallest of K_PAD maxima is the case N_CHUNK = K_PAD): fewer candidates, so flat scores fall back
    to the full sort less often (ties of padded chunks' -1 maxima only make ``τ`` lower).

    ``COUNT`` (``CONFIG.rank_count``): the compacted candidates are placed by counting instead of sorted:
    candidate i's position is the number of candidates with a larger key (keys are distinct: the bucket id
    is in the low bits), one ``[CAND, CAND]`` comparison and one row sum in place of a bitonic network;
    positions below L are stored. Same output.

    ``STOP`` (time profiles only, ``scripts/bench_saap_classifier.py``; 0 in use): 1 / 2 / 3 / 4 end the
    program after the logits load / the group score / the threshold and candidate count / the compaction,
    storing placeholder ids that depend on what was computed (so nothing is eliminated); -1 stores them
    without loading anything (the launch alone).
    """
    if STOP == -1:
        _store_stop(sel_ptr, pid, L, 0, K_PAD)
        return
    offs_g = tl.arange(0, G_PAD)
    offs_c = tl.arange(0, C_PAD)
    g_ok = offs_g < G
    c_ok = offs_c < C
    ok = g_ok[:, None] & c_ok[None, :]
    ptrs = logits_ptr + b.to(tl.int64) * sl_b + (h * G + offs_g)[:, None] * sl_h + offs_c[None, :] * sl_c
    x = tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
    for part in tl.static_range(1, N_PART):
        x += tl.load(ptrs + part * sl_p, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        x += tl.load(bias_ptr + (h * G + offs_g)[:, None] * C + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
    if STOP == 1:
        _store_stop(sel_ptr, pid, L, (tl.sum(tl.sum(x, 1), 0) != 0.5).to(tl.int32), K_PAD)
        return
    x = tl.where(ok, x, -float("inf"))
    row_max = tl.where(g_ok, tl.max(x, 1), 0.0)
    e = tl.exp(x - row_max[:, None])  # padded rows and columns: exp(-inf) = 0
    den = tl.where(g_ok, tl.sum(e, 1), 1.0)
    score = tl.sum(e / den[:, None], 0)  # [C_PAD]
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(c_ok, (bits << 32) | (C_PAD - 1 - offs_c).to(tl.int64), -1)
    if STOP == 2:
        _store_stop(sel_ptr, pid, L, (tl.max(key, 0) == -5).to(tl.int32), K_PAD)
        return
    if CAND > 0:
        if N_CHUNK == K_PAD:
            tau = tl.min(tl.max(tl.reshape(key, [K_PAD, C_PAD // K_PAD]), axis=1), axis=0)
        else:  # the K_PAD-th largest of N_CHUNK chunk maxima: a tighter bound, found by counting
            mx = tl.max(tl.reshape(key, [N_CHUNK, C_PAD // N_CHUNK]), axis=1)
            above = tl.sum((mx[None, :] > mx[:, None]).to(tl.int32), axis=1)
            tau = tl.min(tl.where(above < K_PAD, mx, 0x7FFFFFFFFFFFFFFF), axis=0)
        cand = key >= tau
        n_cand = tl.sum(cand.to(tl.int32), axis=0)
        if STOP == 3:
            _store_stop(sel_ptr, pid, L, (n_cand == -5).to(tl.int32), K_PAD)
            return
        if n_cand <= CAND:
            row = scratch_ptr + pid.to(tl.int64) * CAND
            tl.store(row + tl.cumsum(cand.to(tl.int32), axis=0) - 1, key, mask=cand)
            tl.debug_barrier()  # the compacted candidates, stored by every thread, are visible to all
            offs_k = tl.arange(0, CAND)
            cand_key = tl.load(row + offs_k, mask=offs_k < n_cand, other=-1)
            if STOP == 4:
                _store_stop(sel_ptr, pid, L, (tl.max(cand_key, 0) == -5).to(tl.int32), K_PAD)
                return
            if COUNT:  # padding (-1) is below every real key, so it never lowers a real key's position
                pos = tl.sum((cand_key[None, :] > cand_key[:, None]).to(tl.int32), axis=1)
                idx = (C_PAD - 1 - (cand_key & 0xFFFFFFFF)).to(tl.int32)
                tl.store(sel_ptr + pid.to(tl.int64) * L + pos, idx, mask=(pos < L) & (offs_k < n_cand))
            else:
                _store_top(sel_ptr, pid, L, tl.topk(cand_key, K_PAD), C_PAD, K_PAD)
        else:
            _store_top(sel_ptr, pid, L, tl.topk(key, K_PAD), C_PAD, K_PAD)
    else:
        _store_top(sel_ptr, pid, L, tl.topk(key, K_PAD), C_PAD, K_PAD)


@triton.jit
def _store_stop(sel_ptr, pid, L, dep, K_PAD: tl.constexpr):
    """Placeholder ids ``0 .. L-1`` (+ ``dep``, 0 in practice) for the ``STOP`` time profiles."""
    offs_l = tl.arange(0, K_PAD)
    tl.store(sel_ptr + pid.to(tl.int64) * L + offs_l, offs_l + dep, mask=offs_l < L)


@triton.jit
def _store_top(sel_ptr, pid, L, top, C_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """The first L of ``top`` ([K_PAD] keys, descending) as bucket ids in ``sel[pid, :L]``."""
    idx = (C_PAD - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    offs_l = tl.arange(0, K_PAD)
    tl.store(sel_ptr + pid.to(tl.int64) * L + offs_l, idx, mask=offs_l < L)



# --------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------


def _terms(w: torch.Tensor) -> int:
    if w.dtype in (torch.bfloat16, torch.float16):
        return 4
    if w.dtype == torch.float32:
        return 1
    raise TypeError(f"SAAP classifier weights must be bf16, fp16 or float32, got {w.dtype}")


def _mlp_layer(x: torch.Tensor, w: torch.Tensor, vecs: tuple[torch.Tensor, ...], out: torch.Tensor, n_rows: int,
               eps: float, first: bool, out_terms: int) -> None:
    """Launch :func:`_mlp_layer_kernel` for every query head (``w [H, K, N]``) and 16-row batch block."""
    hq, k, n = w.shape
    sx = x.stride() if first else (0, 0, 0)
    grid = (hq, triton.cdiv(n, _tc.CONFIG.linear_block_n), triton.cdiv(n_rows, _ROWS))
    _mlp_layer_kernel[grid](
        x, w, *(t.contiguous() for t in vecs), out, n_rows, k, n, float(eps), *sx, *w.stride(),
        FIRST=first, TERMS=_terms(w), OUT_TERMS=out_terms, F32=_interpreting(),
        BLOCK_K=_tc.CONFIG.linear_block_k, BLOCK_N=_tc.CONFIG.linear_block_n,
        num_warps=_tc.CONFIG.linear_warps, num_stages=_tc.CONFIG.linear_stages,
    )


def _mlp_fused(q_derope: torch.Tensor, p: SaapLayerParams, logits: torch.Tensor) -> None:
    """Launch :func:`_mlp_fused_kernel`: both layers in one launch, partials reduced by the last program."""
    b, hq, d = q_derope.shape
    hd, c = p.w2.shape[1], p.w2.shape[2]
    cfg = _tc.CONFIG
    n_split = triton.cdiv(hd, cfg.cls_block_h)
    n_cols = triton.cdiv(c, cfg.cls_n_split * cfg.cls_block_n) * cfg.cls_block_n
    ns = triton.cdiv(c, n_cols)
    rb = triton.cdiv(b, _ROWS)
    part = _buffer((n_split, b, hq, c), torch.float32, q_derope.device)
    counters = torch.zeros(hq * rb * ns, dtype=torch.int32, device=q_derope.device)
    vecs = (p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias)
    _mlp_fused_kernel[(hq, n_split, rb * ns)](
        q_derope, p.w1, *(t.contiguous() for t in vecs), p.w2, p.b2.contiguous(), part, counters, logits,
        b, hq, d, hd, c, n_cols, n_split, float(p.bn_eps), *q_derope.stride(), *p.w1.stride(), *p.w2.stride(),
        TERMS=_terms(p.w2), F32=_interpreting(), BLOCK_K=cfg.linear_block_k, BLOCK_H=cfg.cls_block_h,
        BLOCK_N=cfg.cls_block_n, N_SPLIT=ns, num_warps=cfg.cls_warps, num_stages=cfg.cls_stages,
    )


def _use_gemv(b: int) -> bool:
    return b <= _tc.CONFIG.cls_gemv_max_b


def _gemv_partials(q_derope: torch.Tensor, p: SaapLayerParams) -> tuple[torch.Tensor, bool]:
    """The GEMV classifier (two launches of :func:`_gemv_kernel`): ``(partial logits [KS, B, Hq, C]
    float32, whether b2 is already in)``. Their in-order sum (plus ``b2`` when not in) is the logits;
    with ``CONFIG.gemv_atomic`` KS = 1 and ``b2`` is in."""
    b, hq, d = q_derope.shape
    hd, c = p.w2.shape[1], p.w2.shape[2]
    cfg = _tc.CONFIG
    rows = _pow2(b)
    atomic = bool(cfg.gemv_atomic)
    k_chunk = triton.cdiv(triton.cdiv(hd, max(1, cfg.gemv_k_split)), cfg.gemv_block_k) * cfg.gemv_block_k
    n_ks = triton.cdiv(hd, k_chunk)
    part = _buffer((1 if atomic else n_ks, b, hq, c), torch.float32, q_derope.device)
    hidden = _buffer((b, hq, hd), torch.float32, q_derope.device)
    b2 = p.b2.contiguous()
    _gemv_kernel[(hq, triton.cdiv(hd, cfg.gemv1_block_n), 1)](
        q_derope, p.w1, *(t.contiguous() for t in (p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias)), hidden,
        part, b2, b, hq, d, hd, d, float(p.bn_eps), c, *q_derope.stride(), *p.w1.stride(),
        FIRST=True, R=rows, BLOCK_K=min(cfg.gemv_block_k, _pow2(d)), BLOCK_N=cfg.gemv1_block_n, ATOMIC=atomic,
        num_warps=cfg.gemv_warps,
    )
    _gemv_kernel[(hq, triton.cdiv(c, cfg.gemv_block_n), n_ks)](
        hidden, p.w2, hidden, hidden, hidden, hidden, hidden, part, part, b2,
        b, hq, hd, c, k_chunk, 0.0, c, *hidden.stride(), *p.w2.stride(),
        FIRST=False, R=rows, BLOCK_K=cfg.gemv_block_k, BLOCK_N=cfg.gemv_block_n, ATOMIC=atomic,
        num_warps=cfg.gemv_warps,
    )
    return part, atomic


_BMM_OUT_F32: dict[str, bool] = {}


def _bmm_f32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w`` batched, float32 result with float32 accumulation: cuBLAS ``bmm(out_dtype=float32)`` for
    16-bit operands on CUDA; elsewhere (CPU, the interpreter tests) the same exact products summed in
    float32 by an upcast bmm."""
    if a.device.type == "cuda" and a.dtype != torch.float32:
        return torch.bmm(a, w, out_dtype=torch.float32)
    return torch.bmm(a.float(), w.float())


def _bmm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has ``bmm(..., out_dtype=float32)`` for 16-bit CUDA operands (probed once)."""
    if device.type != "cuda" or dtype == torch.float32:
        return True
    key = f"{device}/{dtype}"
    if key not in _BMM_OUT_F32:
        try:
            x = torch.ones(1, 2, 8, dtype=dtype, device=device)
            _BMM_OUT_F32[key] = torch.bmm(x, x.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _BMM_OUT_F32[key] = False
    return _BMM_OUT_F32[key]


def _use_bmm(q_derope: torch.Tensor, p: SaapLayerParams) -> bool:
    """The cuBLAS layer 2 (``CONFIG.cls_bmm_max_b``): bf16 / fp16 / float32 weights, one dtype, a torch
    that can return float32 from 16-bit operands."""
    return (q_derope.shape[0] <= _tc.CONFIG.cls_bmm_max_b and p.w1.dtype == p.w2.dtype
            and _bmm_supported(q_derope.device, p.w2.dtype))


def _layer1_terms(q_derope: torch.Tensor, p: SaapLayerParams) -> torch.Tensor:
    """Layer 1 whose epilogue writes the hidden as three 16-bit terms of the weights' dtype
    (:func:`_split3`), or as float32 for float32 weights: ``[Hq, T·B, Hd]``, rows ``t·B + i``. A query of
    the weights' 16-bit dtype at ``B >= CONFIG.l1_dot_min_b`` takes tensor cores
    (:func:`_layer1_dot_kernel`), anything else the GEMV (:func:`_gemv_kernel`)."""
    b, hq, d = q_derope.shape
    hd = p.w2.shape[1]
    cfg = _tc.CONFIG
    terms = 1 if p.w2.dtype == torch.float32 else 3
    hidden = _buffer((hq, terms * b, hd), p.w2.dtype, q_derope.device)
    vecs = tuple(t.contiguous() for t in (p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias))
    if 0 < cfg.l1_dot_min_b <= b and terms == 3 and q_derope.dtype == p.w1.dtype:
        _layer1_dot_kernel[(hq, triton.cdiv(hd, cfg.l1_dot_block_n), triton.cdiv(b, _ROWS))](
            q_derope, p.w1, *vecs, hidden, b, d, hd, float(p.bn_eps), *q_derope.stride(), *p.w1.stride(),
            ROWS=_ROWS, BLOCK_K=min(_pow2(d), cfg.l1_dot_block_k), BLOCK_N=cfg.l1_dot_block_n, OUT_TERMS=terms, F32=_interpreting(),
            num_warps=4,
        )
        return hidden
    rows = _pow2(b)
    block_k = max(16, min(_pow2(d), cfg.gemv_block_k // rows))  # [R, BLOCK_K, BLOCK_N] stays in registers
    _gemv_kernel[(hq, triton.cdiv(hd, cfg.gemv1_block_n), 1)](
        q_derope, p.w1, *vecs, hidden, hidden, hidden, b, hq, d, hd, d, float(p.bn_eps), 0, *q_derope.stride(),
        *p.w1.stride(), FIRST=True, R=rows, BLOCK_K=block_k, BLOCK_N=cfg.gemv1_block_n, ATOMIC=False,
        OUT_TERMS=terms, num_warps=cfg.gemv_warps,
    )
    return hidden


def _layer2_triton(hidden: torch.Tensor, w2: torch.Tensor, b: int, b2: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_layer2_kernel` on the three-term hidden ``[Hq, 3·B, Hd]``: logits ``[B, Hq, C]`` float32,
    ``b2`` included when given."""
    hq, hd, c = w2.shape
    cfg = _tc.CONFIG
    bp = max(4, min(_pow2(b), cfg.l2_rows))  # tl.dot needs 4·BP >= 16 rows
    logits = _buffer((b, hq, c), torch.float32, hidden.device)
    _layer2_kernel[(hq, triton.cdiv(c, cfg.l2_block_n), triton.cdiv(b, bp))](
        hidden, w2, logits if b2 is None else b2, logits, b, hq, hd, c, *hidden.stride(), *w2.stride(),
        BP=bp, BLOCK_K=cfg.l2_block_k, BLOCK_N=cfg.l2_block_n, F32=_interpreting(), BIAS=b2 is not None,
        num_warps=cfg.l2_warps, num_stages=cfg.l2_stages,
    )
    return logits


@dataclass
class _Partials:
    """Layer 2's output as the ranking reads it: ``parts [P, B, Hq, C]`` float32 summed in order, plus
    ``bias [Hq, C]`` when not yet in (None: it is)."""

    parts: torch.Tensor
    bias: torch.Tensor | None

    def logits(self) -> torch.Tensor:
        out = self.parts[0].clone()
        for term in self.parts[1:]:  # in order, like the ranking kernel
            out += term
        return out if self.bias is None else out + self.bias.float()


def _bmm_partials(q_derope: torch.Tensor, p: SaapLayerParams) -> _Partials:
    """Layer 1 (:func:`_layer1_terms`), layer 2 as one cuBLAS ``bmm`` over the query heads: ``hidden
    [Hq, T·B, Hd] @ w2 [Hq, Hd, C]`` with float32 output (T = 3 terms: every product exact, accumulation
    float32, so the logits carry the float32 classifier's precision): the per-term partial logits as a
    ``[T, B, Hq, C]`` view, ``b2`` left to the ranking, which sums the T terms in order and adds it.
    Layer 2 then streams the 67 MB of w2 at cuBLAS's rate instead of the GEMV's. ``CONFIG.l2_triton``
    (three-term hidden only): layer 2 as :func:`_layer2_kernel` instead, the terms already summed
    (``[1, B, Hq, C]``), ``b2`` added there with ``CONFIG.l2_bias``."""
    b = q_derope.shape[0]
    hidden = _layer1_terms(q_derope, p)
    b2 = p.b2.contiguous()
    if _tc.CONFIG.l2_triton and hidden.shape[1] == 3 * b:
        if _tc.CONFIG.l2_bias:
            return _Partials(_layer2_triton(hidden, p.w2, b, b2)[None], None)
        return _Partials(_layer2_triton(hidden, p.w2, b)[None], b2)
    hq, c = p.w2.shape[0], p.w2.shape[2]
    logits = _bmm_f32(hidden, p.w2)  # [Hq, T·B, C] float32
    return _Partials(logits.view(hq, hidden.shape[1] // b, b, c).permute(1, 2, 0, 3), b2)


def _check_device(q_derope: torch.Tensor, p: SaapLayerParams) -> None:
    if p.w1.device != q_derope.device:
        raise ValueError(f"classifier weights on {p.w1.device}, query on {q_derope.device}")


def saap_select_buckets_triton(q_derope: torch.Tensor, params: SaapLayerParams, group: int, top_l: int
                               ) -> torch.Tensor:
    """Classifier + ranking of one decode step: ``[B, Hkv, min(ℓ, C)]`` int32 bucket ids, best first.

    ``B <= CONFIG.cls_gemv_max_b``: the GEMV classifier, whose split-K partial logits (and ``b2``) the
    ranking kernel sums itself (no logits round trip); else :func:`saap_classifier_logits_triton` then
    :func:`saap_rank_buckets_triton`. Same buckets as :func:`reference.rank_buckets` on
    :func:`reference.classify_queries` (up to float32 rounding at exact near-ties)."""
    _check_device(q_derope, params)
    if _use_bmm(q_derope, params):
        pt = _bmm_partials(q_derope, params)
        return _rank(pt.parts, group, top_l, bias=pt.bias)
    if not _use_gemv(q_derope.shape[0]):
        return saap_rank_buckets_triton(saap_classifier_logits_triton(q_derope, params), group, top_l)
    part, has_bias = _gemv_partials(q_derope, params)
    return _rank(part, group, top_l, bias=None if has_bias else params.b2.contiguous())


def saap_classifier_logits_triton(q_derope: torch.Tensor, params: SaapLayerParams) -> torch.Tensor:
    """Classifier logits of every query head: ``q_derope [B, Hq, D]`` -> ``[B, Hq, C]`` float32.

    ``softmax(-1)`` of the result is :func:`reference.classify_queries` (to float32 rounding). Small
    batches (``B <= CONFIG.cls_gemv_max_b``) take the GEMV kernels (partials summed here; the decode step
    lets the ranking sum them, :func:`saap_select_buckets_triton`), larger ones the tensor-core kernels.
    """
    p = params
    _check_device(q_derope, p)
    if _use_bmm(q_derope, p):
        return _bmm_partials(q_derope, p).logits()
    if _use_gemv(q_derope.shape[0]):
        part, has_bias = _gemv_partials(q_derope, p)
        logits = part[0].clone()
        for chunk in part[1:]:  # in order, like the ranking kernel
            logits += chunk
        return logits if has_bias else logits + p.b2.float()
    b, hq, _ = q_derope.shape
    hd, c = p.w2.shape[1], p.w2.shape[2]
    logits = _buffer((b, hq, c), torch.float32, q_derope.device)
    if _tc.CONFIG.cls_fused and p.w1.dtype == p.w2.dtype:  # mixed dtypes: the two-launch path
        _mlp_fused(q_derope, p, logits)
        return logits
    terms2 = _terms(p.w2)
    hidden = _buffer((hq, triton.cdiv(b, _ROWS), _ROWS * terms2, hd),
                     p.w2.dtype if terms2 == 4 else torch.float32, q_derope.device)
    _mlp_layer(q_derope, p.w1, (p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias), hidden, b, p.bn_eps,
               True, terms2)
    _mlp_layer(hidden, p.w2, (p.b2,) * 5, logits, b, 0.0, False, 1)
    return logits


def saap_rank_buckets_triton(logits: torch.Tensor, group: int, top_l: int) -> torch.Tensor:
    """Top-ℓ buckets per KV head from logits: ``[B, Hq, C]`` -> ``[B, Hkv, min(ℓ, C)]`` int32, best first.

    The same set as :func:`reference.rank_buckets` on ``softmax(logits)``. Exact ties (e.g. probabilities
    that underflow to 0 when fewer than ℓ buckets have mass) go to the lower bucket id; ``torch.topk``'s
    order among exact ties is unspecified, so only there may the two choose different buckets.
    """
    return _rank(logits[None], group, top_l)


def _rank_buffers(b: int, hkv: int, c: int, top_l: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``sel [B, Hkv, min(ℓ, C)]``, the compaction scratch and the ranking's constexprs (:func:`_rank_row`)."""
    n_l = min(int(top_l), c)
    sel = _buffer((b, hkv, n_l), torch.int32, device)
    c_pad, k_pad = max(2, _pow2(c)), max(2, _pow2(n_l))  # tl.topk needs k >= 2
    cand = _tc.CONFIG.rank_filter * k_pad if _tc.CONFIG.rank_filter else 0
    cand = cand if 0 < cand < c_pad else 0  # a filter that keeps everything is no filter
    scratch = _buffer((b * hkv * max(cand, 1),), torch.int64, device)
    meta = dict(C_PAD=c_pad, K_PAD=k_pad, CAND=cand, COUNT=bool(_tc.CONFIG.rank_count),
                N_CHUNK=min(c_pad, k_pad * max(1, _tc.CONFIG.rank_chunks)))
    return sel, scratch, meta


def _rank(parts: torch.Tensor, group: int, top_l: int, bias: torch.Tensor | None = None, stop: int = 0
          ) -> torch.Tensor:
    """Launch :func:`_rank_kernel` on ``parts [P, B, Hq, C]`` (summed in order, plus ``bias [Hq, C]``);
    ``stop``: a time profile's early end (:func:`_rank_row`)."""
    n_part, b, hq, c = parts.shape
    hkv = hq // group
    sel, scratch, meta = _rank_buffers(b, hkv, c, top_l, parts.device)
    if sel.shape[-1] == 0:
        return sel
    _rank_kernel[(b * hkv,)](
        parts, parts if bias is None else bias, sel, scratch, hkv, c, sel.shape[-1], *parts.stride()[1:],
        parts.stride(0), G=group, G_PAD=_pow2(group), N_PART=n_part, HAS_BIAS=bias is not None, **meta, STOP=stop,
        num_warps=_tc.CONFIG.rank_warps,
    )
    return sel
