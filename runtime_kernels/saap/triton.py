"""SAAP decode attention in Triton: same arguments, same result as
:func:`runtime_kernels.saap.reference.saap_decode_attention_reference` (papers/saap.txt App. F).

One decode step of one layer in five launches and no host sync (Python ints from shapes size the grids,
so the step can be captured in a CUDA graph); the defaults in :class:`SaapTritonConfig` are what measured
fastest on the H200 (two-launch classifier, no side stream); the alternatives below stay selectable:

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
3. :func:`_partial_kernel`: one program per (batch, KV head, partial). Partials ``0 .. n_win-1`` are tiles
   of the dense region (sink + recent window: positions ``[0, lo) ∪ [hi, T)``, the current key
   included); partials ``n_win ..`` are the ℓ visited buckets (``CONFIG.bkt_per_prog`` buckets per
   program for short buckets, or a bucket split over ``CONFIG.bkt_split`` programs), each bucket walking its slice of the
   :class:`BucketIndex` slot array (``slots[b, h, slot_start[c] : slot_start[c] + bucket_count[c]]``: the
   index's own CSR-with-slack layout, read as is: no repacking, no ``csr()``). Each gathered K/V row is
   loaded once for all ``G`` query heads of the group (``q`` is a ``[16, D]`` tile; ``tl.dot`` with fp32
   accumulation), online softmax in exp2 units; writes ``(o, m, l)`` in float32. An empty bucket writes
   ``m = -inf, l = 0`` and weighs nothing in the merge.
4. :func:`_merge_kernel`: exact log-sum-exp merge of the partials, one program per (batch, KV head,
   32 output columns), 16 partials per vector load.

A dense layer (``params.dense``) is steps 3-4 with the whole cache as the window (flash-decoding).

Performance model (Llama-3.1-8B: Hq = 32, Hkv = 8, D = 128, bf16 K/V and classifier weights, C = 1024,
hidden 1024, window 1 + 2047, balanced buckets of ``N_s / C`` keys, ``N_vis = 2048 + ℓ · N_s / C``):

* classifier: ``Hq · (D·Hd + Hd·C) · 2 B`` = 75.5 MB of weights per call whatever B (≤ 16). First
  version (two launches, 256 programs streaming K = 1024): measured 46 µs (1.65 TB/s). Fused: 512
  programs (2 resident per SM: 244 registers, 80 KB smem at 3 stages), each 16 KB of w1 then 8 steps of
  16 KB of w2; no second launch, no hidden round trip; reduction reads ``16 · B · C · 4 B`` per head from
  L2. Expected ~20-25 µs at 3-3.8 TB/s; the tile variants in ``bench_decode.py --saap-variants`` pick.
* ranking: ``B · Hq · C · 4 B`` of logits (128 KB at B = 1), ~2-3 µs (latency).
* attention: ``B · Hkv · N_vis · D · 2 · 2 B`` of K/V + 4 B per bucket key of slot index; T = 128k,
  ℓ = 32: N_vis ≈ 6080, 24.9 MB at B = 1, 199 MB at B = 8. 149 registers and 39 KB of smem per program
  at block_n 64 / 4 warps (3 resident per SM; 8 warps: 102 registers; block_n 32: 87; ptxas sm_90a, no
  spills). FLOPs ``4 · 16 · D · N_vis`` per
  (b, KV head) on mma (negligible). Partials ``B · Hkv · P · G · (D + 2) · 4 B`` written and read back
  (P = n_win + ℓ = 48: 0.8 MB at B = 1, 6.4 MB at B = 8).
* floor at 128k, ℓ = 32 (4.2 TB/s): B = 1: 100 MB -> 24 µs (dense K+V: 537 MB -> 128 µs); B = 8: 275 MB
  -> 65 µs (dense: 4.3 GB -> 1023 µs). Expected graphed after the fused classifier and the
  overlap: B = 1 ≈ 22 (cls) + 3 (rank) + 8 (buckets) + 3 (merge) ≈ 35-40 µs; B = 8, 8k ≈ 25 + 3 + 5 + 3
  ≈ 40-55 µs (window under the classifier). Eager adds the Python launch cost (~20-40 µs of CPU).
* window overlap: the window partials (8 MB at B = 1, 64 MB at B = 8, T ≥ 8k) stream under the
  classifier on a side stream, so at B = 8, 8k the step costs ~max(cls, window) + ranking + buckets +
  merge instead of their sum.
* not done: the rank and merge steps could ride on the last
  program of the previous launch (an arrival counter: ~2 x 2 µs); ``bkt_split`` is one static split for all
  buckets, so a very unbalanced index still costs its longest bucket / bkt_split. The split-K partial
  logits are ``hidden / cls_block_h · B · Hq · C · 4 B`` written and read back (2 MB at B = 1, 16 MB at
  B = 8 with block 64: ``cls-h128-*`` variants halve it). Weights and
  K/V must have unit stride on their last dim (true of contiguous tensors) for the cp.async pipelines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ImportError("runtime_kernels.saap.triton needs the 'triton' package") from exc

from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels.saap.reference import (
    BucketIndex,
    SaapLayerParams,
    saap_decode_attention_reference,
    searchable_range,
)

LOG2E = 1.4426950408889634
_ROWS = 16  # batch rows per classifier tile and query rows per attention tile (tl.dot needs M >= 16)


@dataclass
class SaapTritonConfig:
    """Tile sizes and schedule switches (module-level :data:`CONFIG`; tests shrink the tiles to exercise
    several tiles on tiny shapes; ``scripts/bench_decode.py --saap-config / --saap-variants`` time others).

    Attention: ``block_n`` keys per step; the dense region is cut into tiles of
    ``block_n · max(min_win_steps, ceil(n_dense / (max_win_tiles · block_n)))`` keys; each bucket program
    walks ``bkt_per_prog`` consecutive selected buckets, each bucket split over ``bkt_split`` programs
    (chunks of ``ceil(count / bkt_split)`` keys). ``overlap_window``: the window partials run on a side
    stream under the classifier and ranking (CUDA only; fork/join by events, graph-capturable).

    Classifier: ``cls_fused = 1``: one launch, one program per (query head, ``cls_block_h`` hidden units,
    ``cls_n_split``-th of the C logits, 16 batch rows) computing its hidden slice (layer 1) and that
    slice's contribution to the logits (layer 2, ``cls_block_n`` columns per step); the last of the
    ``hidden / cls_block_h`` programs of a (head, column range, rows) to finish sums the partials in a
    fixed order (deterministic). ``cls_fused = 0``: the two-launch path (``linear_*``).
    """

    block_n: int = 64
    min_win_steps: int = 2
    max_win_tiles: int = 64
    bkt_split: int = 1
    bkt_per_prog: int = 1
    # Defaults from the H200 variant run (2026-11-21, bench_decode.py --saap-variants, graphed, ℓ=32): the
    # two-launch classifier (46 µs alone at 128k B=1) beat the fused split-K one (147 µs; 93 µs with
    # 128-wide hidden tiles), and overlapping the window on a side stream bought nothing.
    overlap_window: int = 0
    attn_warps: int = 4
    attn_stages: int = 2  # most programs walk 1-3 key steps: occupancy matters more than deep pipelines
    cls_fused: int = 0
    cls_block_h: int = 64  # 128 spills at 4 warps (255 regs, 700 B; ptxas sm_90a); 64: 244 regs, 80 KB smem
    cls_block_n: int = 128
    cls_n_split: int = 1
    cls_warps: int = 4
    cls_stages: int = 3
    linear_block_k: int = 64  # also the layer-1 K step of the fused classifier
    linear_block_n: int = 128
    linear_warps: int = 4
    linear_stages: int = 4  # 16 steps of 16 KB weight tiles per program at hidden = C = 1024
    merge_block_p: int = 16
    merge_block_d: int = 32
    poison: bool = False  # fill outputs and partials with NaN before the launches (tests)


CONFIG = SaapTritonConfig()



patch_interpreter()


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _mma(a, b, F32: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``F32``: both operands in fp32, IEEE (the interpreter, whose
    bf16 ``tl.dot`` is wrong, and float32 inputs); else the operands' own dtype on tensor cores."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


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
        if F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif TERMS == 4:
            acc += tl.dot(x, w)
        else:
            acc += tl.dot(x, w, input_precision="tf32x3")
    if TERMS == 4:
        y = tl.sum(tl.reshape(acc, [4, 16, BLOCK_N]), 0)  # [16, BLOCK_N]
    else:
        y = acc
    vec = h * N + offs_n
    y += tl.load(bias_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs_i = tl.arange(0, 16)
    if FIRST:
        mean = tl.load(mean_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)
        var = tl.load(var_ptr + vec, mask=n_ok, other=1.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + vec, mask=n_ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(var + eps)
        y = tl.maximum((y - mean[None, :]) * (inv * gamma)[None, :] + beta[None, :], 0.0)
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
        if F32:
            acc1 += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif TERMS == 4:
            acc1 += tl.dot(x, w)
        else:
            acc1 += tl.dot(x, w, input_precision="tf32x3")
    vec = h * HD + offs_h
    mean = tl.load(mean_ptr + vec, mask=h_ok, other=0.0).to(tl.float32)
    var = tl.load(var_ptr + vec, mask=h_ok, other=1.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + vec, mask=h_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + vec, mask=h_ok, other=0.0).to(tl.float32)
    bias1 = tl.load(b1_ptr + vec, mask=h_ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(var + eps)
    if TERMS == 4:
        hid = tl.sum(tl.reshape(acc1, [4, 16, BLOCK_H]), 0) + bias1[None, :]  # [16, BLOCK_H]
        hid = tl.maximum((hid - mean[None, :]) * (inv * gamma)[None, :] + beta[None, :], 0.0)
        hid = tl.where(h_ok[None, :], hid, 0.0)
        hid = tl.reshape(tl.broadcast_to(hid[None, :, :], [4, 16, BLOCK_H]), [ROWS, BLOCK_H])
        t0, t1, t2, t3 = _split4(hid, w2_ptr.dtype.element_ty)
        a = tl.where(term == 0, t0, tl.where(term == 1, t1, tl.where(term == 2, t2, t3)))
    else:
        hid = acc1 + bias1[None, :]
        hid = tl.maximum((hid - mean[None, :]) * (inv * gamma)[None, :] + beta[None, :], 0.0)
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
        if F32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif TERMS == 4:
            acc = tl.dot(a, w)
        else:
            acc = tl.dot(a, w, input_precision="tf32x3")
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
def _rank_kernel(
    logits_ptr, sel_ptr, n_kv, C, L, sl_b, sl_h, sl_c,
    G: tl.constexpr, G_PAD: tl.constexpr, C_PAD: tl.constexpr, K_PAD: tl.constexpr,
):
    """Top-ℓ buckets of one (batch, KV head): ``sel[b, h, :L]`` (int32, best first; ties: lower bucket).

    logits: [B, Hq, C] float32 (query heads ``h*G .. h*G+G-1`` of KV head ``h``); sel: [B, Hkv, L]
    contiguous. Score of bucket c = Σ_g softmax(logits[b, h*G+g])[c] (>= 0, so its float bits order like
    the value): key = bits << 32 | (C_PAD - 1 - c), bitonic top-K_PAD, the first L kept.
    """
    pid = tl.program_id(0)
    b = pid // n_kv
    h = pid % n_kv
    offs_g = tl.arange(0, G_PAD)
    offs_c = tl.arange(0, C_PAD)
    g_ok = offs_g < G
    c_ok = offs_c < C
    ptrs = logits_ptr + b.to(tl.int64) * sl_b + (h * G + offs_g)[:, None] * sl_h + offs_c[None, :] * sl_c
    x = tl.load(ptrs, mask=g_ok[:, None] & c_ok[None, :], other=-float("inf"))
    row_max = tl.where(g_ok, tl.max(x, 1), 0.0)
    e = tl.exp(x - row_max[:, None])  # padded rows and columns: exp(-inf) = 0
    den = tl.where(g_ok, tl.sum(e, 1), 1.0)
    score = tl.sum(e / den[:, None], 0)  # [C_PAD]
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(c_ok, (bits << 32) | (C_PAD - 1 - offs_c).to(tl.int64), -1)
    top = tl.topk(key, K_PAD)  # [K_PAD] descending
    idx = (C_PAD - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    offs_l = tl.arange(0, K_PAD)
    tl.store(sel_ptr + pid.to(tl.int64) * L + offs_l, idx, mask=offs_l < L)


@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, start_ptr, count_ptr, slots_ptr, o_ptr, m_ptr, l_ptr,
    n_kv, lo, hi, n_dense, win_tile, n_win, n_part, p_base, L, n_split, n_per, qk_scale,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sst_b, sst_h, sst_c, scn_b, scn_h, scn_c, ssl_b, ssl_h, ssl_s,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, F32: tl.constexpr,
):
    """One partial softmax ``(o [G, D], m [G], l [G])`` of the query heads of one (batch, KV head).

    Partial ``p = p_base + program_id(1)``. ``p < n_win``: dense-region keys
    ``j ∈ [p·win_tile, min((p+1)·win_tile, n_dense))`` at position ``j`` if ``j < lo`` else ``j + hi - lo``.
    ``p >= n_win``: with ``r = p - n_win``, the selected buckets ``sel[b, h, e]`` for
    ``e ∈ [(r // n_split)·n_per, +n_per) ∩ [0, L)``, of each bucket ``c`` its ``(r % n_split)``-th chunk of
    ``ceil(count / n_split)`` keys, positions ``slots[b, h, slot_start[b, h, c] + i]``,
    ``i < bucket_count[b, h, c]``. ``m`` is in log2 units (scores times ``scale · log2 e``), ``-inf`` and
    ``l = 0`` when the partial has no key. Partials are contiguous ``o [B, Hkv, P, G, D]``,
    ``m, l [B, Hkv, P, G]`` float32. Grid: (B · Hkv, number of partials of this launch).
    """
    pid = tl.program_id(0)
    p = p_base + tl.program_id(1)
    b = pid // n_kv
    h = pid % n_kv
    b64 = b.to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    q = tl.load(q_ptr + b64 * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, D_PAD]
    k_base = k_ptr + b64 * sk_b + h * sk_h
    v_base = v_ptr + b64 * sv_b + h * sv_h
    # what this program walks: a window tile (arithmetic positions) or buckets (positions from slots)
    is_bkt = p >= n_win
    r = p - n_win
    e0 = (r // n_split) * n_per
    part = r % n_split
    j_first = p * win_tile
    n_seg = tl.where(is_bkt, tl.minimum(n_per, L - e0), 1)
    m_i = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for e in range(0, n_seg):
        c = tl.load(sel_ptr + pid.to(tl.int64) * L + e0 + e, mask=is_bkt, other=0)
        slot0 = tl.load(start_ptr + b64 * sst_b + h * sst_h + c * sst_c, mask=is_bkt, other=0)
        n_bkt = tl.load(count_ptr + b64 * scn_b + h * scn_h + c * scn_c, mask=is_bkt, other=0)
        chunk = (n_bkt + n_split - 1) // n_split
        i_lo = tl.where(is_bkt, part * chunk, 0)
        i_hi = tl.where(is_bkt, tl.minimum(n_bkt, i_lo + chunk), tl.minimum(win_tile, n_dense - j_first))
        slot_base = slots_ptr + b64 * ssl_b + h * ssl_h + slot0 * ssl_s
        for n0 in range(i_lo, i_hi, BLOCK_N):
            i = n0 + offs_n
            k_ok = i < i_hi
            j = j_first + i
            pos_w = tl.where(j < lo, j, j + (hi - lo))
            # the scalar flag is broadcast by hand: Triton 3.9's interpreter rejects vector & scalar masks
            pos_b = tl.load(slot_base + i * ssl_s, mask=k_ok & ((i * 0 + p) >= n_win), other=0)
            pos = tl.where(is_bkt, pos_b, pos_w)
            kt = tl.load(k_base + pos[None, :] * sk_t + offs_d[:, None] * sk_d,
                         mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [D_PAD, BLOCK_N]
            s = _mma(q, kt, F32) * qk_scale  # [G_PAD, BLOCK_N], log2 units
            s = tl.where(k_ok[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(v_base + pos[:, None] * sv_t + offs_d[None, :] * sv_d,
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            acc = acc * alpha[:, None] + _mma(pr.to(v.dtype), v, F32)
            m_i = m_new
    row = (pid.to(tl.int64) * n_part + p) * G + offs_g  # [G_PAD] partial row index
    tl.store(o_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)


@triton.jit
def _merge_kernel(
    o_ptr, m_ptr, l_ptr, out_ptr, n_kv, n_part, so_b, so_h, so_d,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """``out[b, h*G + g, d] = Σ_p 2^(m_p - M) o_p / Σ_p 2^(m_p - M) l_p`` (exact log-sum-exp merge; empty
    partials weigh 0). Partials as in :func:`_partial_kernel`, read ``BLOCK_P`` at a time (one vector load
    each, running max); out: [B, Hq, D]. Grid: (B · Hkv, cdiv(D, BLOCK_D))."""
    pid = tl.program_id(0)
    b = pid // n_kv
    h = pid % n_kv
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_P)
    g_ok = offs_g < G
    d_ok = offs_d < D
    m_run = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
    den = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, n_part, BLOCK_P):
        pp = p0 + offs_p
        ok = (pp < n_part)[:, None] & g_ok[None, :]  # [BLOCK_P, G_PAD]
        row = (pid.to(tl.int64) * n_part + pp[:, None]) * G + offs_g[None, :]
        m = tl.load(m_ptr + row, mask=ok, other=-float("inf"))
        l_p = tl.load(l_ptr + row, mask=ok, other=0.0)
        o = tl.load(o_ptr + row[:, :, None] * D + offs_d[None, None, :],
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)  # [BLOCK_P, G_PAD, BLOCK_D]
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe[None, :])  # [BLOCK_P, G_PAD], 0 for empty partials
        den = den * alpha + tl.sum(w * l_p, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m_run = m_new
    out = acc / tl.where(g_ok, den, 1.0)[:, None]
    ptrs = out_ptr + b.to(tl.int64) * so_b + (h * G + offs_g)[:, None] * so_h + offs_d[None, :] * so_d
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if CONFIG.poison:  # NaN (floats) or -1 (bucket ids): an unwritten element shows in the result
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


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
    grid = (hq, triton.cdiv(n, CONFIG.linear_block_n), triton.cdiv(n_rows, _ROWS))
    _mlp_layer_kernel[grid](
        x, w, *(t.contiguous() for t in vecs), out, n_rows, k, n, float(eps), *sx, *w.stride(),
        FIRST=first, TERMS=_terms(w), OUT_TERMS=out_terms, F32=_interpreting(),
        BLOCK_K=CONFIG.linear_block_k, BLOCK_N=CONFIG.linear_block_n,
        num_warps=CONFIG.linear_warps, num_stages=CONFIG.linear_stages,
    )


def _mlp_fused(q_derope: torch.Tensor, p: SaapLayerParams, logits: torch.Tensor) -> None:
    """Launch :func:`_mlp_fused_kernel`: both layers in one launch, partials reduced by the last program."""
    b, hq, d = q_derope.shape
    hd, c = p.w2.shape[1], p.w2.shape[2]
    cfg = CONFIG
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


def saap_classifier_logits_triton(q_derope: torch.Tensor, params: SaapLayerParams) -> torch.Tensor:
    """Classifier logits of every query head: ``q_derope [B, Hq, D]`` -> ``[B, Hq, C]`` float32.

    ``softmax(-1)`` of the result is :func:`reference.classify_queries` (to float32 rounding).
    """
    p = params
    if p.w1.device != q_derope.device:
        raise ValueError(f"classifier weights on {p.w1.device}, query on {q_derope.device}")
    b, hq, _ = q_derope.shape
    hd, c = p.w2.shape[1], p.w2.shape[2]
    logits = _buffer((b, hq, c), torch.float32, q_derope.device)
    if CONFIG.cls_fused and p.w1.dtype == p.w2.dtype:  # mixed dtypes: the two-launch path
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
    b, hq, c = logits.shape
    n_l = min(int(top_l), c)
    hkv = hq // group
    sel = _buffer((b, hkv, n_l), torch.int32, logits.device)
    if n_l == 0:
        return sel
    _rank_kernel[(b * hkv,)](  # tl.topk needs k >= 2
        logits, sel, hkv, c, n_l, *logits.stride(),
        G=group, G_PAD=_pow2(group), C_PAD=max(2, _pow2(c)), K_PAD=max(2, _pow2(n_l)), num_warps=4,
    )
    return sel


def _index_tensors(state: BucketIndex | None, b: int, hkv: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``slot_start, bucket_count, slots`` of the index (a 1-slot dummy where there is nothing to read)."""
    if state is None:
        z = torch.zeros(b, hkv, 1, dtype=torch.int32, device=device)
        return z, z, z
    slots = state.slots
    if slots.shape[-1] == 0:
        slots = torch.zeros(b, hkv, 1, dtype=torch.int32, device=device)
    for name, t in (("slot_start", state.slot_start), ("bucket_count", state.bucket_count), ("slots", slots)):
        if t.device != device or t.dtype != torch.int32:
            raise ValueError(f"BucketIndex.{name} must be int32 on {device}, got {t.dtype} on {t.device}")
    return state.slot_start, state.bucket_count, slots


@dataclass
class _Partials:
    """How one attention call is cut into partials, and their buffers (see :func:`_partial_kernel`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lo: int
    hi: int
    scale: float
    n_dense: int
    win_tile: int
    n_win: int
    n_bkt_prog: int
    n_split: int
    n_per: int
    o: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor

    @property
    def n_part(self) -> int:
        return self.n_win + self.n_bkt_prog


def _plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_l: int, lo: int, hi: int,
          scale: float) -> _Partials:
    b, hq, d = q.shape
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    cfg = CONFIG
    n_dense = lo + (t - hi)
    win_tile = cfg.block_n * max(cfg.min_win_steps, triton.cdiv(n_dense, cfg.max_win_tiles * cfg.block_n))
    n_win = triton.cdiv(n_dense, win_tile)
    n_per = max(1, cfg.bkt_per_prog)
    n_split = max(1, cfg.bkt_split)
    n_bkt_prog = triton.cdiv(n_l, n_per) * n_split
    n_part = n_win + n_bkt_prog
    g = hq // hkv
    o, m, l_ = (_buffer(shape, torch.float32, q.device)
                for shape in ((b, hkv, n_part, g, d), (b, hkv, n_part, g), (b, hkv, n_part, g)))
    return _Partials(q, k_cache, v_cache, lo, hi, float(scale), n_dense, win_tile, n_win, n_bkt_prog, n_split,
                     n_per, o, m, l_)


def _launch_partials(pl: _Partials, state: BucketIndex | None, buckets: torch.Tensor | None, window: bool,
                     bucket: bool) -> None:
    """Launch :func:`_partial_kernel` for the window partials, the bucket partials, or both."""
    q, k_cache, v_cache = pl.q, pl.k, pl.v
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    p_base = 0 if window else pl.n_win
    n_prog = (pl.n_win if window else 0) + (pl.n_bkt_prog if bucket else 0)
    if n_prog == 0:
        return
    n_l = 0 if buckets is None else int(buckets.shape[-1])
    if n_l and bucket:
        sel = (buckets if buckets.dtype == torch.int32 else buckets.to(torch.int32)).contiguous()
    else:
        sel = torch.zeros(1, dtype=torch.int32, device=q.device)
    start, count, slots = _index_tensors(state if n_l and bucket else None, b, hkv, q.device)
    f32 = _interpreting() or q.dtype == torch.float32
    _partial_kernel[(b * hkv, n_prog)](
        q, k_cache, v_cache, sel, start, count, slots, pl.o, pl.m, pl.l,
        hkv, pl.lo, pl.hi, pl.n_dense, pl.win_tile, pl.n_win, pl.n_part, p_base, max(n_l, 1), pl.n_split,
        pl.n_per, pl.scale * LOG2E, *q.stride(), *k_cache.stride(), *v_cache.stride(), *start.stride(),
        *count.stride(), *slots.stride(),
        G=g, G_PAD=max(_ROWS, _pow2(g)), D=d, D_PAD=_pow2(d), BLOCK_N=CONFIG.block_n, F32=f32,
        num_warps=CONFIG.attn_warps, num_stages=CONFIG.attn_stages,
    )


def _merge(pl: _Partials) -> torch.Tensor:
    q = pl.q
    b, hq, d = q.shape
    hkv = pl.k.shape[1]
    g = hq // hkv
    out = _buffer((b, hq, d), q.dtype, q.device)
    block_d = min(_pow2(d), CONFIG.merge_block_d)
    _merge_kernel[(b * hkv, triton.cdiv(d, block_d))](
        pl.o, pl.m, pl.l, out, hkv, pl.n_part, *out.stride(),
        G=g, G_PAD=_pow2(g), D=d, BLOCK_D=block_d, BLOCK_P=CONFIG.merge_block_p, num_warps=4,
    )
    return out


def saap_sparse_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 state: BucketIndex | None, buckets: torch.Tensor | None, lo: int, hi: int,
                                 scale: float) -> torch.Tensor:
    """Attention over the dense region ``[0, lo) ∪ [hi, T)`` plus all keys of ``buckets``, merged exactly.

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, T, D]; buckets: [B, Hkv, L] int32 bucket ids of ``state``
    (or None: dense region only); ``lo = hi = 0``: the whole cache. Returns [B, Hq, D] in q.dtype.
    """
    n_l = 0 if buckets is None else int(buckets.shape[-1])
    pl = _plan(q, k_cache, v_cache, n_l, lo, hi, scale)
    _launch_partials(pl, state, buckets, True, True)
    return _merge(pl)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _sparse_step(q: torch.Tensor, q_derope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 state: BucketIndex, params: SaapLayerParams, top_l: int, lo: int, hi: int, scale: float
                 ) -> torch.Tensor:
    """Classifier, ranking, partials, merge. ``CONFIG.overlap_window`` (CUDA): the window partials run on a
    side stream while the classifier and ranking run (fork and join by events: graph-capturable)."""
    hkv = k_cache.shape[1]
    c = params.w2.shape[-1]
    pl = _plan(q, k_cache, v_cache, min(int(top_l), c), lo, hi, scale)
    overlap = bool(CONFIG.overlap_window) and q.is_cuda and not _interpreting()
    if overlap:
        main = torch.cuda.current_stream(q.device)
        side = _side_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _launch_partials(pl, None, None, True, False)
    logits = saap_classifier_logits_triton(q_derope, params)
    buckets = saap_rank_buckets_triton(logits, q.shape[1] // hkv, top_l)
    _launch_partials(pl, state, buckets, not overlap, True)
    if overlap:
        main.wait_stream(side)
    return _merge(pl)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [B, Hq, D], k/v [B, Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[-1] != d or hq % k_cache.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the SAAP kernel takes bf16, fp16 or float32, got {q.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a unit stride along D")


def saap_decode_attention_triton(q: torch.Tensor, q_derope: torch.Tensor | None, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, state: BucketIndex | None,
                                 artifact_layer: SaapLayerParams, *, top_l: int, scale: float | None = None
                                 ) -> torch.Tensor:
    """SAAP attention of one decode step, as :func:`saap_decode_attention_reference`.

    q: [B, Hq, D] RoPE'd query; q_derope: [B, Hq, D] (classifier input); k_cache, v_cache:
    [B, Hkv, T, D] (current token last); state: the layer's :class:`BucketIndex` for these T keys.
    Returns [B, Hq, D] in q.dtype. No host synchronization. float64 inputs run the reference.
    """
    if q.dtype == torch.float64:
        return saap_decode_attention_reference(q, q_derope, k_cache, v_cache, state, artifact_layer, top_l, scale)
    _check(q, k_cache, v_cache)
    d = q.shape[-1]
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    params = artifact_layer
    if params.dense:
        return saap_sparse_attention_triton(q, k_cache, v_cache, None, None, 0, 0, scale)
    if state is None or state.length != t:
        raise ValueError(f"bucket index covers {None if state is None else state.length} keys, cache has {t}")
    lo, hi = searchable_range(t, params.sink, params.recent)
    if hi == lo or top_l <= 0:
        return saap_sparse_attention_triton(q, k_cache, v_cache, None, None, lo, hi, scale)
    if q_derope is None:
        raise ValueError("a non-dense SAAP layer needs q_derope")
    return _sparse_step(q, q_derope, k_cache, v_cache, state, params, top_l, lo, hi, scale)
