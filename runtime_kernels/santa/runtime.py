"""``SantaDecode``: S²ANTA with a learned per-layer sample budget, the runtime that
``runtime_kernels.hf.apply(model, santa_artifact)`` plugs into a transformers model
(Lee et al., arXiv:2605.01910, §4, App. K).

It holds the per-layer schedule (or apportions the artifact's learned share to a requested budget),
draws each decode step's offsets from (seed, layer, position, row, head, tile) so the eager and the
CUDA-graph loop sample the same keys, and counts its statistics on the host (eager calls) or on the
device (static-cache steps). The attention itself is :mod:`runtime_kernels.santa.api`'s.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from runtime_kernels.errors import ArtifactError
from runtime_kernels.santa.api import backend_function, check_decode_settings, int_vector, santa_attention
from runtime_kernels.santa.draws import SamplingSeeds, keyed_uniforms
from runtime_kernels.santa.schedule import apportion

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
    prop / flash / none, ``tile`` keys per tile, ``estimator`` inside tiles = sys), or dense attention
    where S covers the keys (:meth:`reads_every_key`). With ``"prefill"``
    in ``phases`` (the paper's GSM8K runs) ``phase`` is ``"both"`` and every prefill query row is
    sampled too with :func:`santa_attention` (causal) at the same S. Decode offsets are a function of
    (``seed``, layer, query position, row, head, tile) (:mod:`runtime_kernels.santa.draws`): the same
    in the eager and the CUDA-graph path, fresh at every position; prefill sampling draws from one
    ``torch.Generator`` per device seeded by ``seed``. ``seed=None`` picks a random seed; :meth:`reseed`
    restarts both, and with one seed per batch row makes each row sample what it would alone. A batch
    with a padding mask runs dense (like every decode method here).

    Statistics (``stats``) count in both loops: eager calls add host numbers; static-cache decode steps
    (CUDA graphs replay them without the host) add on the device to one buffer, ``[sum of S, sum of sample
    fractions, calls]`` float64, made once and then only added to in place, so a graph adds to it at every
    replay (:meth:`stats_checkpoint` / :meth:`stats_restore` let the loop drop its uncaptured warm-up steps).
    ``pop_stats()``: ``mean_samples`` (mean S over sampled attention calls), ``sample_fraction``
    (mean samples drawn per query row / keys it may read, capped at 1) and ``sampled_calls``.
    """

    method = "santa"
    # A static step reads the loop's buffers (cache, positions, lengths), this runtime's statistics sums and
    # seeds and constants of its settings: nothing of one request, so the loop replays a step graph
    # captured for an earlier request (keyed by graph_variant).
    reads_request_state = False

    def __init__(self, schedule: "torch.Tensor | list[int] | tuple[int, ...]", *, estimator: str = "sys",
                 tiling: str = "flash", tile: int = 256, phases: Any = ("decode",), seed: int | None = None,
                 backend: str = "auto", stats: bool = True) -> None:
        self.schedule = _schedule_list(schedule)
        self.stats = stats
        check_decode_settings(estimator, tiling, tile)
        self.estimator, self.tiling, self.tile, self.backend = estimator, tiling, int(tile), backend
        self.phases = _phases(phases)
        self.phase = "both" if "prefill" in self.phases else "decode"
        self.reseed(seed)
        self._stats = [0.0, 0.0, 0]  # sum of S, sum of sample fractions, calls (eager calls)
        self._sums: torch.Tensor | None = None  # the same sums of static-cache decode steps, on the device
        self._all_signatures: tuple | None = None  # cost_signatures': (schedule and settings, signatures)

    @classmethod
    def from_artifact(cls, artifact: Any, model: Any, *, seed: int | None = 0,
                      budget: int | None = None, stats: bool = False) -> "SantaDecode":
        """Build from a verified SANTA artifact: tensor ``schedule: [L]`` int64 (the schedule at the
        artifact's default budget), and ``estimator``, ``tiling``, ``tile``, ``phases`` from the payload
        (else the hyper-parameters).

        ``budget`` (``hf.apply(..., options={"santa": {"budget": N}})``): run at total budget ``N``
        instead, the schedule apportioned from the artifact's learned share ``probs: [L]`` by largest
        remainder with at least one sample per layer (:func:`runtime_kernels.santa.schedule.apportion`);
        needs ``N >= L``. At the artifact's own default budget this is the stored schedule. ``stats`` is off
        for serving (``hf.apply``'s default): a static step's statistics are a dozen small kernels per layer;
        ``calib eval`` turns it on."""
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
                       phases=settings.get("phases", ("decode",)), seed=seed, stats=stats)
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
        self._draws_layer = -1  # the layer of the last offsets() call: a layer not after it starts a new step

    @property
    def graph_variant(self) -> tuple:
        """What a step graph bakes in beside the view and the dense layers: the seed (an int seed is a
        constant of the graph; per-row seeds a device tensor, read by address, so the seeds object itself:
        the loop's key then keeps it, and its tensor, alive as long as the graph, and a reseed captures
        anew) and the settings the kernels were launched with."""
        seeds = self._seeds if self._seeds.value is None else self._seeds.value
        return (seeds, tuple(self.schedule), self.tiling, self.tile, self.estimator, self.backend)

    def cost_signature(self, layer: int) -> str:
        """What a decode step of ``layer`` costs depends on (:mod:`runtime_kernels.serving_policy`)."""
        return f"santa|S{self.budget(layer)}|{self.tiling}|tile{self.tile}|{self.estimator}|{self.backend}"

    def cost_signatures(self) -> tuple[str, ...]:
        """:meth:`cost_signature` of every layer, kept while the schedule and settings stay the same: the
        static loop asks at every new view."""
        settings = (tuple(self.schedule), self.tiling, self.tile, self.estimator, self.backend)
        if self._all_signatures is None or self._all_signatures[0] != settings:
            self._all_signatures = (settings, tuple(self.cost_signature(layer) for layer in range(len(self.schedule))))
        return self._all_signatures[1]

    def budget(self, layer: int) -> int:
        """S of ``layer`` as run: ``max(1, schedule[layer])``."""
        if not 0 <= layer < len(self.schedule):
            raise ValueError(f"the SANTA schedule has {len(self.schedule)} layers; got layer {layer}")
        return max(1, self.schedule[layer])

    def reads_every_key(self, layer: int, keys: int) -> bool:
        """True when layer ``layer`` draws at least as many samples as a query may read ``keys``: S²ANTA
        would gather every value row (or more) and still only estimate, so it runs dense attention, which
        reads no more and is exact. ``keys`` is the longest row's (a static view's length bounds them all)."""
        return self.budget(layer) >= keys

    @staticmethod
    def _padded(ctx: Any, batch: int) -> bool:
        return batch > 1 and getattr(ctx, "attention_mask", None) is not None

    def _record(self, s: int, drawn: float, keys: float) -> None:
        self._stats[0] += s
        self._stats[1] += min(1.0, drawn / max(keys, 1.0))
        self._stats[2] += 1

    def _record_static(self, s: int, cache_len: torch.Tensor, every_key: bool = False) -> None:
        """:meth:`_record` of a static-cache decode call, on the device (no host sync, so a CUDA graph
        captures it): the fraction is averaged over the rows, each with its own valid length (1 for a
        step run dense by :meth:`reads_every_key`)."""
        fraction = 1.0 if every_key else self._drawn_fraction(s, cache_len)
        if self._sums is None:  # the first static step: the loop's uncaptured warm-up
            with torch.inference_mode(False):  # a normal tensor: pop_stats zeroes it outside inference mode
                self._sums = torch.zeros(3, dtype=torch.float64, device=cache_len.device)
        self._sums[0].add_(float(s))  # Python numbers: no host-to-device copy
        self._sums[1].add_(fraction)
        self._sums[2].add_(1.0)

    def _drawn_fraction(self, s: int, cache_len: torch.Tensor) -> torch.Tensor:
        """Samples drawn per key a row may read, capped at 1, averaged over the rows (on the device)."""
        keys = cache_len.double()  # [B]
        if self.tiling == "flash":
            tiles = torch.ceil(keys / self.tile)
            drawn = tiles * torch.clamp(torch.floor(s / tiles + 0.5), min=1.0)
        else:
            drawn = torch.full_like(keys, float(s))
        return torch.clamp(drawn / keys.clamp(min=1.0), max=1.0).mean()

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                ctx: Any = None) -> torch.Tensor | None:
        """``q: [B, Hq, T, D]``, ``k, v: [B, Hkv, T, D]`` -> ``[B, Hq, T, D]`` sampled (causal); ``None``
        (dense) when prefill is not among the phases."""
        if "prefill" not in self.phases:
            return None
        s = self.budget(layer)
        if self.reads_every_key(layer, k.shape[2]):
            if self.stats:
                self._record(s, s, k.shape[2])
            return None
        # one per batch row with per-row seeds (those of ctx.rows when a ragged batch prefills a run of rows)
        gens = self._seeds.generators(q.device, q.shape[0], rows=getattr(ctx, "rows", None))

        def sampled(rows: slice, gen: torch.Generator) -> torch.Tensor:
            return santa_attention(q[rows], k[rows], v[rows], s, estimator=self.estimator, causal=True, scale=scale,
                                   generator=gen, backend=self.backend)

        out = sampled(slice(None), gens[0]) if len(gens) == 1 else \
            torch.cat([sampled(slice(b, b + 1), gen) for b, gen in enumerate(gens)])
        if self.stats:
            self._record(s, s, (q.shape[2] + 1) / 2)  # a causal row reads on average (T + 1) / 2 keys
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
        if self.reads_every_key(layer, tk):
            if self.stats:
                self._record(s, s, tk) if eager else self._record_static(s, cache_len, every_key=True)
            return None
        pos = int_vector(tk - 1, b, q.device) if eager else cache_len - 1
        draws = self.offsets(layer, pos, q.shape[1], tk, s, host_position=tk - 1 if eager else None)
        fn = backend_function("santa_decode_forward", q.device, self.backend)
        out = fn(q[:, :, 0], k, v, int_vector(s, b, q.device), tiling=self.tiling, tile=self.tile,
                 estimator=self.estimator, scale=float(scale), uniforms=draws,
                 cache_len=int_vector(tk, b, q.device) if eager else cache_len)
        if not self.stats:
            return out[:, :, None]
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

        The tiled draws of every layer are made at once, by the step's first call (one set of element-wise
        kernels per step instead of one per layer) and kept for its later layers. A step's first call is
        the one whose layer is not after the previous call's: with layers served densely (the serving
        policy, :meth:`reads_every_key`) a step may start at any layer, and a CUDA graph captured then must
        compute its own step's draws, not read an earlier step's. A ``host_position`` (eager calls) also
        keys the cache."""
        if self.tiling == "none":
            n = 1 if self.estimator == "sys" else s
            u = keyed_uniforms(self._seeds.key(position.device, position.shape[0]), layer, position, heads, n)[0]
            return u if self.estimator == "sys" else u.unsqueeze(2)
        slots = -(-keys // self.tile)
        key = (str(position.device), tuple(position.shape), heads, slots, host_position)
        if layer <= self._draws_layer or self._draws is None or self._draws_key != key:
            layers = torch.arange(len(self.schedule), device=position.device)
            seed = self._seeds.key(position.device, position.shape[0])
            self._draws = keyed_uniforms(seed, layers, position, heads, slots)  # [L, B, H, n]
            self._draws_key = key
        self._draws_layer = layer
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
