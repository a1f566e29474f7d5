"""Tile sizes and schedule switches of the SAAP Triton kernels (:data:`CONFIG`), and the small host
helpers both kernel modules share (:mod:`runtime_kernels.saap.triton`,
:mod:`runtime_kernels.saap.triton_classifier`).

Both modules read ``triton_config.CONFIG`` at every call, so rebinding it here (tests' monkeypatch,
``scripts/bench_decode.py --saap-config``) changes every launch at once."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

ROWS = 16  # batch rows per classifier tile and query rows per attention tile (tl.dot needs M >= 16)


@dataclass
class SaapTritonConfig:
    """Tile sizes and schedule switches (module-level :data:`CONFIG`; tests shrink the tiles to exercise
    several tiles on tiny shapes; ``scripts/bench_decode.py --saap-config / --saap-variants`` time others).

    Attention: ``block_n`` keys per step; the dense region is cut into tiles of
    ``block_n · max(min_win_steps, ceil(n_dense / (max_win_tiles · block_n)))`` keys; each bucket program
    walks ``bkt_per_prog`` consecutive selected buckets, each bucket split over ``bkt_split`` programs
    (chunks of ``ceil(count / bkt_split)`` keys). ``overlap_window``: the window partials run on a side
    stream under the classifier and ranking (CUDA only; fork/join by events, graph-capturable).

    Classifier, ``B <= cls_gemv_max_b``: the GEMV kernels (``gemv_*``; float32 FMA, layer 2 split over
    ``gemv_k_split`` hidden chunks whose partial logits the ranking sums). Larger batches, ``cls_fused = 1``: one launch, one program per (query head, ``cls_block_h`` hidden units,
    ``cls_n_split``-th of the C logits, 16 batch rows) computing its hidden slice (layer 1) and that
    slice's contribution to the logits (layer 2, ``cls_block_n`` columns per step); the last of the
    ``hidden / cls_block_h`` programs of a (head, column range, rows) to finish sums the partials in a
    fixed order (deterministic). ``cls_fused = 0``: the two-launch path (``linear_*``).
    """

    block_n: int = 64
    min_win_steps: int = 2
    max_win_tiles: int = 64
    win_programs: int = 256   # > 0: at most ceil(this / (B·Hkv)) window tiles per (batch, KV head), so large
                              # batches stream the window in longer tiles (0: max_win_tiles alone). H200
                              # 2026-11-21 graphed, l=32, two runs: B=8 8k 84.1 -> 79.7 us (128: 88.4); B=1 and
                              # B=8 128k unchanged (docs/bench/2026-11-21-h200/saap_win_programs.txt)
    bkt_split: int = 1
    bkt_per_prog: int = 1
    bkt_pack: int = -1        # > 0 (a power of 2): each bucket program walks this many selected buckets as one
                              # concatenated key list (vector lookups, prefix-summed counts); 0: off; -1 (auto): as
                              # many as fill one block_n step at the mean bucket size, 2..8 (triton._pack). H200
                              # 2026-11-21 run 75, graphed, C = 1024: 8k B=8 l=64 84.3 -> 65.3 us (pack 4; 1.06x
                              # SDPA), l=32 66.2 -> 62.7; 32k B=8 l=64 87.1 -> 76.1; 128k: slower (not packed)
    # Defaults from the H200 variant run (2026-11-21, bench_decode.py --saap-variants, graphed, ℓ=32): the
    # two-launch classifier (46 µs alone at 128k B=1) beat the fused split-K one (147 µs; 93 µs with
    # 128-wide hidden tiles), and overlapping the window on a side stream bought nothing.
    overlap_window: int = 0
    attn_warps: int = 4
    attn_stages: int = 2  # most programs walk 1-3 key steps: occupancy matters more than deep pipelines
    attn_prefetch_v: int = 0  # 1: load each step's V rows together with its K rows (latency vs registers)
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
    # small-batch classifier (B <= cls_gemv_max_b): weight-streaming GEMV on CUDA cores, split-K layer 2
    cls_gemv_max_b: int = 2
    cls_bmm_max_b: int = 16   # B <= this (checked before the GEMV): layer 1 GEMV writing the hidden as three
                              # bf16 terms, layer 2 one cuBLAS bmm with float32 output (the ranking sums the
                              # terms). H200 2026-11-21, 128k l=32 graphed: B=1 step 59.9 -> 51.8 us (select
                              # 43.6 -> 35.4: bmm 20.1 us = 3.3 TB/s vs the GEMV's 28.5), B=8 116.2 -> 107.6
    l1_dot_min_b: int = 1     # bmm path, B >= this and a query of the weights' 16-bit dtype: layer 1 on tensor
                              # cores (exact products; 0: always the GEMV). H200 2026-11-21: layer 1 alone at B=8
                              # 15.5 -> 7.7 us; step 8k B=8 79.5 -> 71.9 us, 128k B=1 50.0 -> 49.1 (saap_layer1_dot.txt)
    l1_dot_block_n: int = 64
    l1_dot_block_k: int = 64  # k step of the tensor-core layer 1 (D = 128: two steps)
    l2_triton: int = 1        # bmm path: layer 2 as Triton's pipelined w2 stream (_layer2_kernel, the three
                              # terms summed in its epilogue; 0: cuBLAS bmm). H200 2026-11-21 graphed, l=32, three
                              # runs: 128k B=1 step -1.5..-1.9 us, 8k B=8 -1.5 (saap_layer2_triton.txt)
    l2_bias: int = 1          # Triton layer 2 adds b2 in its epilogue (its DRAM load hidden under the w2 stream,
                              # not opening the ranking). H200 2026-11-21 graphed, l=32, with rank_count=0: 128k
                              # B=1 44.2 -> 43.5 us, 8k B=1 41.3 -> 40.5 (docs/bench/2026-11-21-h200/saap_rank_b2.txt).
                              # Also measured there and removed: per-tile softmax max / sum written by layer 2 so the
                              # ranking skips its reductions over C (layer 2 +0.8 us, ranking -0.2: 44.1)
    l2_block_k: int = 64
    l2_block_n: int = 128     # 64: ~0.1-0.8 us slower; 32: +8 us
    l2_rows: int = 16         # batch rows per layer-2 program (4 tile rows each: three terms and a zero row)
    l2_warps: int = 4
    l2_stages: int = 4
    gemv1_block_n: int = 64   # layer 1: hidden units per program (K = D in one pass)
    gemv_block_k: int = 64    # k rows per step (both layers)
    gemv_block_n: int = 128   # layer 2: logit columns per program (256 B of each weight row); H200 variants
                              # at 128k B=1 (cls + rank): 47.5 us at 128, 50.6 at 64, 54.0 at 256, 61.7+ whole rows
    gemv_k_split: int = 4     # layer 2: hidden chunks per column block (programs: Hq x C/128 x 4 = 1024); every
                              # extra chunk costs the ranking ~1.4 us (2: 48.6, 8: 56.2 at block 64)
    gemv_warps: int = 4
    gemv_atomic: int = 0      # 1: layer 2 adds its chunks into b2-initialized logits with float32 atomics
    rank_filter: int = 4      # > 0: sort only the keys >= the smallest of K_PAD chunk maxima when at most
                              # rank_filter * K_PAD of them qualify (compacted through a small scratch row).
                              # H200 graphed, 128k l=32: B=1 51.1 -> 50.3 us, B=8 112.9 -> 105.6 (the bench's
                              # random classifier is flat: ~90-140 candidates of 1024; a trained one is peakier)
    rank_chunks: int = 2      # the filter's threshold: the K_PAD-th largest of rank_chunks · K_PAD chunk maxima
                              # (1: the smallest of K_PAD). The bench's flat random classifier at l=32: ~110 (up
                              # to 209) candidates at 1, so some rows fell back to sorting all 1024; ~44 (max 55) at 2
    rank_count: int = 0       # 1: the filtered candidates placed by counting larger keys instead of a bitonic
                              # sort of the compacted ones. Alone on one logits row all schedules are 8.0-8.8 us; in
                              # the step the sort is 0.6-1.0 us faster at all four shapes (H200 2026-11-21, runs 63,
                              # 64, 66: 128k B=1 45.0 -> 44.2 us; saap_rank_b2.txt), so 0 since session 11
    rank_warps: int = 8       # the per-(batch, KV head) softmax + group sum + bitonic top-ℓ program (bmm path,
                              # 128k B=1: 2 warps 60.8 us, 4: 51.8, 8: 51.1, 16: 52.4)
    merge_block_p: int = 64   # partials per merge step: one step for the usual 36-48 partials. H200 2026-11-21
                              # graphed vs 16: 128k B=1 49.1 -> 46.3 us, 8k B=8 71.3 -> 68.2 (saap_merge_variants.txt)
    merge_block_d: int = 32
    poison: bool = False  # fill outputs and partials with NaN before the launches (tests)


def from_env(value: str | None) -> SaapTritonConfig:
    """``SAAP_TRITON_CONFIG="cls_bmm_max_b=16,rank_warps=8"``: defaults with these integer fields replaced
    (a whole test or benchmark run under another schedule); unknown names are refused."""
    cfg = SaapTritonConfig()
    for item in filter(None, (value or "").replace(" ", "").split(",")):
        name, _, raw = item.partition("=")
        if name not in SaapTritonConfig.__dataclass_fields__ or not raw.lstrip("-").isdigit():
            raise ValueError(f"SAAP_TRITON_CONFIG: expected name=int with a SaapTritonConfig field, got {item!r}")
        cfg = replace(cfg, **{name: int(raw)})
    return cfg


CONFIG = from_env(os.environ.get("SAAP_TRITON_CONFIG"))


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if CONFIG.poison:  # NaN (floats) or -1 (bucket ids): an unwritten element shows in the result
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
