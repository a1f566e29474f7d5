"""Shapes and buffer layout shared by the SANTA decode kernels' host wrappers (``triton_score``,
``triton_prop``, ``triton_flash``; the public module ``triton`` allocates the buffers).

Every block size here is a function of tensor shapes only, never of ``cache_len`` values, so a call's
grids and buffers are fixed by its shapes and the call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

# K is streamed in chunks of SCORE_CHUNK keys, SCORE_STAGES chunks in flight (cp.async), by programs of
# SCORE_WARPS warps, in the score pass and in the flash stream kernel. Small chunks keep each program
# small (8 KB per chunk of bf16 keys at D = 128) so more of them are resident per SM, which hides the
# latency of these memory-bound programs better than wider loads.
SCORE_CHUNK = 32
SCORE_STAGES = 4
SCORE_WARPS = 2


def pow2(x: int, lo: int) -> int:
    """The next power of two ``>= x``, at least ``lo``."""
    return max(lo, triton.next_power_of_2(x))


@dataclass(frozen=True)
class Geometry:
    """Shapes of one decode call and the kernels' padded block sizes."""

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
    def of(cls, q: torch.Tensor, k: torch.Tensor, tile: int) -> "Geometry":
        """q: [B, Hq, D]; k: [B, Hkv, Tk, D] (the whole allocation, not the valid length)."""
        b, hq, d = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        return cls(b, hq, hkv, d, tile, -(-tk // tile), pow2(hq // hkv, 2), pow2(tile, 16), pow2(d, 16))

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def Tk_pad(self) -> int:
        return self.T_all * self.tile

    @property
    def BH(self) -> int:
        return self.B * self.Hkv

    @property
    def BK(self) -> int:
        """Keys per K chunk: SCORE_CHUNK, at most the padded tile."""
        return min(self.BN, pow2(SCORE_CHUNK, 16))

    @property
    def NCH(self) -> int:
        """K chunks per (padded) tile."""
        return self.BN // self.BK


@dataclass(frozen=True)
class ScoreBuffers:
    """What the score pass writes (float32 views of one allocation) and prop's budgets / accumulator."""

    scores: torch.Tensor  # [B·Hq·Tk_pad] q·k·scale
    m: torch.Tensor  # [B·Hq·T_all] tile max scores m_t
    ell: torch.Tensor  # [B·Hq·T_all] ℓ_t = Σ exp(s - m_t)
    budgets: torch.Tensor  # [B·Hq, T_all] int32 S_t
    acc: torch.Tensor  # [B·Hq·BLOCK_D] output accumulator (zeroed by the budget kernel)
    chunk_m: torch.Tensor  # [B·Hq·T_all·NCH] per K chunk: its reference r_c (the tile's running max)
    chunk_l: torch.Tensor  # [B·Hq·T_all·NCH] per K chunk: Σ exp(s - r_c)
