"""SANTA / S²ANTA sampled value aggregation, plain PyTorch: the definition of correct.

Paper: Lee et al., arXiv:2605.01910, §2, §2.1, §3, App. A, P, Q; decisions: docs/methods.md, SANTA / S²ANTA.

Every estimator here replaces ``Σ_n p_n V_n`` (``p`` = softmax row of one query) by an average of
sampled rows of ``V``, ``(1/S) Σ_j V[F⁻¹(t_j)]`` (unbiased for ``p·V``). The randomness is always explicit:
callers pass uniform offsets in ``[0, 1)`` (the public API in ``api.py`` draws them from a
``torch.Generator`` when asked). How offsets become points is :func:`sample_points`, how points become
keys is :func:`inverse_cdf` (one rule for every estimator and tiling), and the decode tilings are
:func:`santa_decode_forward`'s, so a GPU kernel given the same offsets draws the same keys.

Precision: the dot products ``q·k`` run in float32 (float64 for float64 inputs), as in a kernel; from
the scores on (max, ``exp``, cumulative sums, points ``t·Z``, tile masses and budgets) everything is
float64, so the reference applies the rules essentially exactly. A kernel that keeps float32
cumulative sums agrees except where a point lies within float32 rounding of a cumulative boundary (or
a prop quota within rounding of a tie): rare, and a test comparing per-row counts must allow it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from runtime_kernels.santa.tiling import (
    flash_tile_budget,
    num_tiles,
    prop_tile_budgets,
    tile_statistics,
)

ESTIMATORS = ("iid", "strat", "sys")
TILINGS = ("prop", "flash", "none")
_CHUNK_ELEMENTS = 1 << 22  # float64 elements per prefill query chunk (bounds reference memory)
_GATHER_RATIO = 64  # prefill: gather sampled V rows while S * this < keys, else counts @ V
_CAUSAL_ROWS = 64  # query rows per causal prefill chunk (each row's draws do not depend on the chunking)


def _scores64(q: torch.Tensor, k: torch.Tensor, scale: float, exact: bool = False) -> torch.Tensor:
    """Scaled scores with GQA, returned as float64. q: [B, Hq, Tq, D], k: [B, Hkv, Tk, D] -> [B, Hq, Tq, Tk].

    Query head ``h`` reads KV head ``h // (Hq // Hkv)``. The dot products run in float32 (float64 for
    float64 inputs or ``exact``), like a kernel's; everything after them (softmax weights, cumulative
    sums) is float64.
    """
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    dt = torch.float64 if exact else torch.promote_types(q.dtype, torch.float32)
    qg = q.to(dt).reshape(b, hkv, hq // hkv, tq, d)
    s = torch.einsum("bkgqd,bknd->bkgqn", qg, k.to(dt)) * scale  # [B, Hkv, G, Tq, Tk]
    return s.reshape(b, hq, tq, tk).to(torch.float64)


def _weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``Σ_n weights_n V_n`` in float64. weights: [B, Hq, Tq, Tk], v: [B, Hkv, Tk, D] -> [B, Hq, Tq, D]."""
    b, hq, tq, tk = weights.shape
    hkv = v.shape[1]
    w = weights.to(torch.float64).reshape(b, hkv, (hq // hkv) * tq, tk)
    return torch.matmul(w, v.to(torch.float64)).reshape(b, hq, tq, v.shape[-1])


def _allowed_keys(
    b: int, tq: int, tk: int, causal: bool, key_len: torch.Tensor | None, device: torch.device,
    rows: tuple[int, int] | None = None, n_keys: int | None = None,
) -> torch.Tensor:
    """[B, 1, rows, n_keys] bool: query i (absolute position ``Tk - Tq + i``) may read key n.

    ``rows = (lo, hi)`` restricts to query rows ``lo:hi`` and ``n_keys`` to the first keys.
    """
    lo, hi = rows if rows is not None else (0, tq)
    n = torch.arange(tk if n_keys is None else n_keys, device=device)
    allowed = torch.ones(b, 1, hi - lo, n.numel(), dtype=torch.bool, device=device)
    if causal:
        pos = torch.arange(tk - tq + lo, tk - tq + hi, device=device)
        allowed = allowed & (n[None, :] <= pos[:, None])[None, None]
    if key_len is not None:
        allowed = allowed & (n[None, :] < key_len[:, None])[:, None, None, :]
    return allowed


def inverse_cdf(cum: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Key index per target: the inverse CDF of one sampled distribution.

    For a whole query row, or one tile of a decode row, let ``w_n >= 0`` be its unnormalized float64
    weights (``w_n = exp(s_n - max s)``, 0 for masked keys), ``C_n = Σ_{i<=n} w_i`` the inclusive float64
    cumulative sum and ``Z = C_{N-1}``. A point ``t ∈ [0, 1)`` selects key ``F⁻¹(t) = #{n : C_n <= t·Z}``
    (the smallest ``n`` with ``C_n > t·Z``: ``searchsorted(right=True)``), clamped to the first ``n`` with
    ``C_n = Z`` (the last key of positive weight) in case ``t·Z`` rounds up to ``Z``. This is App. A.4's
    convention (key ``n`` owns ``[C_{n-1}/Z, C_n/Z)``), so masked and zero-weight keys are never drawn.

    cum: [..., N] float64 inclusive cumulative weights (non-decreasing, total ``Z = cum[..., -1] > 0``);
    targets: [..., M] float64 points already scaled by ``Z`` (``t·Z``). Returns [..., M] int64
    ``#{n : cum_n <= target}`` clamped to the first ``n`` with ``cum_n = Z``.
    """
    cum = cum.contiguous()
    idx = torch.searchsorted(cum, targets.contiguous(), right=True)
    last = torch.searchsorted(cum, cum[..., -1:].contiguous(), right=False)  # [..., 1]
    return torch.minimum(idx, last)


def _indices_from_points(weights: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Sampled key per point. weights: [..., N] float64 ``>= 0`` (positive sum); points: [..., M]."""
    cum = torch.cumsum(weights, dim=-1)
    return inverse_cdf(cum, points * cum[..., -1:])


def counts_from_points(weights: torch.Tensor, points: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-key sample counts from points in ``[0, 1)``.

    weights: [..., N] float64 ``>= 0`` with a positive sum; points: [..., M] float64;
    valid: bool broadcastable to points (False: the point is padding and draws nothing).
    Returns [..., N] int64 counts (``Σ = number of valid points``).
    """
    idx = _indices_from_points(weights, points)
    counts = torch.zeros_like(weights, dtype=torch.int64)
    return counts.scatter_add_(-1, idx, valid.expand_as(idx).to(torch.int64))


def sample_points(
    estimator: str, num_samples: torch.Tensor, uniforms: torch.Tensor, s_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Points ``t_j`` of one estimator (``S`` samples, ``j = 0..S-1``):

    * ``iid`` (SANTA, with replacement): ``t_j = u_j``; offsets ``[B, Hq, Tq, S]``.
    * ``strat`` (S²ANTA-strat): ``t_j = (j + u_j) / S``; offsets ``[B, Hq, Tq, S]``.
    * ``sys`` (S²ANTA-sys): ``t_j = (j + u) / S`` with ONE ``u`` per query; offsets ``[B, Hq, Tq]``. Key ``n``
      then receives ``ceil(S·C_n/Z - u) - ceil(S·C_{n-1}/Z - u)`` samples (the streaming form a kernel
      uses; App. P's ``floor(a + p + x) - floor(a + p)`` is the same with ``a = 1 - u`` up to which side of
      a boundary is closed).

    num_samples: [B] int64 ``>= 1``; uniforms: [B, H, Tq] (sys) or [B, H, Tq, s_max] (iid, strat).
    Returns points [B, H, Tq, s_max] float64 and valid [B, 1, 1, s_max] bool (``j < S_b``).
    """
    j = torch.arange(s_max, dtype=torch.float64, device=uniforms.device)
    s = num_samples.to(torch.float64)[:, None, None, None]  # [B, 1, 1, 1]
    u = uniforms.to(torch.float64)
    if estimator == "sys":
        points = (j + u.unsqueeze(-1)) / s
    elif estimator == "strat":
        points = (j + u) / s
    elif estimator == "iid":
        points = u.clone()
    else:
        raise ValueError(f"unknown estimator {estimator!r}; use one of {ESTIMATORS}")
    valid = j < s
    return points.masked_fill_(~valid, 0.0), valid


def _prefill_indices(
    q: torch.Tensor,
    k: torch.Tensor,
    num_samples: torch.Tensor,
    estimator: str,
    causal: bool,
    scale: float,
    uniforms: torch.Tensor,
    key_len: torch.Tensor | None,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Sampled keys for query rows ``lo:hi``, chunk by chunk (bounded memory).

    Yields ``(lo, hi, idx [B, Hq, hi-lo, max S] int64, valid [B, 1, 1, max S] bool)``.
    """
    b, hq, tq, _ = q.shape
    tk = k.shape[2]
    s_max = int(num_samples.max())
    step = max(1, _CHUNK_ELEMENTS // max(1, b * hq * max(tk, s_max)))
    if causal:  # a chunk reads keys up to its last row: short chunks skip most of the masked upper triangle
        step = min(step, _CAUSAL_ROWS)
    for lo in range(0, tq, step):
        hi = min(tq, lo + step)
        n_keys = tk - tq + hi if causal else tk  # later keys are masked for every row of the chunk
        s = _scores64(q[:, :, lo:hi], k[:, :, :n_keys], scale)  # [B, Hq, c, n_keys]
        masked = ~_allowed_keys(b, tq, tk, causal, key_len, q.device, (lo, hi), n_keys)
        s.masked_fill_(masked, float("-inf"))
        w = s.sub_(s.amax(-1, keepdim=True)).exp_()  # masked keys: exp(-inf) = 0
        points, valid = sample_points(estimator, num_samples, uniforms[:, :, lo:hi], s_max)
        yield lo, hi, _indices_from_points(w, points), valid


def per_row_sample_counts(
    q: torch.Tensor,
    k: torch.Tensor,
    num_samples: torch.Tensor,
    *,
    estimator: str,
    causal: bool,
    scale: float,
    uniforms: torch.Tensor,
    key_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many of its samples each query row puts on each key.

    q: [B, Hq, Tq, D]; k: [B, Hkv, Tk, D]; num_samples: [B] int64 ``>= 1``;
    uniforms: [B, Hq, Tq] (sys) or [B, Hq, Tq, max S] (iid, strat), in ``[0, 1)``;
    key_len: [B] int64 valid keys per batch row (None: all ``Tk``).
    Returns [B, Hq, Tq, Tk] int64 with row sums ``S_b``; zero on masked keys.
    """
    b, hq, tq, _ = q.shape
    counts = torch.zeros(b, hq, tq, k.shape[2], dtype=torch.int64, device=q.device)
    chunks = _prefill_indices(q, k, num_samples, estimator, causal, scale, uniforms, key_len)
    for lo, hi, idx, valid in chunks:
        counts[:, :, lo:hi].scatter_add_(-1, idx, valid.expand_as(idx).to(torch.int64))
    return counts


def santa_prefill_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_samples: torch.Tensor,
    *,
    estimator: str,
    causal: bool,
    scale: float,
    uniforms: torch.Tensor,
    key_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """SANTA / S²ANTA estimate per query row (backend contract of ``api.santa_attention``).

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D]; num_samples: [B] int64 ``>= 1``; uniforms as in
    ``per_row_sample_counts``. Returns [B, Hq, Tq, D] in ``q.dtype``: ``(1/S_b) Σ_j V[key_j]``, summed
    in float32 (float64 for float64 inputs): the gathered rows when S is small against the keys, else
    the per-key sample counts times V (the same keys, a different summation order).
    """
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    acc = torch.promote_types(v.dtype, torch.float32)
    out = torch.empty(b, hq, tq, d, dtype=acc, device=q.device)
    inv_s = 1.0 / num_samples.to(acc)[:, None, None, None]
    chunks = _prefill_indices(q, k, num_samples, estimator, causal, scale, uniforms, key_len)
    for lo, hi, idx, valid in chunks:
        c, m = hi - lo, idx.shape[-1]
        n_keys = tk - tq + hi if causal else tk  # idx < n_keys
        if m * _GATHER_RATIO < n_keys:  # few samples per row: gather the sampled rows of V
            flat = idx.reshape(b, hkv, -1, 1).expand(-1, -1, -1, d)  # [B, Hkv, G·c·m, D]
            rows = torch.gather(v, 2, flat).reshape(b, hq, c, m, d).to(acc)
            rows = rows.masked_fill_(~valid[..., None], 0.0)  # padding samples (j >= S_b)
            out[:, :, lo:hi] = rows.sum(-2) * inv_s
        else:  # many: samples per key times V (one matmul), the same sum in another order
            counts = torch.zeros(b, hq, c, n_keys, dtype=acc, device=q.device)
            counts.scatter_add_(-1, idx, valid.expand_as(idx).to(acc))
            rows = torch.matmul(counts.reshape(b, hkv, -1, n_keys), v[:, :, :n_keys].to(acc))  # [B, Hkv, G·c, D]
            out[:, :, lo:hi] = rows.reshape(b, hq, c, d) * inv_s
    return out.to(q.dtype)


class DecodeSamples(NamedTuple):
    """What a tiled decode step drew (all float64 / int64)."""

    counts: torch.Tensor  # [B, Hq, Tk] samples per key
    tile_budgets: torch.Tensor  # [B, Hq, T] S_t (0 on tiles past the cache length)
    tile_mass: torch.Tensor  # [B, Hq, T] softmax mass of each tile
    key_weights: torch.Tensor  # [B, Hq, Tk] the estimate is Σ_n key_weights_n V_n


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
    """Tiled S²ANTA-sys draws for one decode step (prop or flash; module docstring).

    q: [B, Hq, D]; k_cache: [B, Hkv, Tk, D]; num_samples: [B] int64 ``>= 1``;
    tile_uniforms: [B, Hq, ceil(Tk / tile)] in ``[0, 1)`` (one per (b, head, tile); entries of tiles
    past ``cache_len`` are ignored); cache_len: [B] int64 in ``[1, Tk]``.
    """
    b, hq, _ = q.shape
    tk = k_cache.shape[2]
    s = _scores64(q[:, :, None], k_cache, scale)[:, :, 0]  # [B, Hq, Tk]
    key_valid = torch.arange(tk, device=q.device)[None, :] < cache_len[:, None]  # [B, Tk]
    u, mass, tile_valid = tile_statistics(s, key_valid, tile)  # [B,Hq,T,tile], [B,Hq,T], [B,T]
    n_t = u.shape[2]
    if tiling == "prop":
        budgets = prop_tile_budgets(mass, num_samples, tile_valid)  # [B, Hq, T]
        per_sample = 1.0 / num_samples.to(torch.float64)[:, None, None].expand(b, hq, n_t)
    elif tiling == "flash":
        s_tile = flash_tile_budget(num_samples, num_tiles(cache_len, tile))  # [B]
        budgets = torch.where(tile_valid[:, None, :], s_tile[:, None, None], 0).expand(b, hq, n_t)
        per_sample = mass / s_tile.to(torch.float64)[:, None, None]  # weight m̄_t / S_tile
    else:
        raise ValueError(f"unknown tiling {tiling!r}; use one of {TILINGS}")
    s_max = max(1, int(budgets.max()))
    j = torch.arange(s_max, dtype=torch.float64, device=q.device)
    points = (j + tile_uniforms.to(torch.float64)[..., None]) / budgets.clamp_min(1)[..., None]
    valid = j < budgets[..., None]  # [B, Hq, T, s_max]
    points = torch.where(valid, points, torch.zeros_like(points))
    u_safe = torch.where(tile_valid[:, None, :, None], u, torch.ones_like(u))  # empty tiles draw nothing
    counts_t = counts_from_points(u_safe, points, valid)  # [B, Hq, T, tile]
    counts = counts_t.reshape(b, hq, n_t * tile)[..., :tk]
    key_weights = (counts_t * per_sample[..., None]).reshape(b, hq, n_t * tile)[..., :tk]
    return DecodeSamples(counts, budgets, mass, key_weights)


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
    """One decode step (backend contract of ``api.santa_decode_attention``).

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, Tk, D]; num_samples: [B] int64 ``>= 1``;
    cache_len: [B] int64. ``tiling="none"``: the whole row is one distribution, ``estimator`` and
    ``uniforms`` as in ``santa_prefill_forward`` with ``Tq = 1``. prop/flash: ``estimator`` must be
    ``"sys"`` and ``uniforms`` are the tile offsets [B, Hq, ceil(Tk / tile)]. Returns [B, Hq, D].

    Tilings (App. P, Q; tile statistics and budgets: ``tiling.py``): the ``sys`` rule runs inside every tile
    ``t`` on the in-tile weights ``exp(s_n - m_t)`` with the tile's budget ``S_t`` and its own offset
    ``u_t``, points ``(j + u_t)/S_t``, ``j < S_t``. prop: ``O = (1/S) Σ_t Σ_j V`` (expectation
    ``Σ_t (S_t/S) μ_t``, biased by budget rounding, exactly as App. P defines it). flash:
    ``O = Σ_t m̄_t · (1/S_tile) Σ_j V`` (unbiased).
    """
    if tiling == "none":
        out = santa_prefill_forward(
            q[:, :, None], k_cache, v_cache, num_samples, estimator=estimator, causal=False,
            scale=scale, uniforms=uniforms, key_len=cache_len,
        )
        return out[:, :, 0]
    if estimator != "sys":
        raise ValueError(f"tiling={tiling!r} samples systematically inside tiles; estimator must be 'sys'")
    drawn = decode_samples(
        q, k_cache, num_samples, tiling=tiling, tile=tile, scale=scale, tile_uniforms=uniforms,
        cache_len=cache_len,
    )
    keep = torch.arange(k_cache.shape[2], device=q.device)[None, :] < cache_len[:, None]
    v = torch.where(keep[:, None, :, None], v_cache, torch.zeros_like(v_cache))
    return _weighted_values(drawn.key_weights[:, :, None], v)[:, :, 0].to(q.dtype)


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    cache_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense ``softmax(q kᵀ · scale) v`` in float64 (the target of every estimator).

    q: [B, Hq, Tq, D] (or [B, Hq, D] for one decode query, which implies ``causal=False``);
    k, v: [B, Hkv, Tk, D]; cache_len: [B] valid keys per batch row. Returns float64 of q's shape.
    """
    squeeze = q.dim() == 3
    if squeeze:
        q, causal = q[:, :, None], False
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, _, tq, _ = q.shape
    tk = k.shape[2]
    ok = _allowed_keys(b, tq, tk, causal, cache_len, q.device)
    s = _scores64(q, k, scale, exact=True)
    p = torch.softmax(torch.where(ok, s, torch.full_like(s, float("-inf"))), dim=-1)
    if cache_len is not None:
        keep = torch.arange(tk, device=v.device)[None, :] < cache_len[:, None]
        v = torch.where(keep[:, None, :, None], v, torch.zeros_like(v))
    out = _weighted_values(p, v)
    return out[:, :, 0] if squeeze else out


def expected_prop_output(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_samples: torch.Tensor,
    *,
    tile: int,
    scale: float,
    cache_len: torch.Tensor,
) -> torch.Tensor:
    """Exact expectation of S²ANTA-prop: ``Σ_t (S_t / S) μ_t`` in float64.

    ``μ_t = Σ_{n∈𝒯_t} u_n V_n / ℓ_t`` is tile t's normalized attention mean and ``S_t`` the largest-
    remainder budget (``tiling.prop_tile_budgets``). Equals exact attention when every
    ``S · m̄_t`` is an integer (no rounding). q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, Tk, D];
    num_samples: [B] int64; cache_len: [B] int64. Returns [B, Hq, D] float64.
    """
    b, hq, _ = q.shape
    tk = k_cache.shape[2]
    s = _scores64(q[:, :, None], k_cache, scale)[:, :, 0]
    key_valid = torch.arange(tk, device=q.device)[None, :] < cache_len[:, None]
    u, mass, tile_valid = tile_statistics(s, key_valid, tile)  # u: [B, Hq, T, tile]
    budgets = prop_tile_budgets(mass, num_samples, tile_valid)  # [B, Hq, T]
    ell = u.sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    factor = budgets.to(torch.float64) / num_samples.to(torch.float64)[:, None, None] / ell
    key_weights = (u * factor[..., None]).reshape(b, hq, -1)[..., :tk]  # (S_t/S)·u_n/ℓ_t
    v = torch.where(key_valid[:, None, :, None], v_cache, torch.zeros_like(v_cache))
    return _weighted_values(key_weights[:, :, None], v)[:, :, 0]
