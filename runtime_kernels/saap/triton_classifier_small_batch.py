"""SAAP's query classifier for few rows per classifier (``B·G <= CONFIG.small_batch_max_b``, decode's usual
case: B rows, or B·G for a classifier per KV head).

Whatever B, one call streams all classifier weights (w2 being most of them), so the time is the w2 stream
plus what cannot hide under it. Two launches:

1. Layer 1 (``q_derope @ w1 + b1``, eval batch-norm, ReLU), whose epilogue writes the float32 hidden as
   three 16-bit terms of w2's dtype (:func:`_split3`; float32 as is for float32 w2): on tensor cores
   (:func:`_layer1_dot_kernel`) when the query has the weights' 16-bit dtype (bf16 × bf16 products are
   exact in fp32), else as a CUDA-core GEMV in float32 (:func:`_layer1_gemv_kernel`).
2. Layer 2 (:func:`_layer2_kernel`): one ``tl.dot`` per w2 tile multiplies all three terms of every batch
   row at once (exact products), the epilogue sums the terms and adds ``b2``: float32 logits, w2 read
   once through a ``l2_stages``-deep pipeline. Float32 w2 takes one cuBLAS ``baddbmm`` instead.

A classifier shared by a KV head's G query heads takes their queries as its batch rows (R = B·G), read in
place from ``[B, Hq, D]`` and written back to ``[B, Hq, C]`` by index: no copy either way. Given the
query's de-RoPE coefficients, layer 1 de-RoPEs the RoPE'd query as it loads it: no launch of its own.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ModuleNotFoundError("runtime_kernels.saap.triton_classifier_small_batch needs the 'triton' package",
                              name="triton") from exc

from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.reference import SaapLayerParams, query_head_logits
from runtime_kernels.saap.triton_classifier_common import (
    bn_apply_relu,
    bn_relu,
    bn_vectors,
    dot,
    load_query,
    logit_rows,
    query_rows,
    weight_terms,
)
from runtime_kernels.saap.triton_config import ROWS as _ROWS
from runtime_kernels.saap.triton_config import buffer as _buffer
from runtime_kernels.saap.triton_config import pow2 as _pow2

patch_interpreter()


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
def _store_terms(out_ptr, y, h, rows, r_ok, offs_n, n_ok, n_rows, N, OUT_TERMS: tl.constexpr):
    """Hidden ``y [R, BLOCK_N]`` (float32) of head h as layer 2's operand ``out [H, OUT_TERMS·B, N]`` (rows
    ``t·B + i``): three 16-bit terms of out's dtype (:func:`_split3`), or float32 as is (``OUT_TERMS = 1``)."""
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
def _layer1_gemv_kernel(
    x_ptr, rot_ptr, w_ptr, bias_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, out_ptr,
    n_rows, K, N, eps, sx_b, sx_h, sx_k, sw_h, sw_k, sw_n,
    R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, OUT_TERMS: tl.constexpr,
    G: tl.constexpr, ROPE: tl.constexpr,
):
    """Layer 1 of classifier ``h`` (program 0) for ``BLOCK_N`` hidden units (program 1) and all
    ``n_rows <= R`` of its batch rows on CUDA cores: ``relu(bn(x @ w[h] + b1[h]))`` with float32 products
    and accumulation (weights upcast), accumulated per (row, k lane, column) and reduced over k once at
    the end; stored as :func:`_store_terms`. x: [B, H·G, K] (strides ``sx_*``), classifier ``h``'s rows
    as :func:`query_rows`, de-RoPE'd on load when ``ROPE`` (:func:`load_query`); w: [H, K, N].
    Grid: (H, cdiv(N, BLOCK_N))."""
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    r_ok = offs_r < n_rows
    w_head = w_ptr + h.to(tl.int64) * sw_h + offs_n[None, :] * sw_n
    x_rows = query_rows(x_ptr, offs_r, h, sx_b, sx_h, G)
    acc = tl.zeros([R, BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_head + kk[:, None] * sw_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        x = load_query(x_rows, r_ok, kk, k_ok, sx_k, rot_ptr, offs_r, K, G, ROPE,
                       w_ptr.dtype.element_ty).to(tl.float32)
        acc += x[:, :, None] * w[None, :, :]
    y = tl.sum(acc, 1)  # [R, BLOCK_N]
    vec = h * N + offs_n
    bias = tl.load(bias_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)
    y = bn_relu(y + bias[None, :], vec, n_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr, eps)
    _store_terms(out_ptr, y, h, offs_r.to(tl.int64), r_ok, offs_n, n_ok, n_rows, N, OUT_TERMS)


@triton.jit
def _layer1_dot_kernel(
    x_ptr, rot_ptr, w_ptr, bias_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, out_ptr,
    n_rows, K, N, eps, sx_b, sx_h, sx_k, sw_h, sw_k, sw_n,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, OUT_TERMS: tl.constexpr, F32: tl.constexpr,
    G: tl.constexpr, ROPE: tl.constexpr,
):
    """Layer 1 of classifier ``h`` (program 0) for ``BLOCK_N`` hidden units (program 1) and ``ROWS`` batch
    rows (program 2) on tensor cores, for an input of the weights' own 16-bit dtype (a de-RoPE'd query is
    rounded to it, :func:`load_query`): every bf16 / fp16 product is exact in the fp32 accumulator, so this
    is the GEMV's float32 result up to summation order. Rows and epilogue as :func:`_layer1_gemv_kernel`'s.
    ``F32``: both operands in fp32, IEEE (the interpreter)."""
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    r_ok = offs_r < n_rows
    x_rows = query_rows(x_ptr, offs_r, h, sx_b, sx_h, G)
    w_head = w_ptr + h.to(tl.int64) * sw_h + offs_n[None, :] * sw_n
    # the epilogue's vectors are requested with the first tiles, not after the dot: one dependent memory
    # round trip less on the critical path
    vec = h * N + offs_n
    bias = tl.load(bias_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)
    mean, var, gamma, beta = bn_vectors(vec, n_ok, mean_ptr, var_ptr, gamma_ptr, beta_ptr)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = load_query(x_rows, r_ok, kk, k_ok, sx_k, rot_ptr, offs_r, K, G, ROPE, w_ptr.dtype.element_ty)
        w = tl.load(w_head + kk[:, None] * sw_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += dot(x, w, F32, 4)
    y = bn_apply_relu(acc + bias[None, :], mean, var, gamma, beta, eps)
    _store_terms(out_ptr, y, h, offs_r.to(tl.int64), r_ok, offs_n, n_ok, n_rows, N, OUT_TERMS)


@triton.jit
def _layer2_kernel(
    h_ptr, w_ptr, b2_ptr, out_ptr, n_rows, n_classifiers, K, N, sh_h, sh_r, sh_k, sw_h, sw_k, sw_n,
    BP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr, G: tl.constexpr,
):
    """Layer 2 of classifier ``h`` (program 0) for ``BLOCK_N`` logits (program 1) and ``BP`` of its batch
    rows (program 2) from the three-term hidden ``h [Hc, 3·R, Hd]`` (rows ``t·R + i``, R = B·G): the tile's row
    ``4·j + t`` holds term ``t`` of batch row ``j`` (row ``4·j + 3`` is zero), so one ``tl.dot`` per k step
    multiplies every term by the streamed ``w2 [BLOCK_K, BLOCK_N]`` tile (exact products, fp32
    accumulation) and the epilogue sums each row's three terms and adds ``b2 [Hq, N]`` (requested before
    the k loop, so its DRAM round trip hides under the stream): ``out [B, Hc·G, N]`` float32, classifier
    row ``b·G + g`` at query head ``h·G + g`` (:func:`logit_rows`). The w2 tiles are the whole cost.
    ``F32``: operands in fp32, IEEE (the interpreter)."""
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 4 * BP)
    row_b = tl.program_id(2) * BP + offs_r // 4
    term = offs_r % 4
    r_ok = (term < 3) & (row_b < n_rows)
    n_ok = offs_n < N
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
        acc += dot(x, w, F32, 4)
    logits = tl.sum(tl.reshape(acc, [BP, 4, BLOCK_N]), axis=1) + bias[None, :]  # t0 + t1 + t2 (+ the zero row)
    rows = tl.program_id(2) * BP + tl.arange(0, BP)
    dst = logit_rows(out_ptr, rows, h, n_classifiers, N, G)[:, None] + offs_n[None, :]
    tl.store(dst, logits, mask=(rows < n_rows)[:, None] & n_ok[None, :])


def layer1_terms(x: torch.Tensor, p: SaapLayerParams, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Layer 1 of every classifier: the hidden ``[Hc, T·R, Hd]`` in w2's dtype (R = B·G classifier rows,
    :func:`~runtime_kernels.saap.triton_classifier_common.query_rows`), rows ``t·R + i`` (T = 3 terms for
    16-bit w2, 1 for float32 w2). ``x [B, Hq, D]``: the de-RoPE'd query, or with ``rotation [B, 2, D]``
    the RoPE'd one, de-RoPE'd on load and rounded to w1's dtype. An input of w1's 16-bit dtype takes
    tensor cores (:func:`_layer1_dot_kernel`), anything else the float32 GEMV (:func:`_layer1_gemv_kernel`)."""
    b, hq, d = x.shape
    hc, _, hd = p.w1.shape
    g = hq // hc
    n_rows = b * g
    cfg = _tc.CONFIG
    terms = 1 if weight_terms(p.w2) == 1 else 3
    hidden = _buffer((hc, terms * n_rows, hd), p.w2.dtype, x.device)
    vecs = tuple(t.contiguous() for t in (p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias))
    rope = rotation is not None
    rot = rotation.contiguous() if rope else x
    if weight_terms(p.w1) == 4 and (rope or x.dtype == p.w1.dtype):
        _layer1_dot_kernel[(hc, triton.cdiv(hd, cfg.l1_dot_block_n), triton.cdiv(n_rows, _ROWS))](
            x, rot, p.w1, *vecs, hidden, n_rows, d, hd, float(p.bn_eps), *x.stride(), *p.w1.stride(),
            ROWS=_ROWS, BLOCK_K=min(_pow2(d), cfg.l1_dot_block_k), BLOCK_N=cfg.l1_dot_block_n, OUT_TERMS=terms,
            F32=_interpreting(), G=g, ROPE=rope, num_warps=4,
        )
        return hidden
    rows = _pow2(n_rows)
    # [R, BLOCK_K, BLOCK_N] stays in registers: fewer k rows per step, and past 16 rows fewer columns
    block_k = max(16, min(_pow2(d), cfg.gemv_block_k // rows))
    block_n = max(16, cfg.gemv1_block_n * 16 // max(16, rows))
    _layer1_gemv_kernel[(hc, triton.cdiv(hd, block_n))](
        x, rot, p.w1, *vecs, hidden, n_rows, d, hd, float(p.bn_eps), *x.stride(), *p.w1.stride(),
        R=rows, BLOCK_K=block_k, BLOCK_N=block_n, OUT_TERMS=terms, G=g, ROPE=rope,
        num_warps=cfg.gemv_warps,
    )
    return hidden


def layer2_logits(hidden: torch.Tensor, p: SaapLayerParams, b: int) -> torch.Tensor:
    """Layer 2 on :func:`layer1_terms`' hidden: logits ``[B, Hq, C]`` float32 (query head ``c·G + g`` of
    row ``b`` from classifier row ``b·G + g``), ``b2`` included (for float32 w2 a strided view of cuBLAS's
    ``[Hc, R, C]``)."""
    hc, hd, c = p.w2.shape
    if weight_terms(p.w2) == 1:  # float32 w2: one float32 hidden term
        return query_head_logits(torch.baddbmm(p.b2.float()[:, None, :], hidden, p.w2).transpose(0, 1), b)
    n_rows = hidden.shape[1] // 3
    g = n_rows // b
    cfg = _tc.CONFIG
    bp = max(4, min(_pow2(n_rows), cfg.l2_rows))  # tl.dot needs 4·BP >= 16 rows
    logits = _buffer((b, hc * g, c), torch.float32, hidden.device)
    _layer2_kernel[(hc, triton.cdiv(c, cfg.l2_block_n), triton.cdiv(n_rows, bp))](
        hidden, p.w2, p.b2.contiguous(), logits, n_rows, hc, hd, c, *hidden.stride(), *p.w2.stride(),
        BP=bp, BLOCK_K=cfg.l2_block_k, BLOCK_N=cfg.l2_block_n, F32=_interpreting(), G=g,
        num_warps=cfg.l2_warps, num_stages=cfg.l2_stages,
    )
    return logits


def small_batch_logits(x: torch.Tensor, p: SaapLayerParams, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier logits ``[B, Hq, C]`` float32 (possibly a strided view) of ``x [B, Hq, D]`` (the
    de-RoPE'd query, or the RoPE'd one with ``rotation``, :func:`layer1_terms`)."""
    return layer2_logits(layer1_terms(x, p, rotation), p, x.shape[0])
