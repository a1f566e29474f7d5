"""Public SANTA / S²ANTA entry points: validation, randomness, backend dispatch.

``SantaDecode`` (end of this module) is the per-layer-schedule runtime that
``runtime_kernels.hf.apply(model, santa_artifact)`` plugs into a transformers model.

Backends. ``reference.py`` (plain PyTorch, float64 sampling) runs everywhere. A GPU module
``runtime_kernels/santa/triton.py`` is picked automatically when ``q.is_cuda`` and it imports; it
provides the same backend functions as the reference:

* ``santa_prefill_forward(q, k, v, num_samples, *, estimator, causal, scale, uniforms)``
* ``santa_decode_forward(q, k_cache, v_cache, num_samples, *, tiling, tile, estimator, scale,
  uniforms, cache_len)``

with ``num_samples`` a [B] int64 tensor already clamped to ``>= 1`` and ``uniforms`` explicit offsets
(see ``reference.py`` for how offsets become keys). A function the module lacks falls back to the
reference. The offsets are drawn here, once, before dispatch, so a given generator state yields the
same samples on either backend (up to float32 rounding at cumulative boundaries in a kernel).

Randomness. Pass ``uniforms`` / ``tile_uniforms`` (values in ``[0, 1)``) for full control, or a
``torch.Generator`` (or neither: torch's global generator). Offsets are drawn as
``torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)`` (``q.device``
without a generator), then moved to ``q.device``, with ``shape``:

* prefill ``sys``: ``[B, Hq, Tq]`` (one uniform per query); ``iid`` / ``strat``: ``[B, Hq, Tq, max S]``;
* decode ``prop`` / ``flash``: ``[B, Hq, ceil(Tk / tile)]`` (one per (b, head, tile));
* decode ``none``: as prefill with ``Tq = 1``.

Sample budget. ``num_samples`` is S for this layer (an int, a 0-d tensor, or a [B] tensor, one per
batch row). A layer that draws 0 samples is evaluated with S = 1 (SPEC §5.4): the API uses
``max(1, S)``; negative S is an error.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Sequence

import torch

from runtime_kernels.santa import reference
from runtime_kernels.santa.draws import SamplingSeeds, keyed_uniforms
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


def _backend_function(name: str, device: torch.device, backend: str):
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


def _int_vector(value: int, batch: int, device: torch.device) -> torch.Tensor:
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
    fn = _backend_function("santa_prefill_forward", q.device, backend)
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
    if tiling not in TILINGS:
        raise ValueError(f"unknown tiling {tiling!r}; use one of {TILINGS}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; use one of {ESTIMATORS}")
    if tiling != "none" and estimator != "sys":
        raise ValueError(f"tiling={tiling!r} samples systematically inside tiles; use estimator='sys'")
    if int(tile) < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    b, hq, d = q.shape
    tk = k_cache.shape[2]
    if cache_len is None:
        cache_len = _int_vector(tk, b, q.device)  # no kernel launch, no host sync (decode hot path)
    else:
        cache_len = torch.as_tensor(cache_len, device=q.device).to(torch.int64).reshape(-1)
        if cache_len.shape != (b,) or bool((cache_len < 1).any()) or bool((cache_len > tk).any()):
            raise ValueError(f"cache_len must be [B]={b} values in [1, {tk}], got {cache_len.tolist()}")
    if type(num_samples) is int and num_samples >= 0:
        s = _int_vector(max(1, num_samples), b, q.device)
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
    fn = _backend_function("santa_decode_forward", q.device, backend)
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


# ------------------------------------------------------------------------------ transformers runtime

PHASES = ("prefill", "decode")


def _schedule_list(schedule: "torch.Tensor | list[int] | tuple[int, ...]") -> list[int]:
    """A per-layer schedule as a list of non-negative Python ints (rejects fractions, NaN, 2-D)."""
    s = torch.as_tensor(schedule).detach().cpu()
    if s.dim() != 1 or s.numel() == 0:
        raise ValueError(f"schedule must be a non-empty [L] vector of sample budgets, got shape {tuple(s.shape)}")
    if s.is_floating_point() and bool((~torch.isfinite(s) | (s != s.round())).any()):
        raise ValueError(f"schedule must hold integers, got {s.tolist()}")
    out = [int(x) for x in s.to(torch.int64).tolist()]
    if min(out) < 0:
        raise ValueError(f"schedule must be >= 0 per layer (0 runs as S = 1), got {out}")
    return out


def _phases(value: Any) -> tuple[str, ...]:
    phases = (value,) if isinstance(value, str) else tuple(str(p) for p in (value or ()))
    bad = [p for p in phases if p not in PHASES]
    if bad or "decode" not in phases:
        raise ValueError(f"phases must be [decode] or [prefill, decode] (got {list(phases)})")
    return tuple(p for p in PHASES if p in phases)


def _schedule_at_budget(artifact: Any, budget: Any, layers: int) -> list[int]:
    """The artifact's learned share ``probs [L]`` apportioned to ``budget`` samples (>= 1 per layer)."""
    from runtime_kernels.errors import ArtifactError
    from runtime_kernels.santa.schedule import apportion

    if isinstance(budget, bool) or not isinstance(budget, int) or budget < layers:
        raise ArtifactError(f"the santa option budget must be an integer >= {layers} (one sample per layer), "
                            f"got {budget!r}")
    if "probs" not in artifact.tensors:
        raise ArtifactError(f"{artifact.path} holds no learned share 'probs' to rescale: recalibrate it to use the "
                            "santa budget option")
    probs = artifact.tensor("probs").detach().to("cpu", torch.float64)
    if probs.shape != (layers,):
        raise ArtifactError(f"{artifact.path}: probs has shape {tuple(probs.shape)}, the model has {layers} layers")
    try:
        return apportion(probs.tolist(), budget, minimum=1)
    except ValueError as exc:
        raise ArtifactError(f"{artifact.path}: cannot apportion budget {budget} ({exc})") from None


class SantaDecode:
    """S²ANTA with a per-layer sample budget, the runtime of ``hf.apply(model, santa_artifact)``.

    Decode: layer ``l`` runs :func:`santa_decode_attention` with ``S = max(1, schedule[l])`` (``tiling``
    prop / flash / none, ``tile`` keys per tile, ``estimator`` inside tiles = sys). With ``"prefill"``
    in ``phases`` (the paper's GSM8K runs) ``phase`` is ``"both"`` and every prefill query row is
    sampled too with :func:`santa_attention` (causal) at the same S. Decode offsets are a function of
    (``seed``, layer, query position, row, head, tile) (:mod:`runtime_kernels.santa.draws`): the same
    in the eager and the CUDA-graph path, fresh at every position; prefill sampling draws from one
    ``torch.Generator`` per device seeded by ``seed``. ``seed=None`` picks a random seed; :meth:`reseed`
    restarts both, and with one seed per batch row makes each row sample what it would alone. A batch
    with a padding mask runs dense (like every decode method here).

    Statistics count in both loops: eager calls add host numbers; static-cache decode steps (CUDA graphs
    replay them without the host) add on the device to one buffer, ``[sum of S, sum of sample fractions,
    calls]`` float64, made once and then only added to in place, so a graph adds to it at every replay
    (:meth:`stats_checkpoint` / :meth:`stats_restore` let the loop drop its uncaptured warm-up steps).
    ``pop_stats()``: ``mean_samples`` (mean S over sampled attention calls), ``sample_fraction``
    (mean samples drawn per query row / keys it may read, capped at 1) and ``sampled_calls``.
    """

    method = "santa"

    def __init__(self, schedule: "torch.Tensor | list[int] | tuple[int, ...]", *, estimator: str = "sys",
                 tiling: str = "flash", tile: int = 256, phases: Any = ("decode",), seed: int | None = None,
                 backend: str = "auto") -> None:
        self.schedule = _schedule_list(schedule)
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; use one of {ESTIMATORS}")
        if tiling not in TILINGS:
            raise ValueError(f"unknown tiling {tiling!r}; use one of {TILINGS}")
        if tiling != "none" and estimator != "sys":
            raise ValueError(f"tiling={tiling!r} samples systematically inside tiles; use estimator='sys'")
        if int(tile) < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        self.estimator, self.tiling, self.tile, self.backend = estimator, tiling, int(tile), backend
        self.phases = _phases(phases)
        self.phase = "both" if "prefill" in self.phases else "decode"
        self.reseed(seed)
        self._stats = [0.0, 0.0, 0]  # sum of S, sum of sample fractions, calls (eager calls)
        self._sums: torch.Tensor | None = None  # the same sums of static-cache decode steps, on the device

    @classmethod
    def from_artifact(cls, artifact: Any, model: Any, *, seed: int | None = 0,
                      budget: int | None = None) -> "SantaDecode":
        """Build from a verified SANTA artifact: tensor ``schedule: [L]`` int64 (the schedule at the
        artifact's default budget), and ``estimator``, ``tiling``, ``tile``, ``phases`` from the payload
        (else the hyper-parameters).

        ``budget`` (``hf.apply(..., options={"santa": {"budget": N}})``): run at total budget ``N``
        instead, the schedule apportioned from the artifact's learned share ``probs: [L]`` by largest
        remainder with at least one sample per layer (:func:`runtime_kernels.santa.schedule.apportion`);
        needs ``N >= L``. At the artifact's own default budget this is the stored schedule."""
        from runtime_kernels.errors import ArtifactError

        schedule = artifact.tensor("schedule")
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", schedule.shape[0])
        if schedule.dim() != 1 or schedule.shape[0] != layers:
            raise ArtifactError(f"{artifact.path}: schedule has shape {tuple(schedule.shape)} but the model has "
                                f"{layers} layers; use an artifact calibrated for this model")
        if budget is not None:
            schedule = _schedule_at_budget(artifact, budget, layers)
        settings = {**(artifact.manifest.hyperparameters or {}), **(artifact.manifest.payload or {})}
        try:
            return cls(schedule, estimator=str(settings.get("estimator", "sys")),
                       tiling=str(settings.get("tiling", "flash")), tile=int(settings.get("tile", 256)),
                       phases=settings.get("phases", ("decode",)), seed=seed)
        except (TypeError, ValueError) as exc:
            raise ArtifactError(f"{artifact.path}: invalid SANTA settings ({exc})") from None

    def reseed(self, seed: int | Sequence[int] | None) -> None:
        """Restart the sampling streams: ``seed`` for every device (None: fresh entropy), or one seed per
        batch row (:class:`runtime_kernels.santa.draws.SamplingSeeds`: each row then samples what it
        would alone under its seed)."""
        self.seed = seed
        self._seeds = SamplingSeeds(seed)
        self._draws: torch.Tensor | None = None
        self._draws_key: tuple | None = None

    def budget(self, layer: int) -> int:
        """S of ``layer`` as run: ``max(1, schedule[layer])``."""
        if not 0 <= layer < len(self.schedule):
            raise ValueError(f"the SANTA schedule has {len(self.schedule)} layers; got layer {layer}")
        return max(1, self.schedule[layer])

    @staticmethod
    def _padded(ctx: Any, batch: int) -> bool:
        return batch > 1 and getattr(ctx, "attention_mask", None) is not None

    def _record(self, s: int, drawn: float, keys: float) -> None:
        self._stats[0] += s
        self._stats[1] += min(1.0, drawn / max(keys, 1.0))
        self._stats[2] += 1

    def _record_static(self, s: int, cache_len: torch.Tensor) -> None:
        """:meth:`_record` of a static-cache decode call, on the device (no host sync, so a CUDA graph
        captures it): the fraction is averaged over the rows, each with its own valid length."""
        keys = cache_len.double()  # [B]
        if self.tiling == "flash":
            tiles = torch.ceil(keys / self.tile)
            drawn = tiles * torch.clamp(torch.floor(s / tiles + 0.5), min=1.0)
        else:
            drawn = torch.full_like(keys, float(s))
        fraction = torch.clamp(drawn / keys.clamp(min=1.0), max=1.0).mean()
        if self._sums is None:  # the first static step: the loop's uncaptured warm-up
            with torch.inference_mode(False):  # a normal tensor: pop_stats zeroes it outside inference mode
                self._sums = torch.zeros(3, dtype=torch.float64, device=cache_len.device)
        self._sums[0].add_(float(s))  # Python numbers: no host-to-device copy
        self._sums[1].add_(fraction)
        self._sums[2].add_(1.0)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                ctx: Any = None) -> torch.Tensor | None:
        """``q: [B, Hq, T, D]``, ``k, v: [B, Hkv, T, D]`` -> ``[B, Hq, T, D]`` sampled (causal); ``None``
        (dense) when prefill is not among the phases."""
        if "prefill" not in self.phases:
            return None
        s = self.budget(layer)
        # one per batch row with per-row seeds (those of ctx.rows when a ragged batch prefills row by row)
        gens = self._seeds.generators(q.device, q.shape[0], rows=getattr(ctx, "rows", None))

        def sampled(rows: slice, gen: torch.Generator) -> torch.Tensor:
            return santa_attention(q[rows], k[rows], v[rows], s, estimator=self.estimator, causal=True, scale=scale,
                                   generator=gen, backend=self.backend)

        out = sampled(slice(None), gens[0]) if len(gens) == 1 else \
            torch.cat([sampled(slice(b, b + 1), gen) for b, gen in enumerate(gens)])
        t = q.shape[2]
        self._record(s, s, (t + 1) / 2)  # a causal row reads on average (T + 1) / 2 keys
        return out

    def observe_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any = None) -> None:
        """Nothing to build: S²ANTA samples from the cache as it is at every step."""

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               ctx: Any = None) -> torch.Tensor | None:
        """``q: [B, Hq, 1, D]``, ``k, v: [B, Hkv, Tk, D]`` (the whole cache) -> ``[B, Hq, 1, D]``.

        With ``ctx.cache_len [B]`` (a static-cache step, :mod:`runtime_kernels.generate`) ``k, v`` are
        views longer than the valid keys and the step adds its statistics on the device
        (:meth:`_record_static`), so it can be captured in a CUDA graph; without it every key is valid and
        the statistics are host numbers (:meth:`_record`: the same rule, no device work). Either way the
        offsets are :meth:`offsets` of the query's position, so both paths draw the same samples, and the
        backend is called directly: the offsets are this runtime's own, so the public function's checks
        (two host syncs per layer on a GPU) would only slow an eager decode loop down."""
        cache_len = getattr(ctx, "cache_len", None)
        b, tk = q.shape[0], k.shape[2]
        if cache_len is None and self._padded(ctx, b):
            return None
        s = self.budget(layer)
        eager = cache_len is None
        pos = _int_vector(tk - 1, b, q.device) if eager else cache_len - 1
        draws = self.offsets(layer, pos, q.shape[1], tk, s, host_position=tk - 1 if eager else None)
        fn = _backend_function("santa_decode_forward", q.device, self.backend)
        out = fn(q[:, :, 0], k, v, _int_vector(s, b, q.device), tiling=self.tiling, tile=self.tile,
                 estimator=self.estimator, scale=float(scale), uniforms=draws,
                 cache_len=_int_vector(tk, b, q.device) if eager else cache_len)
        if eager:
            tiles = -(-tk // self.tile)
            self._record(s, tiles * max(1, int(s / tiles + 0.5)) if self.tiling == "flash" else s, tk)
        else:
            self._record_static(s, cache_len)
        return out[:, :, None]

    def offsets(self, layer: int, position: torch.Tensor, heads: int, keys: int, s: int,
                host_position: int | None = None) -> torch.Tensor:
        """Layer ``layer``'s offsets for queries at ``position [B]``: :func:`draws.keyed_uniforms` of
        (seed, layer, position, row, head, slot); ``[B, heads, ceil(keys / tile)]`` for the prop and
        flash tilings, ``[B, heads, 1]`` (sys) or ``[B, heads, 1, s]`` (iid, strat) for ``"none"``.

        The tiled draws of every layer are made at once, when layer 0 asks (one set of element-wise
        kernels per step instead of one per layer) and kept for the other layers of the step; a
        ``host_position`` (eager calls) also keys that cache, so a call out of order recomputes."""
        if self.tiling == "none":
            n = 1 if self.estimator == "sys" else s
            u = keyed_uniforms(self._seeds.key(position.device, position.shape[0]), layer, position, heads, n)[0]
            return u if self.estimator == "sys" else u.unsqueeze(2)
        slots = -(-keys // self.tile)
        key = (str(position.device), tuple(position.shape), heads, slots, host_position)
        if layer == 0 or self._draws is None or self._draws_key != key:
            layers = torch.arange(len(self.schedule), device=position.device)
            seed = self._seeds.key(position.device, position.shape[0])
            self._draws = keyed_uniforms(seed, layers, position, heads, slots)  # [L, B, H, n]
            self._draws_key = key
        return self._draws[layer]

    def stats_checkpoint(self) -> torch.Tensor | None:
        """A copy of the device sums (``None`` before the first static step) for :meth:`stats_restore`:
        the static loop runs two uncaptured warm-up steps before each capture, which must not count."""
        return None if self._sums is None else self._sums.clone()

    def stats_restore(self, saved: torch.Tensor | None) -> None:
        """Put back the device sums of :meth:`stats_checkpoint` (zeros for ``None``), in place: the buffer
        stays the one the next captured graph adds to."""
        if self._sums is not None:
            self._sums.zero_() if saved is None else self._sums.copy_(saved)

    def pop_stats(self) -> dict[str, float]:
        """Per-call means since the last call (``{}`` when nothing was sampled)."""
        total_s, fractions, calls = self._stats
        if self._sums is not None:
            device_s, device_fractions, device_calls = self._sums.tolist()
            self._sums.zero_()  # in place: a captured graph keeps adding to this buffer
            total_s, fractions, calls = total_s + device_s, fractions + device_fractions, calls + int(device_calls)
        if calls == 0:
            return {}
        self._stats = [0.0, 0.0, 0]
        return {"mean_samples": total_s / calls, "sample_fraction": fractions / calls, "sampled_calls": float(calls)}
