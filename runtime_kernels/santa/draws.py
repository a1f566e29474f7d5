"""Sampling offsets of a decode step as a pure function of (seed, layer, query position, row, head, slot).

Why not a ``torch.Generator`` stream: a decode step captured in a CUDA graph must draw fresh offsets on
every replay without the host, and the serving path (static cache, graphs) must sample exactly what
the eager path samples, so that both generate the same tokens for a seed. A counter-based hash of the
step's coordinates gives both: the same query position in the same layer always draws the same
offsets, consecutive positions draw independent-looking ones, and the computation is a few
element-wise integer kernels on tensors the graph owns (no host value, no allocation outside the pool).

The hash is the 32-bit integer finalizer of MurmurHash3 applied round by round to each coordinate
(values kept below 2^32 in int64, multiplied in 16-bit halves so no product overflows); offsets are ``(h + 0.5) / 2^32`` in
float64, never 0 or 1. Statistical quality is far beyond what systematic sampling's one offset per
tile needs (tests check uniformity and independence across positions, layers, heads and tiles).
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

_MASK = 0xFFFFFFFF
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3 fmix32 multipliers (both < 2^32)


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x · m mod 2^32`` for int64 ``x`` in ``[0, 2^32)``, with every partial product below 2^49."""
    hi, lo = x >> 16, x & 0xFFFF
    return ((((hi * m) & 0xFFFF) << 16) + lo * m) & _MASK


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer on int64 values in ``[0, 2^32)``."""
    x = _mul32(x ^ (x >> 16), _M1)
    x = _mul32(x ^ (x >> 13), _M2)
    return x ^ (x >> 16)


def _mix(x: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """One round: fold ``value`` (int or int64 tensor) into the hash state ``x``."""
    return _fmix32(x ^ (value & _MASK if isinstance(value, int) else value & _MASK))


def keyed_uniforms(seed: int | torch.Tensor, layers: torch.Tensor | int, position: torch.Tensor, heads: int,
                   slots: int) -> torch.Tensor:
    """Offsets in ``(0, 1)`` float64, shape ``[L, B, heads, slots]``.

    seed: the runtime's seed, or ``[B]`` int64 seeds, one per row (then the row index is not a
    coordinate: row ``b`` draws exactly what it would draw alone, as the only row, under ``seed[b]``,
    so a question's samples do not depend on the batch it is answered in); layers: ``[L]`` int64 (or
    one int: ``L = 1``); position: ``[B]`` int64, the query's position in its sequence (on the device
    the offsets are wanted on); slots: offsets per head (tiles for prop / flash tilings, samples for
    ``tiling="none"``).
    """
    device = position.device
    layer = torch.as_tensor(layers, dtype=torch.int64, device=device).reshape(-1, 1, 1, 1)  # [L,1,1,1]
    pos = position.to(torch.int64).reshape(1, -1, 1, 1)  # [1, B, 1, 1]
    if isinstance(seed, torch.Tensor):
        if seed.shape != position.shape:
            raise ValueError(f"one seed per row: seeds {tuple(seed.shape)}, positions {tuple(position.shape)}")
        x = _fmix32(seed.to(device=device, dtype=torch.int64).reshape(1, -1, 1, 1) & _MASK)  # [1, B, 1, 1]
        row = torch.zeros_like(pos)
    else:
        x = _fmix32(torch.full((1, 1, 1, 1), int(seed) & _MASK, dtype=torch.int64, device=device))
        row = torch.arange(pos.shape[1], dtype=torch.int64, device=device).reshape(1, -1, 1, 1)
    head = torch.arange(heads, dtype=torch.int64, device=device).reshape(1, 1, -1, 1)
    slot = torch.arange(slots, dtype=torch.int64, device=device).reshape(1, 1, 1, -1)
    x = _mix(_mix(x, layer), pos)  # [L, B, 1, 1]
    x = _mix(_mix(x, row), head)  # [L, B, H, 1]
    x = _mix(x, slot)  # [L, B, H, slots]
    return (x.double() + 0.5) * (1.0 / 4294967296.0)


class SamplingSeeds:
    """A runtime's seeds: one for the whole batch (``int``; ``None`` picks one at random), or one per batch
    row (a sequence of ints; a batch must then have exactly that many rows).

    Per-row seeds make a row's samples a function of its own seed: decode offsets key on the row's seed
    instead of its index (:func:`keyed_uniforms`), and prefill draws each row from its own generator, so
    a question answered in a batch samples what it samples alone under that seed (REINFORCE's rewards
    batch their questions this way: ``calib.santa.reward``).
    """

    def __init__(self, seed: int | Sequence[int] | None) -> None:
        if seed is None:
            seed = int(torch.randint(0, 2**31, ()).item())
        if isinstance(seed, numbers.Integral) or (isinstance(seed, torch.Tensor) and seed.dim() == 0):
            self.value: int | None = int(seed)
            self.rows: tuple[int, ...] | None = None
        else:
            self.rows = tuple(int(x) for x in seed)
            self.value = None
            if not self.rows:
                raise ValueError("per-row seeds: got an empty sequence")
        self._tensors: dict[str, torch.Tensor] = {}
        self._generators: dict[str, list[torch.Generator]] = {}

    def _check(self, batch: int) -> None:
        if self.rows is not None and batch != len(self.rows):
            raise ValueError(f"{len(self.rows)} per-row seeds for a batch of {batch} rows; reseed for this batch")

    def key(self, device: torch.device, batch: int) -> int | torch.Tensor:
        """The ``seed`` argument of :func:`keyed_uniforms` for a batch of ``batch`` rows on ``device``."""
        if self.rows is None:
            return int(self.value)
        self._check(batch)
        where = str(device)
        if where not in self._tensors:  # made once (eagerly, before any graph capture) and reused
            self._tensors[where] = torch.tensor(self.rows, dtype=torch.int64, device=device)
        return self._tensors[where]

    def generators(self, device: torch.device, batch: int, rows: slice | list[int] | None = None
                   ) -> list[torch.Generator]:
        """Prefill generators on ``device``: one for the batch, or one per row; each continues its stream
        from call to call (layer after layer). ``rows``: the call covers only these rows of the batch
        (a ragged batch prefills a run of rows at a time), so per-row seeds give those rows' generators."""
        where = str(device)
        if where not in self._generators:
            seeds = (self.value,) if self.rows is None else self.rows
            self._generators[where] = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        gens = self._generators[where]
        if rows is not None and self.rows is not None:
            picked = gens[rows] if isinstance(rows, slice) else [gens[i] for i in rows]
            if len(picked) != batch:
                raise ValueError(f"{len(self.rows)} per-row seeds; rows {rows} of them do not "
                                 f"cover a call of {batch} rows")
            return picked
        self._check(batch)
        return gens
