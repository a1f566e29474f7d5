"""Public SANTA / S²ANTA entry points: validation, randomness, backend dispatch.

``SantaDecode``, the per-layer-schedule runtime ``runtime_kernels.hf.apply(model, santa_artifact)`` plugs
into a transformers model, lives in :mod:`runtime_kernels.santa.runtime` and calls these.

Backends: ``reference.py`` (plain PyTorch, float64 sampling) runs everywhere; ``triton.py`` is picked when
``q.is_cuda`` and it imports (:func:`backend_function`). Both provide ``santa_prefill_forward(q, k, v,
num_samples, *, estimator, causal, scale, uniforms)`` and ``santa_decode_forward(q, k_cache, v_cache,
num_samples, *, tiling, tile, estimator, scale, uniforms, cache_len)``, with ``num_samples`` a [B] int64
tensor already clamped to ``>= 1`` and ``uniforms`` explicit offsets (how offsets become keys:
``reference.py``); a function the GPU module lacks falls back to the reference. The offsets are drawn here,
once, before dispatch (:func:`_offsets`), so a generator state yields the same samples on either backend
(up to float32 rounding at cumulative boundaries in a kernel).

Sample budget: ``num_samples`` is S for this layer (an int, a 0-d tensor, or a [B] tensor, one per batch
row); a layer that draws 0 samples runs with S = 1 (docs/methods.md, SANTA / S²ANTA), a negative S is an
error (:func:`normalize_num_samples`).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from runtime_kernels.santa import reference
from runtime_kernels.santa.reference import ESTIMATORS, TILINGS

BACKENDS = ("auto", "reference", "triton")


@functools.lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    """``runtime_kernels.santa.triton`` if it exists and its dependencies import, else None."""
    try:
        return importlib.import_module("runtime_kernels.santa.triton")
    except ModuleNotFoundError as err:  # the module itself or triton missing; a bug inside re-raises
        if err.name in ("runtime_kernels.santa.triton", "triton") or (err.name or "").startswith("triton."):
            return None
        raise


def backend_function(name: str, device: torch.device, backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if backend != "reference" and device.type == "cuda":
        module = _triton_module()
        fn = getattr(module, name, None) if module is not None else None
        if fn is not None:
            return fn
    if backend == "triton":
        raise RuntimeError(f"backend='triton' needs CUDA tensors and runtime_kernels.santa.triton.{name}")
    return getattr(reference, name)


def normalize_num_samples(num_samples: int | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """S per batch row as [B] int64 on ``device``, with ``max(1, S)`` applied (S = 0 is run as 1).

    num_samples: int, 0-d tensor, or [B] tensor of non-negative integers.
    """
    s = torch.as_tensor(num_samples, device=device)
    if s.is_floating_point() and bool((s != s.round()).any()):
        raise ValueError(f"num_samples must be integers, got {num_samples!r}")
    s = s.to(torch.int64)
    if s.dim() == 0:
        s = s.expand(batch)
    if s.shape != (batch,):
        raise ValueError(f"num_samples must be an int or a [B]={batch} tensor, got shape {tuple(s.shape)}")
    if bool((s < 0).any()):
        raise ValueError(f"num_samples must be >= 0 (0 is evaluated as 1), got {s.tolist()}")
    return s.clamp_min(1).contiguous()


_INT_VECTORS: dict[str, torch.Tensor] = {}
# every arange ever handed out stays alive: a CUDA graph captured with a view into one keeps its address,
# so a later, longer eager call must not free it for reuse (a few MB in all: each one doubles)
_RETIRED_INT_VECTORS: list[torch.Tensor] = []


def int_vector(value: int, batch: int, device: torch.device) -> torch.Tensor:
    """A read-only [B] int64 tensor of ``value``: a stride-0 view into a cached ``arange`` on ``device``.

    Decode calls pass S and the cache length this way, so a step launches no fill kernel and never
    waits on the device (``torch.full`` + a validity check would do both). Backends only read it.
    """
    key = str(device)
    values = _INT_VECTORS.get(key)
    if values is None or values.numel() <= value:
        if values is not None:
            _RETIRED_INT_VECTORS.append(values)
        values = torch.arange(max(2 * value + 1, 1 << 16), dtype=torch.int64, device=device)
        _INT_VECTORS[key] = values
    return values[value:value + 1].expand(batch)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, T, D] tensors")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]}")
    if k.shape[2] == 0:
        raise ValueError("no keys: k has length 0")


def _offsets(
    given: torch.Tensor | None, shape: tuple[int, ...], generator: torch.Generator | None,
    device: torch.device, name: str,
) -> torch.Tensor:
    """The offsets in ``[0, 1)`` of one call, float64 on ``device``: ``given`` (checked), or drawn.

    Pass ``uniforms`` / ``tile_uniforms`` for full control, or a ``torch.Generator`` (or neither: torch's
    global generator): ``torch.rand(shape, generator=generator, dtype=torch.float64,
    device=generator.device)`` (``q.device`` without a generator), then moved to ``device``. ``shape``:
    prefill ``sys`` ``[B, Hq, Tq]`` (one uniform per query), ``iid`` / ``strat`` ``[B, Hq, Tq, max S]``;
    decode ``prop`` / ``flash`` ``[B, Hq, ceil(Tk / tile)]`` (one per (b, head, tile)); decode ``none``: as
    prefill with ``Tq = 1``.
    """
    if given is None:
        where = generator.device if generator is not None else device
        return torch.rand(shape, generator=generator, dtype=torch.float64, device=where).to(device)
    if tuple(given.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(given.shape)}")
    if given.numel() and (bool((given < 0).any()) or bool((given >= 1).any())):
        raise ValueError(f"{name} must lie in [0, 1)")
    return given.to(device=device, dtype=torch.float64)


def _prefill_offsets(estimator, b, hq, tq, s, generator, uniforms, device) -> torch.Tensor:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; use one of {ESTIMATORS}")
    shape = (b, hq, tq) if estimator == "sys" else (b, hq, tq, int(s.max()))
    return _offsets(uniforms, shape, generator, device, "uniforms")


def _prepare_prefill(q, k, v, num_samples, estimator, causal, scale, generator, uniforms):
    _check_qkv(q, k, v)
    b, hq, tq, d = q.shape
    if causal and tq > k.shape[2]:
        raise ValueError(f"causal attention needs Tq <= Tk, got Tq={tq}, Tk={k.shape[2]}")
    s = normalize_num_samples(num_samples, b, q.device)
    offsets = _prefill_offsets(estimator, b, hq, tq, s, generator, uniforms, q.device)
    return s, offsets, (d ** -0.5 if scale is None else float(scale))


def santa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_samples: int | torch.Tensor,
    *,
    estimator: str = "sys",
    causal: bool = True,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sampled attention for every query row (prefill or general).

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] (query head h reads KV head ``h // (Hq // Hkv)``);
    queries are the last Tq positions (query i sits at ``Tk - Tq + i``; causal: keys ``<=`` it).
    num_samples: S (int, 0-d or [B]; ``max(1, S)``). estimator: ``"iid"`` (SANTA, S draws with
    replacement), ``"strat"`` (one uniform per stratum), ``"sys"`` (one uniform per query).
    uniforms: [B, Hq, Tq] (sys) or [B, Hq, Tq, max S] (iid, strat). scale: default ``D ** -0.5``.
    Returns [B, Hq, Tq, D] in q.dtype: ``(1/S) Σ_j V[key_j]``, an unbiased estimate of softmax·V.
    """
    s, offsets, scale = _prepare_prefill(q, k, v, num_samples, estimator, causal, scale, generator, uniforms)
    fn = backend_function("santa_prefill_forward", q.device, backend)
    return fn(q, k, v, s, estimator=estimator, causal=causal, scale=scale, uniforms=offsets)


def per_row_sample_counts(
    q: torch.Tensor,
    k: torch.Tensor,
    num_samples: int | torch.Tensor,
    *,
    estimator: str = "sys",
    causal: bool = True,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Samples each query row puts on each key, as ``santa_attention`` draws them (reference rule).

    Same arguments as ``santa_attention`` (no v). Returns [B, Hq, Tq, Tk] int64, row sums ``max(1, S)``.
    """
    s, offsets, scale = _prepare_prefill(q, k, k, num_samples, estimator, causal, scale, generator, uniforms)
    return reference.per_row_sample_counts(
        q, k, s, estimator=estimator, causal=causal, scale=scale, uniforms=offsets
    )


def check_decode_settings(estimator: str, tiling: str, tile: int) -> None:
    """Raise ``ValueError`` unless (estimator, tiling, tile) is a decode configuration the backends run:
    a known tiling and estimator, ``sys`` inside tiles, ``tile >= 1``."""
    if tiling not in TILINGS:
        raise ValueError(f"unknown tiling {tiling!r}; use one of {TILINGS}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; use one of {ESTIMATORS}")
    if tiling != "none" and estimator != "sys":
        raise ValueError(f"tiling={tiling!r} samples systematically inside tiles; use estimator='sys'")
    if int(tile) < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")


def _prepare_decode(
    q, k_cache, v_cache, num_samples, tiling, tile, estimator, scale, generator, tile_uniforms,
    uniforms, cache_len,
):
    if q.dim() == 4:
        if q.shape[2] != 1:
            raise ValueError(f"decode takes one query per row: q [B, Hq, 1, D], got {tuple(q.shape)}")
        q = q[:, :, 0]
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D] or [B, Hq, 1, D], got {tuple(q.shape)}")
    _check_qkv(q[:, :, None], k_cache, v_cache)
    check_decode_settings(estimator, tiling, tile)
    b, hq, d = q.shape
    tk = k_cache.shape[2]
    if cache_len is None:
        cache_len = int_vector(tk, b, q.device)  # no kernel launch, no host sync (decode hot path)
    else:
        cache_len = torch.as_tensor(cache_len, device=q.device).to(torch.int64).reshape(-1)
        if cache_len.shape != (b,) or bool((cache_len < 1).any()) or bool((cache_len > tk).any()):
            raise ValueError(f"cache_len must be [B]={b} values in [1, {tk}], got {cache_len.tolist()}")
    if type(num_samples) is int and num_samples >= 0:
        s = int_vector(max(1, num_samples), b, q.device)
    else:
        s = normalize_num_samples(num_samples, b, q.device)
    if tiling == "none":
        if tile_uniforms is not None:
            raise ValueError(
                "tiling='none' takes `uniforms` ([B, Hq, 1] or [B, Hq, 1, S]), not tile_uniforms"
            )
        offsets = _prefill_offsets(estimator, b, hq, 1, s, generator, uniforms, q.device)
    else:
        if uniforms is not None:
            raise ValueError(f"tiling={tiling!r} takes tile_uniforms [B, Hq, n_tiles], not uniforms")
        shape = (b, hq, -(-tk // int(tile)))
        offsets = _offsets(tile_uniforms, shape, generator, q.device, "tile_uniforms")
    return q, s, offsets, cache_len, (d ** -0.5 if scale is None else float(scale))


def santa_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_samples: int | torch.Tensor,
    *,
    tiling: str = "flash",
    tile: int = 256,
    estimator: str = "sys",
    scale: float | None = None,
    generator: torch.Generator | None = None,
    tile_uniforms: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    cache_len: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of S²ANTA with this layer's sample budget.

    q: [B, Hq, D] or [B, Hq, 1, D]; k_cache, v_cache: [B, Hkv, Tk, D] (the current token's key
    already appended); cache_len: [B] valid keys per row (default Tk; keys past it are never read,
    padding may hold anything). num_samples: S of this layer (int, 0-d or [B]; ``max(1, S)``).

    tiling (tiles of ``tile`` keys, the last one partial, T_b = ceil(cache_len_b / tile)):

    * ``"prop"`` (App. P): budgets S_t = largest remainder of S·m̄_t (Σ S_t = S), systematic samples
      inside each tile with its own offset, output ``(1/S) Σ V``; expectation ``Σ_t (S_t/S) μ_t``
      (``expected_prop_output``), biased by budget rounding as the paper defines it.
    * ``"flash"`` (App. Q): ``S_tile = max(1, round_half_up(S / T_b))`` in every tile, per-tile mean
      ``μ̂_t``, merge ``Σ_t m̄_t μ̂_t`` (unbiased).
    * ``"none"``: the whole row is one distribution; ``estimator`` may be iid / strat / sys.

    tile_uniforms: [B, Hq, ceil(Tk / tile)] offsets for prop / flash; uniforms: [B, Hq, 1] (sys) or
    [B, Hq, 1, max S] for ``"none"``. Returns [B, Hq, D] in q.dtype.
    """
    q, s, offsets, cache_len, scale = _prepare_decode(
        q, k_cache, v_cache, num_samples, tiling, tile, estimator, scale, generator, tile_uniforms,
        uniforms, cache_len,
    )
    fn = backend_function("santa_decode_forward", q.device, backend)
    return fn(
        q, k_cache, v_cache, s, tiling=tiling, tile=int(tile), estimator=estimator, scale=scale,
        uniforms=offsets, cache_len=cache_len,
    )


def decode_sample_counts(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    num_samples: int | torch.Tensor,
    *,
    tiling: str = "flash",
    tile: int = 256,
    estimator: str = "sys",
    scale: float | None = None,
    generator: torch.Generator | None = None,
    tile_uniforms: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    cache_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Samples per key of one decode step, as ``santa_decode_attention`` draws them (reference rule).

    Same arguments as ``santa_decode_attention`` (no v_cache). Returns [B, Hq, Tk] int64; sums are
    S (prop, none) or ``T_b · S_tile`` (flash). ``reference.decode_samples`` also gives budgets/masses.
    """
    q, s, offsets, cache_len, scale = _prepare_decode(
        q, k_cache, k_cache, num_samples, tiling, tile, estimator, scale, generator, tile_uniforms,
        uniforms, cache_len,
    )
    if tiling == "none":
        counts = reference.per_row_sample_counts(
            q[:, :, None], k_cache, s, estimator=estimator, causal=False, scale=scale,
            uniforms=offsets, key_len=cache_len,
        )
        return counts[:, :, 0]
    return reference.decode_samples(
        q, k_cache, s, tiling=tiling, tile=int(tile), scale=scale, tile_uniforms=offsets,
        cache_len=cache_len,
    ).counts


def expected_prop_output(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_samples: int | torch.Tensor,
    *,
    tile: int = 256,
    scale: float | None = None,
    cache_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact expectation ``Σ_t (S_t/S) μ_t`` of ``santa_decode_attention(..., tiling="prop")``.

    Same shapes as ``santa_decode_attention``; returns [B, Hq, D] float64.
    """
    q, s, _, cache_len, scale = _prepare_decode(
        q, k_cache, v_cache, num_samples, "prop", tile, "sys", scale, None,
        torch.zeros(q.shape[0], q.shape[1], -(-k_cache.shape[2] // int(tile)), device=q.device),
        None, cache_len,
    )
    return reference.expected_prop_output(
        q, k_cache, v_cache, s, tile=int(tile), scale=scale, cache_len=cache_len
    )


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    cache_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense softmax·V in float64. q: [B, Hq, Tq, D] or [B, Hq, D] (decode); k, v: [B, Hkv, Tk, D]."""
    _check_qkv(q if q.dim() == 4 else q[:, :, None], k, v)
    return reference.exact_attention(q, k, v, causal=causal, scale=scale, cache_len=cache_len)
