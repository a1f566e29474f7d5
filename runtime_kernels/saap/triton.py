"""SAAP decode attention in Triton: same arguments, same result as
:func:`runtime_kernels.saap.reference.saap_decode_attention_reference` (papers/saap.txt App. F).

One decode step of one layer in five launches and no host sync (Python ints from shapes size the grids,
so the step can be captured in a CUDA graph); the defaults in :class:`SaapTritonConfig` are what measured
fastest on the H200 (two-launch classifier, no side stream); the alternatives below stay selectable:

1-2. Classifier and ranking (:mod:`runtime_kernels.saap.triton_classifier`): the classifier MLP of every
   query head, then one program per (batch, KV head) sums the group's softmaxes and takes the top-ℓ.
3. :func:`_partial_kernel`: one program per (batch, KV head, partial). Partials ``0 .. n_win-1`` are tiles
   of the dense region (sink + recent window: positions ``[0, lo) ∪ [hi, T)``, the current key
   included); partials ``n_win ..`` are the ℓ visited buckets (small buckets packed several per program as
   one key list, ``CONFIG.bkt_pack``: auto 8 at 8k, 2 at 32k, off at 128k with C = 1024 — 8k B=8 ℓ=64
   84.3 -> 65.3 µs on the H200; else ``CONFIG.bkt_per_prog`` buckets per program in turn, or a bucket
   split over ``CONFIG.bkt_split`` programs), each bucket walking its slice of the
   :class:`BucketIndex` slot array (``slots[b, h, slot_start[c] : slot_start[c] + bucket_count[c]]``: the
   index's own CSR-with-slack layout, read as is: no repacking, no ``csr()``). Each gathered K/V row is
   loaded once for all ``G`` query heads of the group (``q`` is a ``[16, D]`` tile; ``tl.dot`` with fp32
   accumulation), online softmax in exp2 units; writes ``(o, m, l)`` in float32. An empty bucket writes
   ``m = -inf, l = 0`` and weighs nothing in the merge.
4. :func:`_merge_kernel`: exact log-sum-exp merge of the partials, one program per (batch, KV head,
   32 output columns), 64 partials per vector load (one step for the usual 36-48: ``merge_block_p``).

A dense layer (``params.dense``) is steps 3-4 with the whole cache as the window (flash-decoding).

Performance model (Llama-3.1-8B: Hq = 32, Hkv = 8, D = 128, bf16 K/V and classifier weights, C = 1024,
hidden 1024, window 1 + 2047, balanced buckets of ``N_s / C`` keys, ``N_vis = 2048 + ℓ · N_s / C``):

* classifier, B ≤ ``cls_bmm_max_b`` (16, the default path): layer 1 (on tensor cores for a query of the
  weights' 16-bit dtype, whose products are exact in fp32: 7.7 µs alone at B=8 vs 15.5 for the CUDA-core
  GEMV it replaced, ~1 µs less at B=1; the GEMV for float32 queries) whose epilogue writes the hidden as
  three bf16 terms, layer 2 as one cuBLAS ``bmm`` (float32 output, ``l2_triton = 0``) over the
  query heads, the ranking summing the three term rows: float32-exact logits with w2 streamed at 3.3
  TB/s (20 µs). Measured with the ranking at 128k B=1: 35 µs (H200 2026-11-21, read-flushed L2) vs 43 µs
  for the GEMV path (``cls_bmm_max_b = 0``, B ≤ ``cls_gemv_max_b``: layer 2 in 4 hidden chunks at 2.35
  TB/s) and 48 µs for the tensor-core path. Since 2026-11-21 20:00 layer 2 is Triton's own w2 stream
  (``l2_triton``: ``[64, 128]`` tiles 4 deep, the three terms stacked in one 16-row tile and summed in its
  epilogue, so the ranking reads one logits row instead of three): 128k B=1 step 47.5 -> 45.7 µs, 8k B=8
  69.2 -> 67.7; and the ranking places its filtered candidates by counting (``rank_count``) under a
  threshold from 2ℓ chunk maxima (``rank_chunks``: ~44 candidates instead of ~110, never the full sort
  on the bench's flat classifier). Alone, layer 2 streams like cuBLAS (19.8 vs 19.5 µs at B=1); the gain
  is the ranking reading one row instead of three. Session 11: layer 2 adds ``b2`` in its epilogue
  (``l2_bias``: the bias's cold DRAM load leaves the ranking's critical path) and the filtered candidates
  are sorted again (``rank_count = 0``: 0.6-1.0 µs faster in the step than counting): 128k B=1 45.0 ->
  43.7 µs. Left: layer 1 (~6 µs in sequence, latency) and the ranking (~4.6 µs in sequence: launch 1.2,
  logits load 1.0, group scores 1.0, threshold + compaction 1.2, sort 0.4; ``docs/bench/2026-11-21-h200/
  saap_rank_b2.txt`` also has what did not pay: TMA w2 tiles, the ranking on layer 2's last programs or
  inside the bucket programs, layer-2 softmax statistics, an L2 prefetch of the index rows).
* tried and removed (H200, graphed, 128k B=1): the merge done by the last partial program instead of its
  own launch (58.2 vs 51.0 µs: one program per row merges slower than the launch's four), and the window
  partials inside the ranking's launch on the SMs its B·Hkv programs leave idle (53.7 vs 51.2 µs: the
  combined kernel carries the ranking's registers into every window program);
  ``docs/bench/2026-11-21-h200/saap_santa_variants_late.txt``; and ranking -> partials -> merge as
  programmatic dependent launches (window partials beside the ranking, bucket partials waiting for it):
  no gain once the variants' order was rotated (128k B=8 105.7 vs 105.0-105.6 µs, B=1 49.7 vs 50.0;
  the first variant timed in a run reads ~7 µs slow, which an earlier run had taken for a PDL gain;
  ``docs/bench/2026-11-21-h200/saap_win_programs.txt``). SANTA-prop keeps its chain (it gains there).
  Also removed: layer 2 as Triton programs that each request their whole w2 slice (64 KB) before
  waiting for layer 1 as its programmatic dependent, the ranking chained after (to hide layer 1's ~7 µs
  under the weight stream): classifier + ranking 38.9-56.8 µs across block shapes vs 33.9 for layer 1 +
  cuBLAS + ranking at 128k B=1, 52-80 vs 42.3 at B=8; the chain itself bought ~2 µs
  (``docs/bench/2026-11-21-h200/saap_prefetch_l2.txt``). Session 10 (``saap_layer2_triton.txt``): layer 1's
  programs first asking L2 for part of w2 (``cp.async.bulk.prefetch.L2``, 25-100 % of each head's rows)
  made the classifier 1.7-6 µs slower; the Triton layer 2 as layer 1's programmatic dependent, its first
  one or two w2 tiles requested before ``gdc_wait``: +6 µs at 128k B=1; both layers in one split-K launch
  (each program a 128-unit hidden slice and its share of every logit; partials summed by the ranking):
  46.2 vs 45.3 µs at 128k B=1, 64-unit slices +20 µs. All three removed.
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
    raise ModuleNotFoundError("runtime_kernels.saap.triton needs the 'triton' package",
                              name="triton") from exc

from runtime_kernels._triton_support import patch_interpreter
from runtime_kernels._triton_support import interpreting as _interpreting
from runtime_kernels.saap.reference import (
    BucketIndex,
    SaapLayerParams,
    check_index_fits,
    dense_region,
    saap_decode_attention_reference,
)
from runtime_kernels.saap.triton_classifier import (  # public API of this module too (__all__)
    saap_classifier_logits_triton,
    saap_rank_buckets_triton,
    saap_select_buckets_triton,
)
from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.triton_config import ROWS as _ROWS, buffer as _buffer, pow2 as _pow2

LOG2E = 1.4426950408889634




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
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, start_ptr, count_ptr, slots_ptr, o_ptr, m_ptr, l_ptr, len_ptr,
    n_kv, lo, hi, n_dense, win_tile, n_win, n_part, p_base, L, n_split, n_per, qk_scale,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sst_b, sst_h, sst_c, scn_b, scn_h, scn_c, ssl_b, ssl_h, ssl_s,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, F32: tl.constexpr, PREFETCH_V: tl.constexpr, PACK: tl.constexpr = 0,
    HAS_LEN: tl.constexpr = False,
):
    """One partial softmax ``(o [G, D], m [G], l [G])`` of the query heads of one (batch, KV head).

    Partial ``p = p_base + program_id(1)``. ``p < n_win``: dense-region keys
    ``j ∈ [p·win_tile, min((p+1)·win_tile, n_dense))`` at position ``j`` if ``j < lo`` else ``j + hi - lo``.
    ``p >= n_win``: with ``r = p - n_win``, the selected buckets ``sel[b, h, e]`` for
    ``e ∈ [(r // n_split)·n_per, +n_per) ∩ [0, L)``, of each bucket ``c`` its ``(r % n_split)``-th chunk of
    ``ceil(count / n_split)`` keys, positions ``slots[b, h, slot_start[b, h, c] + i]``,
    ``i < bucket_count[b, h, c]``. ``m`` is in log2 units (scores times ``scale · log2 e``), ``-inf`` and
    ``l = 0`` when the partial has no key. ``PACK > 0`` (``CONFIG.bkt_pack``, small buckets): bucket
    program ``r`` walks the concatenation of the keys of buckets ``e ∈ [r·PACK, (r+1)·PACK) ∩ [0, L)``
    (``n_per = PACK``, ``n_split = 1``) in ``BLOCK_N``-key steps: their ids, slot starts and counts are
    loaded as vectors at once and a key's slot comes from the counts' prefix sum, so PACK buckets of a
    few keys cost one program and one chain of dependent loads instead of PACK of each.
    ``HAS_LEN`` (a static-cache step): the cache holds ``len[b]`` valid keys of the ``T`` the grid was
    sized for, so the dense region of row ``b`` ends at ``len[b]`` (window tiles past it are empty).
    Partials are contiguous ``o [B, Hkv, P, G, D]``,
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
    n_dense_b = n_dense
    if HAS_LEN:  # the valid length, read on the device: the grid stays sized for the view
        n_dense_b = (tl.load(len_ptr + b) - hi + lo).to(tl.int32)
    if PACK > 0:
        n_seg = 1
    else:
        n_seg = tl.where(is_bkt, tl.minimum(n_per, L - e0), 1)
    m_i = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for e in range(0, n_seg):
        if PACK > 0:  # PACK buckets as one list: ids, starts, counts as vectors; slot of key i by prefix sum
            e_idx = e0 + tl.arange(0, PACK)
            e_ok = (e_idx < L) & ((e_idx * 0 + p) >= n_win)
            cs = tl.load(sel_ptr + pid.to(tl.int64) * L + e_idx, mask=e_ok, other=0)
            st = tl.load(start_ptr + b64 * sst_b + h * sst_h + cs * sst_c, mask=e_ok, other=0)
            cn = tl.load(count_ptr + b64 * scn_b + h * scn_h + cs * scn_c, mask=e_ok, other=0)
            inc = tl.cumsum(cn, 0)
            exc = inc - cn
            delta = st - exc  # slot of key i of bucket e = i + delta[e] for exc[e] <= i < inc[e]
            slot0 = 0
            n_bkt = tl.sum(cn, 0)
        else:
            c = tl.load(sel_ptr + pid.to(tl.int64) * L + e0 + e, mask=is_bkt, other=0)
            slot0 = tl.load(start_ptr + b64 * sst_b + h * sst_h + c * sst_c, mask=is_bkt, other=0)
            n_bkt = tl.load(count_ptr + b64 * scn_b + h * scn_h + c * scn_c, mask=is_bkt, other=0)
        chunk = (n_bkt + n_split - 1) // n_split
        i_lo = tl.where(is_bkt, part * chunk, 0)
        i_hi = tl.where(is_bkt, tl.minimum(n_bkt, i_lo + chunk), tl.minimum(win_tile, n_dense_b - j_first))
        slot_base = slots_ptr + b64 * ssl_b + h * ssl_h + slot0 * ssl_s
        for n0 in range(i_lo, i_hi, BLOCK_N):
            i = n0 + offs_n
            k_ok = i < i_hi
            j = j_first + i
            pos_w = tl.where(j < lo, j, j + (hi - lo))
            # the scalar flag is broadcast by hand: Triton 3.9's interpreter rejects vector & scalar masks
            if PACK > 0:
                hit = (i[:, None] >= exc[None, :]) & (i[:, None] < inc[None, :])
                slot = i + tl.sum(tl.where(hit, delta[None, :], 0), 1)
            else:
                slot = i
            pos_b = tl.load(slot_base + slot * ssl_s, mask=k_ok & ((i * 0 + p) >= n_win), other=0)
            pos = tl.where(is_bkt, pos_b, pos_w)
            kt = tl.load(k_base + pos[None, :] * sk_t + offs_d[:, None] * sk_d,
                         mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [D_PAD, BLOCK_N]
            if PREFETCH_V:  # issue the V gather with K's: one memory round trip per step instead of two
                v = tl.load(v_base + pos[:, None] * sv_t + offs_d[None, :] * sv_d,
                            mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            s = _mma(q, kt, F32) * qk_scale  # [G_PAD, BLOCK_N], log2 units
            s = tl.where(k_ok[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            if not PREFETCH_V:
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
    pack: int = 0  # > 0: bucket programs walk this many buckets as one key list (_pack)
    cache_len: torch.Tensor | None = None  # [B] valid keys of a static-cache view (the kernel's HAS_LEN)

    @property
    def n_part(self) -> int:
        return self.n_win + self.n_bkt_prog


def _pack(n_keys: int, n_buckets: int | None) -> int:
    """Buckets per bucket program (``0``: one each, as cut by ``bkt_per_prog`` / ``bkt_split``).
    ``CONFIG.bkt_pack < 0`` (auto): the largest power of two of buckets whose mean size
    ``n_keys / n_buckets`` (host ints: no sync) fills at most one ``block_n`` key step, 8 at most, none
    below 2 — packed at 8k and 32k with C = 1024 (6 and 30 keys per bucket), not at 128k (126)."""
    cfg = _tc.CONFIG
    if cfg.bkt_pack > 0 and cfg.bkt_pack & (cfg.bkt_pack - 1):
        raise ValueError(f"SaapTritonConfig.bkt_pack must be a power of two, 0 or -1 (auto), got {cfg.bkt_pack}")
    if cfg.bkt_pack >= 0:
        return cfg.bkt_pack
    if not n_buckets or n_keys <= 0:
        return 0
    fit = cfg.block_n * n_buckets // max(1, n_keys)  # buckets of mean size per key step
    pack = 1 << (max(1, min(fit, 8)).bit_length() - 1)
    return pack if pack >= 2 else 0


def _plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_l: int, lo: int, hi: int,
          scale: float, n_buckets: int | None = None, cache_len: torch.Tensor | None = None) -> _Partials:
    b, hq, d = q.shape
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    cfg = _tc.CONFIG
    n_dense = lo + (t - hi)
    max_tiles = cfg.max_win_tiles
    if cfg.win_programs > 0:  # fewer, longer window tiles when the batch already fills the GPU
        max_tiles = max(1, min(max_tiles, triton.cdiv(cfg.win_programs, b * hkv)))
    win_tile = cfg.block_n * max(cfg.min_win_steps, triton.cdiv(n_dense, max_tiles * cfg.block_n))
    n_win = triton.cdiv(n_dense, win_tile)
    pack = _pack(hi - lo, n_buckets)
    n_per = pack if pack > 0 else max(1, cfg.bkt_per_prog)
    n_split = 1 if pack > 0 else max(1, cfg.bkt_split)
    n_bkt_prog = triton.cdiv(n_l, n_per) * n_split
    n_part = n_win + n_bkt_prog
    g = hq // hkv
    o, m, l_ = (_buffer(shape, torch.float32, q.device)
                for shape in ((b, hkv, n_part, g, d), (b, hkv, n_part, g), (b, hkv, n_part, g)))
    return _Partials(q, k_cache, v_cache, lo, hi, float(scale), n_dense, win_tile, n_win, n_bkt_prog, n_split,
                     n_per, o, m, l_, pack, cache_len)


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
    length = pl.cache_len if pl.cache_len is not None else sel  # any int tensor when HAS_LEN is off
    _partial_kernel[(b * hkv, n_prog)](
        q, k_cache, v_cache, sel, start, count, slots, pl.o, pl.m, pl.l, length,
        hkv, pl.lo, pl.hi, pl.n_dense, pl.win_tile, pl.n_win, pl.n_part, p_base, max(n_l, 1), pl.n_split,
        pl.n_per, pl.scale * LOG2E, *q.stride(), *k_cache.stride(), *v_cache.stride(), *start.stride(),
        *count.stride(), *slots.stride(),
        G=g, G_PAD=max(_ROWS, _pow2(g)), D=d, D_PAD=_pow2(d), BLOCK_N=_tc.CONFIG.block_n, F32=f32,
        PREFETCH_V=bool(_tc.CONFIG.attn_prefetch_v), PACK=pl.pack, HAS_LEN=pl.cache_len is not None,
        num_warps=_tc.CONFIG.attn_warps, num_stages=_tc.CONFIG.attn_stages,
    )


def _merge(pl: _Partials) -> torch.Tensor:
    q = pl.q
    b, hq, d = q.shape
    hkv = pl.k.shape[1]
    g = hq // hkv
    out = _buffer((b, hq, d), q.dtype, q.device)
    block_d = min(_pow2(d), _tc.CONFIG.merge_block_d)
    _merge_kernel[(b * hkv, triton.cdiv(d, block_d))](
        pl.o, pl.m, pl.l, out, hkv, pl.n_part, *out.stride(),
        G=g, G_PAD=_pow2(g), D=d, BLOCK_D=block_d, BLOCK_P=_tc.CONFIG.merge_block_p, num_warps=4,
    )
    return out


def saap_sparse_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 state: BucketIndex | None, buckets: torch.Tensor | None, lo: int, hi: int,
                                 scale: float, cache_len: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the dense region ``[0, lo) ∪ [hi, T)`` plus all keys of ``buckets``, merged exactly.

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, T, D]; buckets: [B, Hkv, L] int32 bucket ids of ``state``
    (or None: dense region only); ``lo = hi = 0``: the whole cache (flash-decoding). ``cache_len [B]``
    (int64, device): only the first ``cache_len[b]`` keys are valid (the dense region ends there).
    Returns [B, Hq, D] in q.dtype.
    """
    n_l = 0 if buckets is None else int(buckets.shape[-1])
    pl = _plan(q, k_cache, v_cache, n_l, lo, hi, scale, None if state is None else state.bucket_count.shape[-1],
               cache_len)
    _launch_partials(pl, state, buckets, True, True)
    return _merge(pl)


__all__ = ["saap_classifier_logits_triton", "saap_decode_attention_triton", "saap_rank_buckets_triton",
           "saap_select_buckets_triton", "saap_sparse_attention_triton"]

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _sparse_step(q: torch.Tensor, q_derope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 state: BucketIndex, params: SaapLayerParams, top_l: int, lo: int, hi: int, scale: float,
                 cache_len: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier, ranking, partials, merge. ``CONFIG.overlap_window`` (CUDA): the window partials run on a
    side stream while the classifier and ranking run (fork and join by events: graph-capturable)."""
    hkv = k_cache.shape[1]
    c = params.w2.shape[-1]
    pl = _plan(q, k_cache, v_cache, min(int(top_l), c), lo, hi, scale, c, cache_len)
    overlap = bool(_tc.CONFIG.overlap_window) and q.is_cuda and not _interpreting()
    if overlap:
        main = torch.cuda.current_stream(q.device)
        side = _side_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _launch_partials(pl, None, None, True, False)
    buckets = saap_select_buckets_triton(q_derope, params, q.shape[1] // hkv, top_l)
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
                                 artifact_layer: SaapLayerParams, *, top_l: int, scale: float | None = None,
                                 cache_len: torch.Tensor | None = None) -> torch.Tensor:
    """SAAP attention of one decode step, as :func:`saap_decode_attention_reference`.

    q: [B, Hq, D] RoPE'd query; q_derope: [B, Hq, D] (classifier input); k_cache, v_cache:
    [B, Hkv, T, D] (current token last); state: the layer's :class:`BucketIndex` (its lists may end
    before ``T - recent``: the keys after them are attended with the window, :func:`dense_region`).
    ``cache_len [B]`` (int64, device; a static-cache step): keys past it are not valid. Returns
    [B, Hq, D] in q.dtype. No host synchronization. float64 inputs run the reference.
    """
    if q.dtype == torch.float64:
        if cache_len is not None:
            t = int(cache_len.max())
            k_cache, v_cache = k_cache[:, :, :t], v_cache[:, :, :t]
        return saap_decode_attention_reference(q, q_derope, k_cache, v_cache, state, artifact_layer, top_l, scale)
    _check(q, k_cache, v_cache)
    d = q.shape[-1]
    t = k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    params = artifact_layer
    if params.dense:
        return saap_sparse_attention_triton(q, k_cache, v_cache, None, None, 0, 0, scale, cache_len)
    check_index_fits(state, t, params)
    lo, hi = dense_region(state, params)
    if hi == lo or top_l <= 0:
        return saap_sparse_attention_triton(q, k_cache, v_cache, None, None, lo, hi, scale, cache_len)
    if q_derope is None:
        raise ValueError("a non-dense SAAP layer needs q_derope")
    return _sparse_step(q, q_derope, k_cache, v_cache, state, params, top_l, lo, hi, scale, cache_len)
