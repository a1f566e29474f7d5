"""S²ANTA decode kernels in Triton: the prop and flash tilings (Lee et al., arXiv:2605.01910, §3.2-§3.3, App. P, Q).

The backend of ``reference.santa_decode_forward`` (``api.santa_decode_attention`` picks it on CUDA), same
contract; :func:`supported` sends ``tiling="none"``, float64 or mixed dtypes, head_dim > 256 and > 16384 tiles
to the reference. bf16 / fp16 on the GPU, float32 anywhere (the CPU interpreter runs float32 only); any batch,
GQA group size, head_dim and tile length (padded to powers of two inside), odd cache lengths, any strides.

Stages (the G = Hq/Hkv query heads of a KV head share each K chunk and each sampled V row):

* prop, 3 launches: the score pass (``triton_score``, Alg. 3: scores stored, tile and K-chunk statistics),
  the budgets (Alg. 4) and the gather (Alg. 5) of ``triton_prop``.
* flash, 2 launches (``triton_flash``): one pass over K per tile producing the tile's partial (Alg. 7),
  then the log-sum-exp merge of the partials (Alg. 8).

Run-time choices, by rule from shapes and the device only: prop's launches chained by programmatic dependent
launch on sm_90+ (:func:`_pdl`), flash's chunk-first sample lookup (:func:`_flash_chunked`), prop's tiles per
gather program (``triton_prop.gather_tiles``). The sampling rule and what a CUDA graph may rely on:
:func:`santa_decode_forward`. Design notes and the alternatives: docs/notes/kernels.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime_kernels._triton_support import arrival_counters, interpreting, patch_interpreter, pdl_available
from runtime_kernels.santa import reference
from runtime_kernels.santa.reference import DecodeSamples
from runtime_kernels.santa.tiling import flash_tile_budget, num_tiles
from runtime_kernels.santa.triton_flash import launch_flash_merge, launch_flash_stream
from runtime_kernels.santa.triton_layout import Geometry, ScoreBuffers
from runtime_kernels.santa.triton_prop import launch_budgets, launch_prop_gather
from runtime_kernels.santa.triton_score import launch_scores

_INTERPRET = interpreting()
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
MAX_TILES = 16384  # one program ranks all tiles of a head in registers when computing prop budgets
FLASH_CHUNK_TILES = 128  # flash: chunk-first sample lookup from this many tiles in the cache allocation
patch_interpreter()


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized buffer (tests replace this to poison every buffer the wrapper allocates with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _pdl(device: torch.device) -> bool:
    """Whether prop's launches are chained by programmatic dependent launch (sm_90+, compiled kernels)."""
    return pdl_available(device)


def _flash_chunked(geo: Geometry) -> bool:
    """Whether flash locates samples chunk first: caches of ``FLASH_CHUNK_TILES`` tiles or more, where
    ``S / T`` samples per tile are few; denser tiles are prefix-summed whole (docs/notes/kernels.md)."""
    return geo.T_all >= FLASH_CHUNK_TILES


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


def _score_buffers(geo: Geometry, device: torch.device) -> ScoreBuffers:
    """The score pass's outputs and prop's budgets / accumulator (two allocations, no memset)."""
    rows, t_all = geo.B * geo.Hq, geo.T_all
    n_chunks = rows * t_all * geo.NCH
    sizes = (rows * geo.Tk_pad, rows * t_all, rows * t_all, rows * geo.BLOCK_D, n_chunks, n_chunks)
    scores, m, ell, acc, chunk_m, chunk_l = torch.split(_alloc((sum(sizes),), torch.float32, device), sizes)
    return ScoreBuffers(scores, m, ell, _alloc((rows, t_all), torch.int32, device), acc, chunk_m, chunk_l)


def _prop_scores(q: torch.Tensor, k: torch.Tensor, num_samples: torch.Tensor, cache_len: torch.Tensor,
                 scale: float, geo: Geometry, pdl: bool) -> ScoreBuffers:
    """Score pass + budgets (2 launches)."""
    bufs = _score_buffers(geo, q.device)
    launch_scores(q, k, cache_len, scale, geo, bufs, release=pdl)
    launch_budgets(num_samples, cache_len, geo, bufs, pdl)
    return bufs


def _prop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_samples: torch.Tensor, uniforms: torch.Tensor,
          cache_len: torch.Tensor, scale: float, geo: Geometry,
          counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """S²ANTA-prop: (output [B, Hq, D], budgets [B·Hq, T_all] int32); ``counts`` receives per-key counts."""
    pdl = _pdl(q.device)
    bufs = _prop_scores(q, k, num_samples, cache_len, scale, geo, pdl)
    out = _alloc((geo.B, geo.Hq, geo.D), q.dtype, q.device)
    launch_prop_gather(v, num_samples, uniforms, cache_len, geo, bufs, out, counts,
                       arrival_counters("santa", v.device, geo.BH), pdl)
    return out, bufs.budgets


def _flash_buffers(geo: Geometry, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """flash scratch: scores [B·Hq·Tk_pad] and the tile partials [B·Hkv·T_all·GP·(2 + BLOCK_D)], float32."""
    return (_alloc((geo.B * geo.Hq * geo.Tk_pad,), torch.float32, device),
            _alloc((geo.BH * geo.T_all * geo.GP * (2 + geo.BLOCK_D),), torch.float32, device))


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_samples: torch.Tensor, uniforms: torch.Tensor,
           cache_len: torch.Tensor, scale: float, geo: Geometry,
           counts: torch.Tensor | None = None) -> torch.Tensor:
    """S²ANTA-flash output [B, Hq, D]; ``counts`` receives per-key counts."""
    out = _alloc((geo.B, geo.Hq, geo.D), q.dtype, q.device)
    scores, work = _flash_buffers(geo, q.device)
    launch_flash_stream(q, k, v, num_samples, uniforms, cache_len, scale, geo, scores, work, counts,
                        _flash_chunked(geo))
    launch_flash_merge(cache_len, geo, work, out)
    return out


def santa_stages(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_samples: torch.Tensor, *,
                 tiling: str, tile: int, scale: float, uniforms: torch.Tensor,
                 cache_len: torch.Tensor) -> dict[str, Callable[[], None]]:
    """Launchers of each stage alone, on buffers filled by one full run (for timing; results unused).

    prop: ``scores`` (K pass), ``budgets``, ``gather`` (V rows + output), ``full``. flash: ``stream``
    (the per-tile partials), ``merge``, ``full``. Same arguments as ``santa_decode_forward`` (shapes in
    its docstring).
    """
    geo = Geometry.of(q, k_cache, tile)
    out = _alloc((geo.B, geo.Hq, geo.D), q.dtype, q.device)
    args = (num_samples, uniforms, cache_len)
    stages: dict[str, Callable[[], None]] = {}
    if tiling == "prop":
        bufs = _score_buffers(geo, q.device)
        counters = arrival_counters("santa", q.device, geo.BH)
        pdl = _pdl(q.device)
        stages["scores"] = lambda: launch_scores(q, k_cache, cache_len, scale, geo, bufs, release=pdl)
        stages["budgets"] = lambda: launch_budgets(num_samples, cache_len, geo, bufs, pdl)
        stages["gather"] = lambda: launch_prop_gather(v_cache, *args, geo, bufs, out, None, counters, pdl)
        stages["scores"]()
        stages["budgets"]()
    else:
        scores, work = _flash_buffers(geo, q.device)
        chunked = _flash_chunked(geo)
        stages["stream"] = lambda: launch_flash_stream(q, k_cache, v_cache, *args, scale, geo, scores, work, None,
                                                       chunked)
        stages["merge"] = lambda: launch_flash_merge(cache_len, geo, work, out)
        stages["stream"]()  # partials for the merge stage
    stages["full"] = lambda: santa_decode_forward(q, k_cache, v_cache, num_samples, tiling=tiling, tile=tile,
                                                  estimator="sys", scale=scale, uniforms=uniforms, cache_len=cache_len)
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

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, Tk, D] (Tk: the allocation; keys past ``cache_len`` are
    never read); num_samples: [B] int64 ``>= 1``; uniforms: [B, Hq, ceil(Tk / tile)] float64 tile
    offsets (entries of tiles past ``cache_len`` are ignored); cache_len: [B] int64 in ``[1, Tk]``.
    Returns [B, Hq, D] in q.dtype. Calls the kernels can't run go to the reference.

    Sampling rule (the reference's): tile t of head h with budget ``S_t`` and offset ``u = uniforms[b, h, t]``
    gives key n ``c(C_n) - c(C_{n-1})`` samples, ``c(C) = clamp(ceil(S_t·C/Z - u), 0, S_t)``, ``C`` the
    inclusive cumulative in-tile weight, ``Z`` the tile total (App. P Alg. 5 line 8 with ``p`` the running
    cumulative); sample ``j`` sits at key ``#{n : C_n <= (j + u)·Z/S_t}``. Counts are never negative and sum
    to ``S_t`` exactly; they match the float64 reference except where ``S_t·C_n/Z - u`` lies within float32
    score rounding of an integer.

    CUDA graphs: a call never waits on the device (no ``.item()``, no data-dependent host branch); its grids,
    buffers and run-time choices depend on tensor shapes and the device only, ``cache_len`` and
    ``num_samples`` being read by the kernels (so under a graph flash's lookup follows the allocation's tile
    count, not the valid length's). ``k_cache`` / ``v_cache`` may be views of a longer preallocated cache:
    keys past ``cache_len`` may hold NaN. Scratch comes from ``torch.empty`` (graph-pool memory under
    capture); the arrival counters of prop's gather are one persistent zeroed buffer per device
    (``_triton_support.arrival_counters``), reset by the last program of each launch: run one eager call
    before capture (it also compiles the kernels), and no two calls concurrently on different streams of a
    device. Calls that go to the reference read budgets back to the host: not capturable.
    """
    if not supported(q, k_cache, v_cache, tiling=tiling, tile=tile, estimator=estimator):
        return reference.santa_decode_forward(
            q, k_cache, v_cache, num_samples, tiling=tiling, tile=tile, estimator=estimator, scale=scale,
            uniforms=uniforms, cache_len=cache_len,
        )
    geo = Geometry.of(q, k_cache, tile)
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
    geo = Geometry.of(q, k_cache, tile)
    b, hq, t_all, tk = geo.B, geo.Hq, geo.T_all, k_cache.shape[2]
    counts = torch.zeros(b * hq, geo.Tk_pad, dtype=torch.int32, device=q.device)
    stats = _prop_scores(q, k_cache, num_samples, cache_len, scale, geo, _pdl(q.device))
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
