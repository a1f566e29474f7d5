"""S²ANTA decode kernels in Triton: prop and flash tilings (papers/santa.txt §3, App. P, Q).

Backend contract of ``reference.santa_decode_forward`` (``api.santa_decode_attention`` picks it on CUDA);
``tiling="none"``, float64 or mixed dtypes, head_dim > 256 or > 16384 tiles go to the reference. bf16 /
fp16 on the GPU, float32 anywhere (the CPU interpreter runs float32 only); any batch, GQA group size,
head_dim and tile length (padded to powers of two inside), odd cache lengths, arbitrary strides.

Sampling rule = the reference's: tile t of head h with budget ``S_t`` and offset ``u = uniforms[b, h, t]``
gives key n ``c(C_n) - c(C_{n-1})`` samples, ``c(C) = clamp(ceil(S_t·C/Z - u), 0, S_t)``, ``C`` the
inclusive cumulative in-tile weight, ``Z`` the tile total. The float32 weights ``exp(s - m_t) <= 1``
become int64 fixed point (``floor(w·2^32)``) before the prefix sum, so ``C_{n-1} = C_n - w_n`` exactly:
counts are never negative and sum to ``S_t`` exactly; ``S_t·C/Z - u`` is float64. Counts match the
float64 reference except where ``S_t·C_n/Z - u`` lies within float32 score rounding of an integer.

Kernels (the G = Hq/Hkv query heads of a KV head share each K/V load; ``CONFIG`` / ``VARIANTS`` /
env ``SANTA_TRITON_VARIANT`` pick launch knobs, ``santa_stages`` launches each stage alone for timing):

* ``_score_kernel`` (prop, and flash in ``split`` mode): one program = ``score_tpp`` tiles of one KV
  head, K streamed in chunks of ``score_bk`` keys by a software-pipelined loop (cp.async, ``score_stages``
  deep); stores float32 scores ``[B·Hq, Tk_pad]`` and per tile ``m_t`` and ``ℓ_t = Σ exp(s - m_t)``
  (online over the chunks: ℓ_t differs from a one-shot sum by float32 rounding only; counts are
  computed from the stored scores and do not depend on it).
* ``_prop_budget_kernel``: one program per query head: largest-remainder budgets (float64 masses;
  fractional parts on a 2^-20 grid ranked by a radix select; ties to the lower tile); zeroes the
  output accumulator. ``_prop_gather_kernel``: ``gather_tiles`` (2) tiles per program, all heads of
  the group; rows without budget skip; the others resolve each sample j to its key ``#{n : C_n <=
  (j + u)·Z/S_t}`` (= ``#{n : c(C_n) <= j}``), load just those V rows, sum the program's tiles and add
  them with float32 atomics; the last program of a (b, kv head) writes ``acc / S``. Default
  (``gather_chunks``): the sample's 32-key chunk is found first from per-chunk statistics the score pass
  stores (two floats per chunk and head), then only that chunk's scores are read and summed; the
  whole-tile variant prefix-sums every key of the tile in int64 fixed point (exact, so counts match the
  reference wherever float64 does; the chunked one is float32 within a chunk, ~1e-7 relative, the same
  order as the scores' own rounding, which the count tolerance already covers).
* ``_flash_stream_kernel`` (flash default, ``flash_mode="stream"``): one program per tile streams the
  tile's K chunks like ``_score_kernel`` (scores stored), then after a CTA barrier re-reads them (L1/L2)
  and does the tile's counts, sampled V rows and partial as ``_flash_kernel`` below (from 128 tiles,
  ``flash_chunk_tiles``: chunk statistics kept in registers as K streams, each sample's chunk located
  from them and only that chunk's scores re-read, as the prop gather);
  ``_flash_merge_kernel`` (``flash_merge="launch"``) then merges each (batch, KV head)'s partials, one
  program per 32 output columns, 16 partials per pipelined load step. Measured (H200, 32k, eager stage
  times): B=1 38 + 13 µs vs the split mode's 23 + 48; B=8 230 + 17 vs 136 + 160 — the inline
  two-level merge below costs 25-60 µs (a chain of dependent L2 round trips per row).
* ``_sum_tiles_kernel`` (prop with ``prop_reduce="launch"``): per-tile sums stored by the gather, summed
  in tile order (deterministic; 5 µs slower than the atomics at 32k B=1, so not the default).
* ``_flash_kernel``: per tile, scores (stored ones, or q·K in the kernel when ``FUSED``),
  ``S_tile = max(1, round_half_up(S/T_b))``, counts, the sampled V rows (``flash_values="rows"``, as
  prop) or ``counts @ V`` over the row-masked V tile (``"dot"``, exact base-256 digits), the partial
  ``(m_t, ℓ_t, ℓ_t·μ̂_t)``; log-sum-exp merge: the last tile of each group of <= 16 merges the group,
  the last group the row.

The launch counters are one int32 buffer per device, zeroed once and reset by each launch's last program.

Performance model (Llama-3.1-8B decode: Hq=32, Hkv=8, D=128, bf16, N keys; H200 ~4.2 TB/s):

* Dense floor: K+V = ``2·N·Hkv·D·2`` B per batch row = 128 MiB at N=32k ≈ 32 µs.
* score pass: all of K (67 MB at 32k, 16 µs) + float32 scores written (``N·Hq·4`` = 4 MB per batch row).
  FLOPs ``2·N·Hq·D``: memory bound. ptxas sm_90 at 64-key chunks, 3 deep, 4 warps (the first pipelined
  config): 58 regs, 34 KB smem (2 chunks of 16 KB in flight per program, ~6 programs = 192 KB per SM) vs
  164-255 regs / 1 tile in registers before; now 32-key chunks 4 deep at 2 warps (3 chunks of 8 KB in
  flight, smaller programs: more of them resident, measured faster, see ``KernelConfig``).
* prop: score pass (+ chunk statistics: ``2·N/32·Hq·4`` B, 1/16 of the scores) + budgets (32 programs
  at B=1; T=128 tiles: ~2-3 µs, latency) + gather (per sample one 128 B chunk of scores and one V row;
  <= S of each per head; ~3-5 µs at B=1). Measured 32k B=8 (ncu, session 13): score pass 4.0 TB/s =
  83 % of DRAM peak; the whole-tile gather was instruction-bound (45-50 µs), the chunked one 42-45.
  Predicted 32k B=1: ~17 + 3 + 4 + launch gaps ≈ 25 µs (target 22.8).
* flash split: score pass + one tile kernel (reads 4 KB of scores per tile + S_tile·G V rows, 95 regs
  / 8 KB smem, so ~5 programs per SM; before: 117 regs + 66 KB smem = 2 per SM, K in registers).
  Predicted 32k B=1: 17 + ~6 ≈ 23-26 µs (target 25.6); B=8 128k: K 511 µs + scores 2·134 MB
  (64 µs) + V rows ≈ 620 µs (SDPA 961).
* Measured and removed (H200, session 15; records and patches in docs/bench/2026-11-21-h200): prop's
  budgets + gather as one program per query head at small B·Hq (32k B=1 33.8 -> 41.8 µs:
  ``santa_prop_head.txt``); flash's whole-tile tail as counts @ V in key steps (8k B=8 S=1024 72.4 ->
  86.1: ``santa_flash_chunkdot.txt``) or with the tile's scores kept in registers (-> 79.0:
  ``santa_flash_keep_scores.txt``).
* Launches: prop 3 (chained by programmatic dependent launch on sm_90+: ``CONFIG.pdl``), flash 2
  (stream + merge; split with inline merge 2, fused 1), + the api's offset draw; no host syncs, no
  per-call memsets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime_kernels._triton_support import arrival_counters, interpreting, patch_interpreter, pdl_available
from runtime_kernels.santa import reference
from runtime_kernels.santa.reference import DecodeSamples
from runtime_kernels.santa.triton_device import (
    _load_group_q,
    _tile_keys,
    _tile_scores,
    _systematic_counts,
    _gather_samples,
    _gather_by_thresholds,
    _gather_by_chunks,
    _store_rows,
    _prop_budgets,
    _flash_tile,
    _flash_merge,
    _merge_partials,
    _online_chunk,
    _flash_tile_budget,
    _store_flash_partial,
)
from runtime_kernels.santa.tiling import flash_tile_budget, num_tiles

_INTERPRET = interpreting()
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
MAX_TILES = 16384  # one program ranks all tiles of a head in registers when computing prop budgets
_FRAC_BITS = 20  # prop fractional parts are ranked at 2^-20 resolution (ties: lower tile)
patch_interpreter()



@dataclass(frozen=True)
class KernelConfig:
    """Launch knobs (tunable on the GPU; results do not depend on them beyond float32 rounding of ℓ_t).

    score_bk: keys per K chunk of the score pass (a power of two; the tile is streamed in chunks, ℓ_t
    kept online); score_stages: software-pipeline depth of the chunk loop (cp.async buffers);
    score_tpp: tiles per score program; flash_mode: ``split`` (the shared score pass, then a gather /
    merge kernel over the stored scores), ``fused`` (one kernel: scores, counts, V, merge; K tile in
    registers) or ``stream`` (one kernel per tile: the score pass's pipelined K chunks, then the tile's
    counts and V rows from the scores it just stored); flash_merge: ``inline`` (the last tile of each
    group merges it, the last group the row: arrival counters) or ``launch`` (a separate merge kernel).
    """

    score_bk: int = 32  # H200 2026-11-21, graphed, variants in their own processes, at 2 warps (jobs/run41.sh,
    score_stages: int = 4  # santa_variants_bk32.txt): 32-key chunks 4 deep vs 64 x 3: 32k B=1 prop 39.5 -> 37.4 us,
    #   flash S=2048 48.8 -> 42.6; B=8 8k flash 93.2 -> 86.5, 32k 2-4 % faster; 8k B=1 prop +1.4 us
    score_tpp: int = 1
    score_warps: int = 2  # H200 2026-11-21, graphed, each variant in its own process (santa_variants_1845.txt):
    #   2 warps vs 4 for score / gather / flash gather: B=8 8k prop S=128 70.0 -> 63.6 us, flash S=2048 114.1 ->
    #   93.4, 32k 5-13 % faster; B=1 equal or better (the programs are latency-bound; more fit per SM)
    budget_heads: int = 1  # query heads per budget program (divides Hq; 1 = one program per head)
    gather_warps: int = 2  # per tile of a gather program (a program of gather_tiles tiles has gather_warps·tiles)
    gather_maxnreg: int = 0  # prop gather: register cap per thread (0: the compiler's choice: 93-96, ~10 programs
    #   per SM). ncu, 32k B=8: the gather issues an instruction every 1.7 cycles per scheduler at 13 % of DRAM
    #   bandwidth, so it is instruction-bound more than latency-bound; caps of 48-80 (spills) gained nothing
    gather_thresh: bool = False  # prop gather: samples located by one int64 threshold each (no per-key float64);
    #   with gather_samples=2 the fastest at 32k B=8 (185.4-186.7 us) but at 8k B=8 S=256 level with SDPA (67.6-68.1
    #   vs 67.9-69.5): not the default
    gather_chunks: bool = True  # prop gather: samples located chunk first from the score pass's per-chunk
    #   statistics, one score_bk-key chunk of scores read per sample (_gather_by_chunks), instead of every tile
    #   with a budget re-read and prefix-summed whole. H200 2026-11-22 graphed, each variant in its own process
    #   (run 86, santa_chunked_gather.txt), vs the whole-tile gather ("full"): 32k B=8 S=128 188.6 -> 178.6 us,
    #   32k B=1 36.0 -> 33.7, 8k B=8 S=128 61.6 -> 59.3; 8k B=8 S=256 65.0 -> 66.6 (8 samples per tile: 2 steps
    #   of dependent chunk loads; still under SDPA's 68.0). Gather stage alone, 32k B=8: 50.4 -> 44.8 us
    gather_tiles: int = 2  # prop gather: tiles per program (power of two; its [GP·tiles, tile] block <= 8192).
    #   H200 2026-11-21 graphed, runs 79-84 (docs/bench/2026-11-21-h200/santa_gather_variants.txt): 1 -> 2 tiles:
    #   32k B=8 S=128 196-198 -> 188.5-191.2 us, 32k B=1 37.5 -> 35.7-36.1, 8k B=8 63 -> 61.2-61.8; 4 tiles (8 warps,
    #   2 programs per SM by registers) and a register cap (maxnreg 64 / 80: spills) slower or no gain
    gather_samples: int = 4  # prop gather: samples per head resolved to keys per step ([GP, this, tile] compare;
    #   H200 eager gather stage, 16 / 8 / 4: 32k B=1 21.8 / 22.1 / 16.3 µs, B=8 100.7 / 86.0 / 80.3, 8k B=8 36.4 / 31.6 / 29.9)
    flash_samples: int = 16  # the same for flash's tiles (32k B=1 stream: 16 -> 37.6 us, 8 -> 42.0)
    flash_chunk_tiles: int = 128  # flash stream: with at least this many tiles in the cache allocation (0: never),
    #   samples are located chunk first from chunk statistics each program keeps in registers, one chunk of
    #   its stored scores read per sample (as gather_chunks), flash_chunk_samples per step. H200 2026-11-22,
    #   graphed, own processes, runs 88-91 (santa_flash_chunked.txt), vs the whole-tile lookup: 128k B=1 136 ->
    #   123 us, B=8 S=1024 657 -> 612, S=2048 665 -> 627; 32k B=8 S=1024 195 -> 178, S=2048 202 -> 198; 32k B=1
    #   41.8 -> 39.1. At 8k (32 tiles: 32-64 samples per head per tile) chunked was slower (B=8 S=2048 86 -> 94),
    #   hence a threshold on the tile count (a host int); deciding per tile in the kernel cost the whole-tile
    #   branch 4 us at 8k (registers), chunk sums taken after the K pass spilled (both removed)
    flash_chunk_samples: int = 8
    flash_mode: str = "stream"  # H200 32k (eager stage times): B=1 stream 38 + merge 13 us vs split's score pass
    #   23 + tiles-and-inline-merge 48; B=8 230 + 17 vs 136 + 160
    flash_merge: str = "launch"  # ``inline`` (last tile of each group merges, arrival counters) or ``launch``
    merge_cols: int = 16  # flash_merge=launch: output columns per merge program (>= 8)
    merge_chunk: int = 128  # flash_merge=launch: tile partials per pipelined load step. H200 2026-11-22 graphed,
    #   own processes (runs 93-95, santa_flash_merge.txt), 32 cols x 16 partials before -> 16 x 128: 128k B=1
    #   S=1024 121.8 -> 96.5-96.8 us, 32k B=1 S=2048 41.8-42.0 -> 35.4-35.8, 32k B=8 S=2048 196.2-196.9 -> 191.8,
    #   128k B=8 605.8 -> 590.1; 8k -0.5..-1. Fewer dependent load steps per merge; 64 / 256 per step and 8 columns
    #   (more programs, 32-byte rows) measured beside it
    prop_reduce: str = "atomic"  # prop: ``atomic`` (float32 atomics into one row per head, the last tile
    #   writes the output) or ``launch`` (per-tile sums stored, summed in tile order by a second launch)
    flash_values: str = "rows"  # flash: ``rows`` (sampled V rows, as prop) or ``dot`` (counts @ V tile)
    flash_warps: int = 8  # fused flash kernel
    merge_rows: int = 4  # flash merge: partial rows per step (registers: rows · GP · BLOCK_D floats)
    flash_gather_warps: int = 2  # split flash gather kernel
    pdl: bool = True  # prop: score -> budgets -> gather as programmatic dependent launches (sm_90+: each launch
    #   is resident before the one it waits for ends; the gather loads its keys and offsets before waiting).
    #   H200 2026-11-21 graphed: 32k B=1 41.6 -> 40.2 us, 8k B=1 23.0 -> 21.5, B=8 -0.4..-0.9 us. The same
    #   for flash's stream -> merge cost 1-10 us (the early merge programs crowd the last wave): not used.


VARIANTS: dict[str, KernelConfig] = {
    "default": KernelConfig(),
    "bk64": KernelConfig(score_bk=64, score_stages=3),  # the default before 2026-11-21 19:30
    "bk128": KernelConfig(score_bk=128, score_stages=2),
    "tpp4": KernelConfig(score_tpp=4),
    "w4": KernelConfig(score_warps=4, gather_warps=4, flash_gather_warps=4),  # the default before 2026-11-21 19:00
    "w1": KernelConfig(score_warps=1, gather_warps=1, flash_gather_warps=1),
    "w8": KernelConfig(score_warps=8, gather_warps=8, flash_gather_warps=8),
    "nopipe": KernelConfig(score_bk=256, score_stages=1),  # one 256-key load per tile, as before
    "fused": KernelConfig(flash_mode="fused", flash_merge="inline"),
    "fused_dot": KernelConfig(flash_mode="fused", flash_values="dot", flash_merge="inline"),  # the previous flash kernel
    "dot": KernelConfig(flash_mode="split", flash_values="dot"),
    "maxs32": KernelConfig(gather_chunks=False, gather_samples=32, flash_samples=32),
    "maxs8": KernelConfig(gather_chunks=False, gather_samples=8, flash_samples=8),
    "prop16": KernelConfig(gather_chunks=False, gather_samples=16),  # the previous default
    "prop8": KernelConfig(gather_chunks=False, gather_samples=8),
    "prop2": KernelConfig(gather_chunks=False, gather_samples=2),
    "merge16": KernelConfig(flash_mode="split", flash_merge="inline", merge_rows=16),
    "split": KernelConfig(flash_mode="split", flash_merge="inline"),  # the previous default
    "launchmerge": KernelConfig(flash_mode="split", flash_merge="launch"),
    "propsum": KernelConfig(prop_reduce="launch"),
    "propsum_maxs8": KernelConfig(gather_chunks=False, prop_reduce="launch", gather_samples=8),
    "stream": KernelConfig(flash_mode="stream", flash_merge="launch"),
    "nopdl": KernelConfig(pdl=False),
    "streamdot": KernelConfig(flash_values="dot"),  # flash: counts @ V tile (dense sampling at short contexts)
    "bk64s2": KernelConfig(score_bk=64, score_stages=2),  # less shared memory per program: more resident programs
    "bk32s2": KernelConfig(score_stages=2),
    "bk32s3": KernelConfig(score_stages=3),
    "gr64": KernelConfig(gather_chunks=False, gather_tiles=1, gather_maxnreg=64),
    "gr48": KernelConfig(gather_chunks=False, gather_tiles=1, gather_maxnreg=48),
    "gw4": KernelConfig(gather_chunks=False, gather_tiles=1, gather_warps=4),
    "gw4r64": KernelConfig(gather_chunks=False, gather_tiles=1, gather_warps=4, gather_maxnreg=64),
    "gw1": KernelConfig(gather_chunks=False, gather_tiles=1, gather_warps=1),
    "gt1": KernelConfig(gather_chunks=False, gather_tiles=1),  # the default before 2026-11-21 (session 13)
    "gt4": KernelConfig(gather_chunks=False, gather_tiles=4),
    "gt2r64": KernelConfig(gather_chunks=False, gather_tiles=2, gather_maxnreg=64),
    "th": KernelConfig(gather_chunks=False, gather_tiles=1, gather_thresh=True),
    "th_gt2": KernelConfig(gather_chunks=False, gather_thresh=True, gather_tiles=2),
    "th_gt2r80": KernelConfig(gather_chunks=False, gather_thresh=True, gather_tiles=2, gather_maxnreg=80),
    "th_gt2s2": KernelConfig(gather_chunks=False, gather_thresh=True, gather_tiles=2, gather_samples=2),
    "gt2s2": KernelConfig(gather_chunks=False, gather_tiles=2, gather_samples=2),
    "gt2r80": KernelConfig(gather_chunks=False, gather_tiles=2, gather_maxnreg=80),
    "gt2w1": KernelConfig(gather_chunks=False, gather_tiles=2, gather_warps=1),
    "gt4w1": KernelConfig(gather_chunks=False, gather_tiles=4, gather_warps=1),
    "gt8w1": KernelConfig(gather_chunks=False, gather_tiles=8, gather_warps=1),
    "gt4s8": KernelConfig(gather_chunks=False, gather_tiles=4, gather_samples=8),
    # Session 14: the chunked prop gather (the default since) and its tilings; gather_chunks=False above =
    # the whole-tile gather measured before it ("full" = the default of 2026-11-22 00:17).
    "full": KernelConfig(gather_chunks=False),
    "fch": KernelConfig(flash_chunk_tiles=1, flash_chunk_samples=16),  # every call chunked
    "fch_s8": KernelConfig(flash_chunk_tiles=1),
    "fch_s4": KernelConfig(flash_chunk_tiles=1, flash_chunk_samples=4),
    "fwhole": KernelConfig(flash_chunk_tiles=0),  # flash stream: whole-tile lookup at every length (before)
    "mc32": KernelConfig(merge_chunk=32),  # flash merge launch: 32 partials per step, or other column widths
    "mc8": KernelConfig(merge_chunk=8),
    "mcols16": KernelConfig(merge_cols=16),
    "mcols64": KernelConfig(merge_cols=64),
    "mc32c16": KernelConfig(merge_chunk=32, merge_cols=16),
    "mc64c16": KernelConfig(merge_chunk=64, merge_cols=16),
    "mc128c16": KernelConfig(merge_chunk=128, merge_cols=16),
    "mc256c16": KernelConfig(merge_chunk=256, merge_cols=16),
    "mc128c8": KernelConfig(merge_chunk=128, merge_cols=8),
    "mc64c8": KernelConfig(merge_chunk=64, merge_cols=8),
    "ch": KernelConfig(gather_chunks=True),
    "ch_s8": KernelConfig(gather_samples=8),
    "ch_gt4": KernelConfig(gather_tiles=4),
    "ch_gt1": KernelConfig(gather_tiles=1),
    "ch_gt4s8": KernelConfig(gather_tiles=4, gather_samples=8),
    "fmaxs32": KernelConfig(flash_samples=32),  # flash: 32 samples per step; slower everywhere (santa_variants_bk32.txt)
}
CONFIG: KernelConfig = VARIANTS[os.environ.get("SANTA_TRITON_VARIANT", "default")]


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized buffer (tests replace this to poison every buffer the wrapper allocates with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, len_ptr, s_ptr, m_ptr, l_ptr, cm_ptr, cl_ptr,
    scale, G, Hkv, Hq, D, tile, T_all, Tk_pad,
    sqb, sqh, sqd, skb, skh, skn, skd, sls,
    GP: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, TPP: tl.constexpr, BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr, IEEE: tl.constexpr, RELEASE: tl.constexpr, CHUNK_STATS: tl.constexpr,
):
    """Scores [GP, BK] per K chunk (stored float32 ``[B·Hq, Tk_pad]``) and per tile ``m_t``, ``ℓ_t``.

    One program = TPP consecutive tiles of one KV head, streamed as NCH chunks of BK keys per tile in a
    software-pipelined loop (STAGES chunks in flight); ``ℓ_t`` is kept online over the chunks.
    ``CHUNK_STATS`` (prop's chunked gather): each chunk's reference ``r_c`` (the tile's running max after
    it) and ``Σ_chunk exp(s - r_c)`` are stored too (``[B·Hq, T_all·NCH]``, the sum the online ``ℓ_t``
    already forms: two stores per chunk, no extra exponentials).
    ``RELEASE``: the next launch (programmatic dependent launch) may start once every program has begun.
    """
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    g = tl.arange(0, GP)
    gmask = g < G
    row = (b * Hq + kvh * G + g).to(tl.int64)
    j = tl.arange(0, BK)
    t0 = tl.program_id(0) * TPP
    n_chunks = tl.minimum(T_b - t0, TPP) * NCH  # <= 0: no tile of this program holds a key
    q = _load_group_q(q_ptr, b, kvh, G, D, sqb, sqh, sqd, GP, BLOCK_D)
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    m_run = tl.full((GP,), float("-inf"), tl.float32)
    l_run = tl.zeros((GP,), tl.float32)
    for c in tl.range(0, n_chunks, num_stages=STAGES):
        t = t0 + c // NCH
        pos = (c % NCH) * BK + j
        key = t * tile + pos
        kmask = (pos < tile) & (key < length)
        s = _tile_scores(q, k_base, key, kmask, D, skn, skd, scale, BLOCK_D, IEEE)
        tl.store(s_ptr + row[:, None] * Tk_pad + key[None, :], s, mask=gmask[:, None] & kmask[None, :])
        m_run, m_ref, l_chunk, l_run = _online_chunk(s, m_run, l_run)
        if CHUNK_STATS:
            cix = row * (T_all * NCH) + t * NCH + c % NCH
            tl.store(cm_ptr + cix, m_ref, mask=gmask)
            tl.store(cl_ptr + cix, l_chunk, mask=gmask)
        if c % NCH == NCH - 1:  # last chunk of tile t
            tl.store(m_ptr + row * T_all + t, m_run, mask=gmask)
            tl.store(l_ptr + row * T_all + t, l_run, mask=gmask)
            m_run = tl.full((GP,), float("-inf"), tl.float32)
            l_run = tl.zeros((GP,), tl.float32)


@triton.jit
def _prop_budget_kernel(
    m_ptr, l_ptr, bud_ptr, acc_ptr, len_ptr, ns_ptr, Hq, tile, T_all, sls, sns,
    HP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FRAC_BITS: tl.constexpr, RADIX_BITS: tl.constexpr, GDC: tl.constexpr,
):
    """Largest-remainder budgets of HP query heads (rows ``pid·HP + [0, HP)`` of ``B·Hq``, one batch
    row: HP divides Hq) from the score pass's tile statistics; zeroes their output accumulator rows.
    ``GDC``: a programmatic dependent launch after the score pass (waits for it, releases the gather)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.arange(0, HP)
    first = tl.program_id(0) * HP
    b = first // Hq
    row = (first + h).to(tl.int64)
    hmask = h < HP
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    S = tl.load(ns_ptr + b * sns).to(tl.int32)
    _prop_budgets(m_ptr, l_ptr, bud_ptr, row, hmask, T_all, T_b, S, BLOCK_T, FRAC_BITS, RADIX_BITS)
    d = tl.arange(0, BLOCK_D)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], tl.zeros((HP, BLOCK_D), tl.float32))


@triton.jit
def _prop_gather_kernel(
    v_ptr, u_ptr, len_ptr, ns_ptr, s_ptr, cm_ptr, cl_ptr, bud_ptr, acc_ptr, cnt_ptr, out_ptr, counts_ptr,
    G, Hkv, Hq, D, tile, T_all, Tk_pad,
    svb, svh, svn, svd, sub, suh, sut, sob, soh, sod, sls, sns,
    GP: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr, MAXS: tl.constexpr, TPG: tl.constexpr,
    THRESH: tl.constexpr, CHUNKED: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr,
    WRITE_COUNTS: tl.constexpr, ATOMIC: tl.constexpr, GDC: tl.constexpr,
):
    """Tiles ``TPG·p .. TPG·p + TPG-1``'s samples of each head of the group: ``Σ V[key_j]`` added into
    ``acc`` with float32 atomics (one add per program: its tiles summed first), the last program of a
    (b, kv head) writing ``acc / S`` (``ATOMIC``), or stored as each tile's row of ``acc [B·Hkv·T_all,
    GP, BLOCK_D]`` (zeros without budget) for :func:`_sum_tiles_kernel` (deterministic, no contended
    atomics: 128 tiles adding into the same 512 floats serialize in L2). Row ``r`` of the program's
    ``[GP·TPG, ·]`` blocks is head ``r // TPG`` of the group at tile ``TPG·p + r % TPG``: all its tiles'
    budgets, offsets and scores (``CHUNKED``: chunk statistics) load in one round trip and their samples
    resolve in one loop. ``CHUNKED``: samples located from the score pass's per-chunk statistics first,
    then within one BK-key chunk of stored scores each (:func:`_gather_by_chunks`); else over the whole
    tile's scores (``THRESH``: :func:`_gather_by_thresholds`, else :func:`_gather_samples`).
    ``GDC``: a programmatic dependent launch after the budgets: the offsets load before ``gdc_wait``,
    budgets and scores after."""
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    r = tl.arange(0, GP * TPG)
    g = r // TPG
    t = tl.program_id(0) * TPG + r % TPG
    rmask = (g < G) & (t < T_all)
    d = tl.arange(0, BLOCK_D)
    row = (b * Hq + kvh * G + g).to(tl.int64)
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    j = tl.arange(0, BN)
    key = t[:, None] * tile + j[None, :]
    kmask = (j < tile)[None, :] & (key < length)
    u = tl.load(u_ptr + b.to(tl.int64) * sub + (kvh * G + g).to(tl.int64) * suh + t * sut, mask=rmask, other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
    # Scores (4 KB per tile, L2) or chunk statistics load together with the budgets: one round trip.
    budget = tl.load(bud_ptr + row * T_all + t, mask=rmask, other=0)
    if CHUNKED:
        c = tl.arange(0, NCH)
        cix = row[:, None] * (T_all * NCH) + t[:, None] * NCH + c[None, :]
        cm = tl.load(cm_ptr + cix, mask=rmask[:, None], other=0.0)
        cl = tl.load(cl_ptr + cix, mask=rmask[:, None], other=0.0)
    else:
        s = tl.load(s_ptr + row[:, None] * Tk_pad + key, mask=rmask[:, None] & kmask, other=float("-inf"))
    o = tl.zeros((GP * TPG, BLOCK_D), tl.float32)
    og = tl.arange(0, GP)  # the group's heads: one accumulator row each
    acc_rows = acc_ptr + (b * Hq + kvh * G + og).to(tl.int64)[:, None] * BLOCK_D + d[None, :]
    acc_mask = (og < G)[:, None]
    if tl.max(budget, axis=0) > 0:
        v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        if CHUNKED:
            s_rows = s_ptr + row * Tk_pad + t * tile
            o, counts = _gather_by_chunks(s_rows, cm, cl, budget, u, v_base, t * tile, tile, length, D, svn, svd,
                                          BK, BN, BLOCK_D, MAXS, WRITE_COUNTS)
        else:
            m = tl.max(s, axis=1)
            m = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp(s - m[:, None])
            if THRESH and not WRITE_COUNTS:
                o = _gather_by_thresholds(w, budget, u, v_base, (t * tile)[:, None], D, svn, svd, BLOCK_D, MAXS)
            else:
                counts, c_hi = _systematic_counts(w, budget, u)
                o = _gather_samples(c_hi, budget, v_base, (t * tile)[:, None], D, svn, svd, BLOCK_D, MAXS)
        if ATOMIC:
            o_g = tl.sum(tl.reshape(o, (GP, TPG, BLOCK_D)), axis=1) if TPG > 1 else o
            tl.atomic_add(acc_rows, o_g, mask=acc_mask)
        if WRITE_COUNTS:
            tl.store(counts_ptr + row[:, None] * Tk_pad + key, counts, mask=rmask[:, None] & kmask)
    if ATOMIC:
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + bh, 1)
        if done == tl.cdiv(T_all, TPG) - 1:  # every program of this (b, kv head) has added its samples
            acc = tl.load(acc_rows, mask=acc_mask, other=0.0, cache_modifier=".cg")
            inv_s = 1.0 / tl.load(ns_ptr + b * sns).to(tl.float32)
            _store_rows(out_ptr, b, kvh, G, D, sob, soh, sod, acc * inv_s, GP, BLOCK_D)
            tl.atomic_xchg(cnt_ptr + bh, 0)
    else:
        tile_row = bh.to(tl.int64) * T_all + t
        tl.store(acc_ptr + (tile_row * GP + g)[:, None] * BLOCK_D + d[None, :], o, mask=(t < T_all)[:, None])


@triton.jit
def _sum_tiles_kernel(
    part_ptr, len_ptr, ns_ptr, out_ptr, G, Hkv, D, tile, T_all, sob, soh, sod, sls, sns,
    GP: tl.constexpr, BLOCK_D: tl.constexpr, MD: tl.constexpr, CH: tl.constexpr,
):
    """prop output ``Σ_t part[t] / S`` of one (batch, KV head) for MD columns (grid (B·Hkv, BLOCK_D / MD)),
    tiles summed in a fixed order, CH rows per software-pipelined load step."""
    bh = tl.program_id(0)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    g = tl.arange(0, GP)
    d = tl.program_id(1) * MD + tl.arange(0, MD)
    c = tl.arange(0, CH)
    first = bh.to(tl.int64) * T_all
    acc = tl.zeros((GP, MD), tl.float32)
    for r in tl.range(0, T_b, CH, num_stages=3):
        rows = first + r + c
        rmask = (r + c) < T_b
        pa = tl.load(part_ptr + (rows[:, None, None] * GP + g[None, :, None]) * BLOCK_D + d[None, None, :],
                     mask=rmask[:, None, None], other=0.0)
        acc += tl.sum(pa, axis=0)
    inv_s = 1.0 / tl.load(ns_ptr + b * sns).to(tl.float32)
    ptr = out_ptr + b.to(tl.int64) * sob + (kvh * G + g).to(tl.int64)[:, None] * soh + d[None, :] * sod
    tl.store(ptr, (acc * inv_s).to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])


@triton.jit
def _flash_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, len_ptr, ns_ptr, s_ptr, work_ptr, cnt_ptr, out_ptr, counts_ptr,
    scale, G, Hkv, Hq, D, tile, T_all, Tk_pad, n_groups,
    sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sub, suh, sut, sob, soh, sod, sls, sns,
    GP: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr, TPG: tl.constexpr, CH: tl.constexpr,
    IEEE: tl.constexpr, WRITE_COUNTS: tl.constexpr, FUSED: tl.constexpr, MERGE: tl.constexpr,
    MAXS: tl.constexpr,
):
    """One tile of flash: scores (FUSED: q·K here; else the stored scores of ``_score_kernel``), counts,
    ``counts @ V``, its partial; with MERGE the log-sum-exp merge (off only to time the stages)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    if t < T_b:
        key, kmask = _tile_keys(t, tile, length, BN)
        if FUSED:
            q = _load_group_q(q_ptr, b, kvh, G, D, sqb, sqh, sqd, GP, BLOCK_D)
            k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
            s = _tile_scores(q, k_base, key, kmask, D, skn, skd, scale, BLOCK_D, IEEE)
        else:
            g = tl.arange(0, GP)
            row = (b * Hq + kvh * G + g).to(tl.int64)
            s = tl.load(s_ptr + row[:, None] * Tk_pad + key[None, :], mask=(g < G)[:, None] & kmask[None, :],
                        other=float("-inf"))
        _flash_tile(s, kmask, key, b, kvh, t, bh, G, Hq, D, T_all, Tk_pad, v_ptr, u_ptr, ns_ptr, work_ptr,
                    counts_ptr, T_b, tile, svb, svh, svn, svd, sub, suh, sut, sns, GP, BLOCK_D, IEEE, WRITE_COUNTS,
                    MAXS)
    if MERGE:
        tl.debug_barrier()
        _flash_merge(b, kvh, t, bh, G, D, T_all, T_b, n_groups, work_ptr, cnt_ptr, out_ptr, sob, soh, sod,
                     GP, BLOCK_D, TPG, CH)


@triton.jit
def _flash_stream_kernel(
    q_ptr, k_ptr, v_ptr, u_ptr, len_ptr, ns_ptr, s_ptr, work_ptr, counts_ptr,
    scale, G, Hkv, Hq, D, tile, T_all, Tk_pad,
    sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sub, suh, sut, sls, sns,
    GP: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr, IEEE: tl.constexpr, WRITE_COUNTS: tl.constexpr, MAXS: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    """flash, one tile per program in one pass over K: the tile's scores in NCH software-pipelined
    chunks of BK keys (as :func:`_score_kernel`, stored float32), then, after a CTA barrier, the tile's
    counts, sampled V rows and partial ``(m_t, ℓ_t, ℓ_t·μ̂_t)`` from the scores it just stored (L1/L2
    hits); the partials are merged by :func:`_flash_merge_kernel` (or inline with MERGE in
    :func:`_flash_kernel`'s scheme: not here). ``CHUNKED`` (host choice, ``flash_chunk_tiles``): the
    chunk statistics ``(r_c, Σ exp(s - r_c))`` are kept in registers ([GP, NCH]) as the chunks stream,
    each sample's chunk is located from them and only that chunk of the stored scores is read
    (:func:`_gather_by_chunks`, as prop's gather; ``ℓ_t`` is the online sum); else the whole tile is
    re-read and prefix-summed (:func:`_flash_tile`)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    if t < T_b:
        g = tl.arange(0, GP)
        gmask = g < G
        row = (b * Hq + kvh * G + g).to(tl.int64)
        j = tl.arange(0, BK)
        q = _load_group_q(q_ptr, b, kvh, G, D, sqb, sqh, sqd, GP, BLOCK_D)
        k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        ci = tl.arange(0, NCH)
        cm = tl.zeros((GP, NCH), tl.float32)
        cl = tl.zeros((GP, NCH), tl.float32)
        m_run = tl.full((GP,), float("-inf"), tl.float32)
        l_run = tl.zeros((GP,), tl.float32)
        for c in tl.range(0, NCH, num_stages=STAGES):
            pos = c * BK + j
            key = t * tile + pos
            kmask = (pos < tile) & (key < length)
            s = _tile_scores(q, k_base, key, kmask, D, skn, skd, scale, BLOCK_D, IEEE)
            tl.store(s_ptr + row[:, None] * Tk_pad + key[None, :], s, mask=gmask[:, None] & kmask[None, :])
            if CHUNKED:  # chunk statistics as the score pass's, kept in registers
                m_run, m_ref, l_chunk, l_run = _online_chunk(s, m_run, l_run)
                here = (ci == c)[None, :]
                cm = tl.where(here, m_ref[:, None], cm)
                cl = tl.where(here, l_chunk[:, None], cl)
        tl.debug_barrier()  # the whole tile's scores, stored by every thread of the program, are visible
        key, kmask = _tile_keys(t, tile, length, BN)
        if CHUNKED:
            s_tile = _flash_tile_budget(ns_ptr, b, sns, T_b)
            budget = tl.where(gmask, s_tile, 0)
            u = tl.load(u_ptr + b.to(tl.int64) * sub + (kvh * G + g).to(tl.int64) * suh + t * sut, mask=gmask,
                        other=0.0)
            v_base = v_ptr + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
            o, counts = _gather_by_chunks(s_ptr + (row * Tk_pad + t * tile), cm, cl, budget, u, v_base,
                                          t * tile + 0 * g, tile, length, D, svn, svd, BK, BN, BLOCK_D, MAXS,
                                          WRITE_COUNTS)
            _store_flash_partial(work_ptr, bh, t, T_all, tl.where(gmask, m_run, 0.0), tl.where(gmask, l_run, 0.0),
                                 o, s_tile, GP, BLOCK_D)
            if WRITE_COUNTS:
                tl.store(counts_ptr + row[:, None] * Tk_pad + key[None, :], counts,
                         mask=gmask[:, None] & kmask[None, :])
        else:
            s = tl.load(s_ptr + row[:, None] * Tk_pad + key[None, :], mask=gmask[:, None] & kmask[None, :],
                        other=float("-inf"))
            _flash_tile(s, kmask, key, b, kvh, t, bh, G, Hq, D, T_all, Tk_pad, v_ptr, u_ptr, ns_ptr, work_ptr,
                        counts_ptr, T_b, tile, svb, svh, svn, svd, sub, suh, sut, sns, GP, BLOCK_D, IEEE,
                        WRITE_COUNTS, MAXS)


@triton.jit
def _flash_merge_kernel(
    work_ptr, len_ptr, out_ptr, G, Hkv, D, tile, T_all, sob, soh, sod, sls,
    GP: tl.constexpr, BLOCK_D: tl.constexpr, MD: tl.constexpr, CH: tl.constexpr,
):
    """Log-sum-exp merge of one (batch, KV head)'s tile partials for MD output columns (grid: (B·Hkv,
    BLOCK_D / MD)): CH partials per software-pipelined load step, then ``A / L`` in the output dtype."""
    bh = tl.program_id(0)
    n_bh = tl.num_programs(0)
    b = bh // Hkv
    kvh = bh % Hkv
    length = tl.load(len_ptr + b * sls).to(tl.int32)
    T_b = (length + tile - 1) // tile
    n_tp = n_bh.to(tl.int64) * T_all * GP
    g = tl.arange(0, GP)
    d = tl.program_id(1) * MD + tl.arange(0, MD)
    _, l_run, acc = _merge_partials(work_ptr, work_ptr + n_tp, work_ptr + 2 * n_tp, bh.to(tl.int64) * T_all, 0, T_b,
                                    d, GP, BLOCK_D, CH)
    res = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    ptr = out_ptr + b.to(tl.int64) * sob + (kvh * G + g).to(tl.int64)[:, None] * soh + d[None, :] * sod
    tl.store(ptr, res.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])


# ------------------------------------------------------------------------------------- host side


def _pdl(device: torch.device) -> bool:
    """Chain this call's launches by programmatic dependent launch (``CONFIG.pdl``, sm_90+, compiled)."""
    return CONFIG.pdl and pdl_available(device)


def _pdl_launch(pdl: bool) -> dict[str, bool]:
    return {"launch_pdl": True} if pdl else {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    return arrival_counters("santa", device, n)


def _pow2(x: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(x))


def _radix_bits(elements: int) -> int:
    """Bits per radix-select round: 16 candidates while the [GP, T, C] compare stays <= 8k elements."""
    return 4 if elements <= 512 else 2 if elements <= 2048 else 1


@dataclass(frozen=True)
class _Geometry:
    """Shapes of one call and the kernels' padded block sizes."""

    B: int
    Hq: int
    Hkv: int
    D: int
    tile: int
    T_all: int  # tiles covering the cache allocation, ceil(Tk / tile)
    GP: int  # query heads per group, padded to a power of two (>= 2)
    BN: int  # keys per tile, padded (>= 16)
    BLOCK_D: int  # head_dim, padded (>= 16)

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, tile: int) -> "_Geometry":
        b, hq, d = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        return cls(b, hq, hkv, d, tile, -(-tk // tile), _pow2(hq // hkv, 2), _pow2(tile, 16), _pow2(d, 16))

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def Tk_pad(self) -> int:
        return self.T_all * self.tile

    @property
    def BH(self) -> int:
        return self.B * self.Hkv


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, tiling: str, tile: int,
              estimator: str) -> bool:
    """Whether the kernels run this call (else ``santa_decode_forward`` uses the reference)."""
    if tiling not in ("prop", "flash") or estimator != "sys" or q.dim() != 3:
        return False
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    if not (q.device == k_cache.device == v_cache.device) or (q.device.type != "cuda" and not _INTERPRET):
        return False
    return q.shape[-1] <= MAX_HEAD_DIM and -(-k_cache.shape[2] // tile) <= MAX_TILES and tile <= 4096


@dataclass(frozen=True)
class _Scores:
    """Buffers of the score pass (float32 views of one allocation) and prop's budgets / accumulator."""

    scores: torch.Tensor  # [B·Hq·Tk_pad] q·k·scale
    m: torch.Tensor  # [B·Hq·T_all] tile max scores
    ell: torch.Tensor  # [B·Hq·T_all] Σ exp(s - m_t)
    budgets: torch.Tensor  # [B·Hq, T_all] int32 S_t (prop)
    acc: torch.Tensor  # [B·Hq·BLOCK_D] output accumulator (prop; zeroed by the budget kernel)
    chunk_m: torch.Tensor  # [B·Hq·T_all·NCH] per K chunk: reference r_c (prop, CONFIG.gather_chunks; else empty)
    chunk_l: torch.Tensor  # [B·Hq·T_all·NCH] per K chunk: Σ exp(s - r_c)


def _score_chunk(geo: _Geometry) -> int:
    """Keys per K chunk of the score pass (``CONFIG.score_bk``, at most the padded tile)."""
    return min(geo.BN, _pow2(CONFIG.score_bk, 16))


def _score_buffers(geo: _Geometry, device: torch.device, chunk_stats: bool = False) -> _Scores:
    rows, t_all, pad = geo.B * geo.Hq, geo.T_all, geo.Tk_pad
    n_chunks = rows * t_all * (geo.BN // _score_chunk(geo)) if chunk_stats else 0
    sizes = (rows * pad, rows * t_all, rows * t_all, rows * geo.BLOCK_D, n_chunks, n_chunks)
    work = _alloc((sum(sizes),), torch.float32, device)
    scores, m, ell, acc, chunk_m, chunk_l = torch.split(work, sizes)
    return _Scores(scores, m, ell, _alloc((rows, t_all), torch.int32, device), acc, chunk_m, chunk_l)


def _launch_scores(q: torch.Tensor, k: torch.Tensor, cache_len: torch.Tensor, scale: float, geo: _Geometry,
                   bufs: _Scores) -> None:
    """The score pass: stored scores and tile statistics ``(m_t, ℓ_t)`` (K read once); chunk statistics
    too when ``bufs`` has room for them (prop with ``CONFIG.gather_chunks``)."""
    cfg = CONFIG
    bk = _score_chunk(geo)
    chunk_stats = bufs.chunk_m.numel() > 0
    _score_kernel[(triton.cdiv(geo.T_all, cfg.score_tpp), geo.BH)](
        q, k, cache_len, bufs.scores, bufs.m, bufs.ell, bufs.chunk_m if chunk_stats else bufs.m,
        bufs.chunk_l if chunk_stats else bufs.ell,
        float(scale), geo.G, geo.Hkv, geo.Hq, geo.D, geo.tile, geo.T_all, geo.Tk_pad,
        *q.stride(), *k.stride(), cache_len.stride(0),
        GP=geo.GP, BK=bk, NCH=geo.BN // bk, TPP=cfg.score_tpp, BLOCK_D=geo.BLOCK_D, STAGES=cfg.score_stages,
        IEEE=q.dtype == torch.float32, RELEASE=_pdl(q.device), CHUNK_STATS=chunk_stats, num_warps=cfg.score_warps,
    )


def _launch_budgets(num_samples: torch.Tensor, cache_len: torch.Tensor, geo: _Geometry, bufs: _Scores) -> None:
    """prop budgets (largest remainder over the tile masses) and the zeroed accumulator."""
    pdl = _pdl(num_samples.device)
    hp = CONFIG.budget_heads if geo.Hq % CONFIG.budget_heads == 0 else 1
    block_t = _pow2(geo.T_all, 2)
    _prop_budget_kernel[(geo.B * geo.Hq // hp,)](
        bufs.m, bufs.ell, bufs.budgets, bufs.acc, cache_len, num_samples, geo.Hq, geo.tile, geo.T_all,
        cache_len.stride(0), num_samples.stride(0),
        HP=hp, BLOCK_T=block_t, BLOCK_D=geo.BLOCK_D, FRAC_BITS=_FRAC_BITS, RADIX_BITS=_radix_bits(hp * block_t),
        GDC=pdl, num_warps=4, **_pdl_launch(pdl),
    )


def _prop_scores(q: torch.Tensor, k: torch.Tensor, num_samples: torch.Tensor, cache_len: torch.Tensor,
                 scale: float, geo: _Geometry) -> _Scores:
    """Score pass + budgets (2 launches)."""
    bufs = _score_buffers(geo, q.device, chunk_stats=CONFIG.gather_chunks)
    _launch_scores(q, k, cache_len, scale, geo, bufs)
    _launch_budgets(num_samples, cache_len, geo, bufs)
    return bufs


def _gather_tiles(geo: _Geometry) -> int:
    """Tiles per prop gather program: ``CONFIG.gather_tiles`` (a power of two) while the program's
    ``[GP·TPG, BN]`` score block stays <= 8192 elements, at most the tile count."""
    tpg = _pow2(CONFIG.gather_tiles, 1)
    while tpg > 1 and (geo.GP * tpg * geo.BN > 8192 or tpg > geo.T_all):
        tpg //= 2
    return tpg


def _launch_prop_gather(v: torch.Tensor, num_samples: torch.Tensor, uniforms: torch.Tensor,
                        cache_len: torch.Tensor, geo: _Geometry, bufs: _Scores, out: torch.Tensor,
                        counts: torch.Tensor | None) -> None:
    """The prop gather (and the per-tile sum launch of ``prop_reduce="launch"``)."""
    atomic = CONFIG.prop_reduce == "atomic"
    pdl = _pdl(v.device)
    acc = bufs.acc if atomic else _alloc((geo.BH * geo.T_all * geo.GP * geo.BLOCK_D,), torch.float32, v.device)
    tpg = _gather_tiles(geo)
    chunked = bufs.chunk_m.numel() > 0
    bk = _score_chunk(geo)
    _prop_gather_kernel[(triton.cdiv(geo.T_all, tpg), geo.BH)](
        v, uniforms, cache_len, num_samples, bufs.scores, bufs.chunk_m if chunked else bufs.m,
        bufs.chunk_l if chunked else bufs.ell, bufs.budgets, acc, _counters(v.device, geo.BH), out,
        counts if counts is not None else out,
        geo.G, geo.Hkv, geo.Hq, geo.D, geo.tile, geo.T_all, geo.Tk_pad,
        *v.stride(), *uniforms.stride(), *out.stride(), cache_len.stride(0), num_samples.stride(0),
        GP=geo.GP, BN=geo.BN, BLOCK_D=geo.BLOCK_D, MAXS=CONFIG.gather_samples, TPG=tpg, THRESH=CONFIG.gather_thresh,
        CHUNKED=chunked, BK=bk, NCH=geo.BN // bk, WRITE_COUNTS=counts is not None, ATOMIC=atomic, GDC=pdl,
        num_warps=CONFIG.gather_warps * tpg,
        **_pdl_launch(pdl), **({"maxnreg": CONFIG.gather_maxnreg} if CONFIG.gather_maxnreg and not _INTERPRET else {}),
    )
    if not atomic:
        md = min(geo.BLOCK_D, _pow2(CONFIG.merge_cols, 8))
        _sum_tiles_kernel[(geo.BH, geo.BLOCK_D // md)](
            acc, cache_len, num_samples, out, geo.G, geo.Hkv, geo.D, geo.tile, geo.T_all, *out.stride(),
            cache_len.stride(0), num_samples.stride(0),
            GP=geo.GP, BLOCK_D=geo.BLOCK_D, MD=md, CH=min(_pow2(CONFIG.merge_chunk, 2), _pow2(geo.T_all, 2)),
            num_warps=4,
        )


def _prop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_samples: torch.Tensor, uniforms: torch.Tensor,
          cache_len: torch.Tensor, scale: float, geo: _Geometry,
          counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """S²ANTA-prop: (output [B, Hq, D], budgets [B·Hq, T_all] int32); ``counts`` receives per-key counts."""
    bufs = _prop_scores(q, k, num_samples, cache_len, scale, geo)
    out = _alloc((geo.B, geo.Hq, geo.D), q.dtype, q.device)
    _launch_prop_gather(v, num_samples, uniforms, cache_len, geo, bufs, out, counts)
    return out, bufs.budgets


def _flash_groups(t_all: int) -> tuple[int, int]:
    """(tiles per merge group, groups): about 16 groups; a group's partials merge in one step."""
    per = min(16, triton.next_power_of_2(-(-t_all // 16)))
    return per, -(-t_all // per)


def _launch_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_samples: torch.Tensor,
                  uniforms: torch.Tensor, cache_len: torch.Tensor, scale: float, geo: _Geometry,
                  scores: torch.Tensor | None, work: torch.Tensor, out: torch.Tensor, counts: torch.Tensor | None,
                  merge: bool = True) -> None:
    """The flash tile kernel: fused (``scores`` None: q·K in the kernel) or over the stored scores."""
    per, groups = _flash_groups(geo.T_all)
    fused = scores is None
    _flash_kernel[(geo.T_all, geo.BH)](
        q, k, v, uniforms, cache_len, num_samples, out if fused else scores, work,
        _counters(q.device, geo.BH * (groups + 1)), out, counts if counts is not None else out,
        float(scale), geo.G, geo.Hkv, geo.Hq, geo.D, geo.tile, geo.T_all, geo.Tk_pad, groups,
        *q.stride(), *k.stride(), *v.stride(), *uniforms.stride(), *out.stride(),
        cache_len.stride(0), num_samples.stride(0),
        GP=geo.GP, BN=geo.BN, BLOCK_D=geo.BLOCK_D, TPG=per, CH=min(CONFIG.merge_rows, per, _pow2(groups, 2)),
        IEEE=q.dtype == torch.float32, WRITE_COUNTS=counts is not None, FUSED=fused, MERGE=merge,
        MAXS=CONFIG.flash_samples if CONFIG.flash_values == "rows" else 0,
        num_warps=CONFIG.flash_warps if fused else CONFIG.flash_gather_warps,
    )


def _flash_chunked(geo: _Geometry) -> bool:
    """Whether the flash stream kernel locates samples chunk first (``CONFIG.flash_chunk_tiles``: long
    caches, where S / T samples per tile are few; denser tiles are faster prefix-summed whole)."""
    return 0 < CONFIG.flash_chunk_tiles <= geo.T_all and CONFIG.flash_values == "rows"


def _launch_flash_stream(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_samples: torch.Tensor,
                         uniforms: torch.Tensor, cache_len: torch.Tensor, scale: float, geo: _Geometry,
                         scores: torch.Tensor, work: torch.Tensor, counts: torch.Tensor | None) -> None:
    """flash_mode=stream: one program per tile, K chunks pipelined, the tile's partial written; samples
    located chunk first when the cache allocation has ``flash_chunk_tiles`` tiles or more."""
    cfg = CONFIG
    chunked = _flash_chunked(geo)
    bk = min(geo.BN, _pow2(cfg.score_bk, 16))
    _flash_stream_kernel[(geo.T_all, geo.BH)](
        q, k, v, uniforms, cache_len, num_samples, scores, work, counts if counts is not None else scores,
        float(scale), geo.G, geo.Hkv, geo.Hq, geo.D, geo.tile, geo.T_all, geo.Tk_pad,
        *q.stride(), *k.stride(), *v.stride(), *uniforms.stride(), cache_len.stride(0), num_samples.stride(0),
        GP=geo.GP, BK=bk, NCH=geo.BN // bk, BN=geo.BN, BLOCK_D=geo.BLOCK_D, STAGES=cfg.score_stages,
        IEEE=q.dtype == torch.float32, WRITE_COUNTS=counts is not None,
        MAXS=(cfg.flash_chunk_samples if chunked else cfg.flash_samples) if cfg.flash_values == "rows" else 0,
        CHUNKED=chunked, num_warps=cfg.score_warps,
    )


def _launch_flash_merge(cache_len: torch.Tensor, geo: _Geometry, work: torch.Tensor, out: torch.Tensor) -> None:
    """flash_merge=launch: the tile partials of each (batch, KV head) merged into the output."""
    md = min(geo.BLOCK_D, _pow2(CONFIG.merge_cols, 8))
    _flash_merge_kernel[(geo.BH, geo.BLOCK_D // md)](
        work, cache_len, out, geo.G, geo.Hkv, geo.D, geo.tile, geo.T_all, *out.stride(), cache_len.stride(0),
        GP=geo.GP, BLOCK_D=geo.BLOCK_D, MD=md, CH=min(_pow2(CONFIG.merge_chunk, 2), _pow2(geo.T_all, 2)),
        num_warps=4,
    )


def _flash_work(geo: _Geometry, device: torch.device) -> torch.Tensor:
    groups = _flash_groups(geo.T_all)[1]
    return _alloc((geo.BH * (geo.T_all + groups) * geo.GP * (2 + geo.BLOCK_D),), torch.float32, device)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_samples: torch.Tensor, uniforms: torch.Tensor,
           cache_len: torch.Tensor, scale: float, geo: _Geometry,
           counts: torch.Tensor | None = None) -> torch.Tensor:
    """S²ANTA-flash output [B, Hq, D]; ``counts`` receives per-key counts."""
    out = _alloc((geo.B, geo.Hq, geo.D), q.dtype, q.device)
    work = _flash_work(geo, q.device)
    inline = CONFIG.flash_merge == "inline"
    if CONFIG.flash_mode == "stream":
        _launch_flash_stream(q, k, v, num_samples, uniforms, cache_len, scale, geo,
                             _score_buffers(geo, q.device).scores, work, counts)
        inline = False
    else:
        scores = None
        if CONFIG.flash_mode == "split":
            bufs = _score_buffers(geo, q.device)
            _launch_scores(q, k, cache_len, scale, geo, bufs)
            scores = bufs.scores
        _launch_flash(q, k, v, num_samples, uniforms, cache_len, scale, geo, scores, work, out, counts, merge=inline)
    if not inline:
        _launch_flash_merge(cache_len, geo, work, out)
    return out


def santa_stages(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_samples: torch.Tensor, *,
                 tiling: str, tile: int, scale: float, uniforms: torch.Tensor,
                 cache_len: torch.Tensor) -> dict[str, Callable[[], None]]:
    """Launchers of each stage alone, on buffers filled by one full run (for timing; results unused).

    prop: ``scores`` (K pass), ``budgets``, ``gather`` (V rows + output), ``full``. flash: ``scores`` (split
    mode's K pass), ``tiles`` (counts + V + partials, no merge), ``merge_tiles`` (tiles + merge: the split
    mode's second launch), ``fused_nomerge`` / ``fused`` (the one-kernel variant), ``stream`` (the
    one-pass tile kernel, no merge), ``merge`` (the separate merge launch), ``full`` (CONFIG's mode).
    Same arguments as ``santa_decode_forward`` (shapes in its docstring).
    """
    geo = _Geometry.of(q, k_cache, tile)
    bufs = _score_buffers(geo, q.device, chunk_stats=tiling == "prop" and CONFIG.gather_chunks)
    out = _alloc((geo.B, geo.Hq, geo.D), q.dtype, q.device)
    args = (num_samples, uniforms, cache_len)
    stages: dict[str, Callable[[], None]] = {
        "scores": lambda: _launch_scores(q, k_cache, cache_len, scale, geo, bufs),
        "full": lambda: santa_decode_forward(q, k_cache, v_cache, num_samples, tiling=tiling, tile=tile,
                                             estimator="sys", scale=scale, uniforms=uniforms, cache_len=cache_len),
    }
    stages["scores"]()
    if tiling == "prop":
        _launch_budgets(num_samples, cache_len, geo, bufs)
        stages["budgets"] = lambda: _launch_budgets(num_samples, cache_len, geo, bufs)
        stages["gather"] = lambda: _launch_prop_gather(v_cache, *args, geo, bufs, out, None)
        return stages
    work = _flash_work(geo, q.device)
    stages["stream"] = lambda: _launch_flash_stream(q, k_cache, v_cache, *args, scale, geo, bufs.scores, work, None)
    stages["merge"] = lambda: _launch_flash_merge(cache_len, geo, work, out)
    stages["stream"]()  # partials for the merge stage
    for name, scores, merge in (("tiles", bufs.scores, False), ("merge_tiles", bufs.scores, True),
                                ("fused_nomerge", None, False), ("fused", None, True)):
        stages[name] = (lambda s=scores, mg=merge: _launch_flash(q, k_cache, v_cache, *args, scale, geo, s, work,
                                                                  out, None, mg))
    return stages


def santa_decode_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_samples: torch.Tensor,
    *,
    tiling: str,
    tile: int,
    estimator: str,
    scale: float,
    uniforms: torch.Tensor,
    cache_len: torch.Tensor,
) -> torch.Tensor:
    """One decode step (contract of ``reference.santa_decode_forward``; same arguments and result).

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, Tk, D]; num_samples: [B] int64 ``>= 1``;
    uniforms: [B, Hq, ceil(Tk / tile)] float64 tile offsets (prop / flash); cache_len: [B] int64 in
    ``[1, Tk]``. Returns [B, Hq, D] in q.dtype. Calls the kernels can't run go to the reference.
    """
    if not supported(q, k_cache, v_cache, tiling=tiling, tile=tile, estimator=estimator):
        return reference.santa_decode_forward(
            q, k_cache, v_cache, num_samples, tiling=tiling, tile=tile, estimator=estimator, scale=scale,
            uniforms=uniforms, cache_len=cache_len,
        )
    geo = _Geometry.of(q, k_cache, tile)
    if tiling == "prop":
        return _prop(q, k_cache, v_cache, num_samples, uniforms, cache_len, scale, geo)[0]
    return _flash(q, k_cache, v_cache, num_samples, uniforms, cache_len, scale, geo)


def decode_samples(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    num_samples: torch.Tensor,
    *,
    tiling: str,
    tile: int,
    scale: float,
    tile_uniforms: torch.Tensor,
    cache_len: torch.Tensor,
) -> DecodeSamples:
    """What the kernels draw (``reference.decode_samples``'s contract; for tests and diagnostics).

    Runs the same kernels as ``santa_decode_forward`` (K stands in for V) with per-key count output.
    Returns counts [B, Hq, Tk] int64, tile budgets [B, Hq, T] int64, tile masses [B, Hq, T] float64
    (from the kernel's tile statistics) and key weights [B, Hq, Tk] float64.
    """
    if not supported(q, k_cache, k_cache, tiling=tiling, tile=tile, estimator="sys"):
        raise ValueError("decode_samples: these inputs are not supported by the Triton kernels")
    geo = _Geometry.of(q, k_cache, tile)
    b, hq, t_all, tk = geo.B, geo.Hq, geo.T_all, k_cache.shape[2]
    counts = torch.zeros(b * hq, geo.Tk_pad, dtype=torch.int32, device=q.device)
    stats = _prop_scores(q, k_cache, num_samples, cache_len, scale, geo)
    m, ell = stats.m.view(b, hq, t_all).double(), stats.ell.view(b, hq, t_all).double()
    tile_valid = torch.arange(t_all, device=q.device)[None, :] < num_tiles(cache_len, tile)[:, None]
    m = torch.where(tile_valid[:, None], m, torch.full_like(m, float("-inf")))
    w = torch.where(tile_valid[:, None], torch.exp(m - m.amax(-1, keepdim=True)) * ell, torch.zeros_like(m))
    mass = w / w.sum(-1, keepdim=True)
    if tiling == "prop":
        budgets = _prop(q, k_cache, k_cache, num_samples, tile_uniforms, cache_len, scale, geo, counts)[1]
        budgets = budgets.view(b, hq, t_all).long()
        per_sample = (1.0 / num_samples.double())[:, None, None].expand(b, hq, t_all)
    elif tiling == "flash":
        _flash(q, k_cache, k_cache, num_samples, tile_uniforms, cache_len, scale, geo, counts)
        s_tile = flash_tile_budget(num_samples, num_tiles(cache_len, tile))
        budgets = torch.where(tile_valid[:, None], s_tile[:, None, None], 0).expand(b, hq, t_all)
        per_sample = mass / s_tile.double()[:, None, None]
    else:
        raise ValueError(f"unknown tiling {tiling!r}; use prop or flash")
    counts = counts.view(b, hq, t_all, tile).long()
    key_weights = (counts * per_sample[..., None]).reshape(b, hq, -1)[..., :tk]
    return DecodeSamples(counts.reshape(b, hq, -1)[..., :tk], budgets, mass, key_weights)
