"""Tile sizes of the SAAP Triton kernels (:data:`CONFIG`) and the small host helpers their modules share.

Every kernel module reads ``triton_config.CONFIG`` at each call, so rebinding it (a test's
``monkeypatch.setattr(triton_config, "CONFIG", replace(CONFIG, block_n=16))``) changes every launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 16  # batch rows per classifier tile and query rows per attention tile (tl.dot needs M >= 16)


@dataclass
class SaapTritonConfig:
    """Tile sizes and launch settings of the SAAP kernels, and the thresholds of their run-time rules.

    The defaults are what runs; tests shrink the tiles so that tiny shapes walk several tiles with ragged
    tails, and move a threshold to reach a path at a tiny shape. The rules:

    * classifier path by rows per classifier (B, or B·G for a classifier per KV head):
      ``<= small_batch_max_b``: layer 1 writes the hidden as 16-bit terms,
      layer 2 streams w2 once (:mod:`~runtime_kernels.saap.triton_classifier_small_batch`); larger
      batches: two tensor-core launches (:mod:`~runtime_kernels.saap.triton_classifier_large_batch`).
    * bucket packing by mean bucket size (``bkt_pack = -1``, :func:`runtime_kernels.saap.triton._pack`).
    * window tiles by batch size: at most ``ceil(win_programs / (B · Hkv))`` tiles per (batch, KV head),
      so a batch that fills the GPU anyway streams the window in fewer, longer tiles (fewer partials).
    * ranking: only the keys above a chunk-maximum threshold are sorted when at most
      ``rank_filter · K_PAD`` of them qualify (:mod:`~runtime_kernels.saap.triton_rank`).
    """

    # attention partials (triton._partial_kernel) and their merge
    block_n: int = 64         # keys per step
    min_win_steps: int = 2    # a window tile is at least this many key steps ...
    max_win_tiles: int = 64   # ... and the window at most this many tiles per (batch, KV head)
    win_programs: int = 256   # window-tile budget per launch (see above)
    bkt_pack: int = -1        # buckets per bucket program, walked as one key list: -1 by mean bucket size;
                              # 0 (one each) or a power of two fixes it (tests reach every packing this way)
    attn_warps: int = 4
    attn_stages: int = 2      # most programs walk 1-3 key steps: occupancy matters more than deep pipelines
    merge_block_p: int = 64   # partials per merge step: one step for the usual 36-48 partials
    merge_block_d: int = 32
    # classifier, rows <= small_batch_max_b: layer 1 (GEMV or tensor cores) + the w2 stream of layer 2;
    # 32 takes a classifier per KV head at B = 8 (G = 4): w2 read once per 16 rows in three terms
    small_batch_max_b: int = 32
    l1_dot_block_n: int = 64  # tensor-core layer 1: hidden units per program
    l1_dot_block_k: int = 64
    gemv1_block_n: int = 64   # GEMV layer 1 (float32 products): hidden units per program
    gemv_block_k: int = 64    # its k rows per step times padded batch rows (the [R, K, N] product tile)
    gemv_warps: int = 4
    l2_block_k: int = 64
    l2_block_n: int = 128     # logit columns per layer-2 program
    l2_rows: int = 16         # batch rows per layer-2 program (4 tile rows each: three terms and a zero row)
    l2_warps: int = 4
    l2_stages: int = 4        # w2 tiles in flight per program
    # classifier, larger batches: one tensor-core launch per layer
    linear_block_k: int = 64
    linear_block_n: int = 128
    linear_warps: int = 4
    linear_stages: int = 4    # 16 steps of 16 KB weight tiles per program at hidden = C = 1024
    # ranking
    rank_filter: int = 4      # 0: sort every key (tests compare the filter against it)
    rank_warps: int = 8
    poison: bool = False      # fill outputs and partials with NaN (-1 for ids) before the launches (tests)


CONFIG = SaapTritonConfig()


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer: uninitialized, or with ``CONFIG.poison`` NaN (floats) / -1 (ids), so an element a
    kernel does not write shows in the result."""
    if CONFIG.poison:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
