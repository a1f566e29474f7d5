"""Decode tilings of S²ANTA (Lee et al., arXiv:2605.01910, §3.2–§3.3, App. P and Q): tile statistics and budgets.

The key axis of one decode row (one ``(b, head)``) is cut into tiles of ``tile`` keys,
``𝒯_t = [t·tile, min((t+1)·tile, L_b))`` for ``t < T_b = ceil(L_b / tile)`` where ``L_b`` is the
valid cache length of batch row ``b``. Per tile (App. P, Alg. 3; :func:`tile_statistics`):

* ``m_t = max_{n∈𝒯_t} s_n`` (tile max score), ``u_n = exp(s_n - m_t)`` (in-tile weights, ``≤ 1``),
  ``ℓ_t = Σ_{n∈𝒯_t} u_n`` (``≥ 1`` for a valid tile);
* tile weight ``W_t = exp(m_t - m*) · ℓ_t`` with ``m* = max_t m_t``; tile mass ``m̄_t = W_t / Σ_t W_t``
  (the softmax mass of the tile).

Budgets: prop (App. P, Alg. 4) apportions ``S · m̄_t`` by largest remainder, ties to the lower tile,
``Σ_t S_t = S`` exactly (:func:`prop_tile_budgets`); flash (App. Q, Alg. 6) gives every valid tile
``S_tile = max(1, round_half_up(S / T_b))`` in integers, ``(2·S + T_b) // (2·T_b)`` (:func:`flash_tile_budget`).
All of this is float64 in the reference; a float32 kernel can differ from it only where a quota sits
within rounding of a tie or an integer.
"""

from __future__ import annotations

import torch


def num_tiles(length: torch.Tensor, tile: int) -> torch.Tensor:
    """Tiles covering ``length`` keys: ``ceil(length / tile)`` (int64, same shape as ``length``)."""
    return (length + (tile - 1)) // tile


def flash_tile_budget(num_samples: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """S²ANTA-flash per-tile budget ``max(1, round_half_up(S / T))``, all integer arithmetic.

    num_samples: [B] int64 (S per batch row, already ``>= 1``); tiles: [B] int64 (``T_b >= 1``).
    Returns [B] int64.
    """
    return torch.clamp_min((2 * num_samples + tiles) // (2 * tiles), 1)


def largest_remainder(
    quotas: torch.Tensor, total: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Integer apportionment by largest remainder.

    quotas: [..., T] float64, non-negative, summing (up to rounding) to ``total``;
    total: [...] int64; valid: [..., T] bool (invalid slots never receive a sample).
    Returns [..., T] int64 ``floor(quotas)`` plus one for the ``total - Σ floor`` valid slots with the
    largest fractional part; ties go to the lower index (stable sort). Sums exactly to ``total``.
    """
    floors = torch.floor(quotas)
    frac = quotas - floors
    floors = floors.to(torch.int64)
    if valid is not None:
        floors = torch.where(valid, floors, torch.zeros_like(floors))
        frac = torch.where(valid, frac, torch.full_like(frac, -1.0))
    remainder = (total - floors.sum(-1)).clamp_min(0)  # [...]
    order = torch.sort(frac, dim=-1, descending=True, stable=True).indices  # [..., T]
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return floors + (rank < remainder.unsqueeze(-1)).to(torch.int64)


def tile_statistics(
    scores: torch.Tensor, key_valid: torch.Tensor, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tile in-tile weights and tile masses (App. P, Alg. 3 and Alg. 4 line 3).

    scores: [B, H, Tk] float64 (any value where ``key_valid`` is False, NaN included);
    key_valid: [B, Tk] bool. Returns

    * ``u``: [B, H, T, tile] float64, ``exp(s_n - m_t)`` for valid keys, 0 elsewhere (keys padded to
      ``T·tile`` with ``T = ceil(Tk / tile)``);
    * ``mass``: [B, H, T] float64 tile softmax masses ``W_t / Σ W`` (0 for tiles without a valid key);
    * ``tile_valid``: [B, T] bool, tiles holding at least one valid key.
    """
    b, h, tk = scores.shape
    n_tiles = -(-tk // tile)
    pad = n_tiles * tile - tk
    s = torch.where(key_valid[:, None, :], scores, torch.full_like(scores, float("-inf")))
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).view(b, h, n_tiles, tile)
    valid = torch.nn.functional.pad(key_valid, (0, pad), value=False).view(b, 1, n_tiles, tile)
    tile_valid = valid.any(-1)  # [B, 1, T]
    m_t = s.amax(-1)  # [B, H, T], -inf on empty tiles
    m_safe = torch.where(tile_valid, m_t, torch.zeros_like(m_t))
    u = torch.where(valid, torch.exp(s - m_safe.unsqueeze(-1)), torch.zeros_like(s))
    ell = u.sum(-1)  # [B, H, T]
    m_star = m_t.amax(-1, keepdim=True)  # [B, H, 1]
    w = torch.where(tile_valid, torch.exp(m_safe - m_star) * ell, torch.zeros_like(ell))
    mass = w / w.sum(-1, keepdim=True)
    return u, mass, tile_valid[:, 0]


def prop_tile_budgets(
    mass: torch.Tensor, num_samples: torch.Tensor, tile_valid: torch.Tensor
) -> torch.Tensor:
    """S²ANTA-prop budgets: largest remainder of ``S · mass`` per (b, head).

    mass: [B, H, T] float64 tile masses; num_samples: [B] int64; tile_valid: [B, T] bool.
    Returns [B, H, T] int64 with ``Σ_t S_t = S_b``.
    """
    total = num_samples[:, None].expand(mass.shape[:2])
    quotas = mass * num_samples[:, None, None].to(mass.dtype)
    return largest_remainder(quotas, total, tile_valid[:, None, :].expand_as(mass))
