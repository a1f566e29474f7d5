"""Public SAAP decode entry point: the Triton kernel on CUDA when it exists, else the PyTorch reference."""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from runtime_kernels.errors import ArtifactError
from runtime_kernels.rope import derope, derope_coefficients
from runtime_kernels.saap.bucket_index import BucketIndex
from runtime_kernels.saap.reference import (
    SaapLayerParams,
    classifier_input,
    classify_queries,
    rank_buckets,
    saap_decode_attention_reference,
)


def _triton_module() -> ModuleType | None:
    """``runtime_kernels.saap.triton`` if it and triton import, else None (never raises)."""
    try:
        return importlib.import_module("runtime_kernels.saap.triton")
    except ImportError:
        return None


def saap_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          state: BucketIndex | None, artifact_layer: SaapLayerParams, *, top_l: int,
                          q_derope: torch.Tensor | None = None, query_rotation: torch.Tensor | None = None,
                          scale: float | None = None, impl: str = "auto",
                          cache_len: torch.Tensor | None = None) -> torch.Tensor:
    """SAAP attention of one decode step of one layer.

    Args:
        q: ``[B, Hq, D]`` RoPE'd query of the current token (used for the attention itself).
        k_cache, v_cache: ``[B, Hkv, T, D]`` RoPE'd keys and values, the current token's last.
        state: the layer's :class:`BucketIndex` covering the ``T`` keys (``None`` for a dense layer).
        artifact_layer: the layer's :class:`SaapLayerParams`.
        top_l: buckets visited per KV head (ℓ).
        q_derope: ``[B, Hq, D]`` query without RoPE (the classifier's input, in its weights' dtype).
        query_rotation: instead of ``q_derope``, ``[B, 2, D]`` float32 de-RoPE coefficients of the query's
            position (:func:`runtime_kernels.rope.derope_coefficients`): the classifier de-RoPEs ``q``
            itself (the Triton kernel as it loads it), rounding to its weights' dtype. A non-dense layer
            needs exactly one of the two.
        scale: softmax scale, ``1/sqrt(D)`` by default.
        impl: ``"auto"`` (Triton when ``q.is_cuda`` and the kernel imports), ``"reference"``, ``"triton"``.
        cache_len: ``[B]`` int64 valid keys when ``k_cache, v_cache`` are views of a preallocated cache
            longer than that (a static-cache step; rows may differ). The kernel reads it on
            the device; the reference path slices the cache to it (one host sync).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``.
    """
    if impl not in ("auto", "reference", "triton"):
        raise ValueError(f"impl must be auto, reference or triton, got {impl!r}")
    if not artifact_layer.dense and (q_derope is None) == (query_rotation is None):
        raise ValueError("a non-dense SAAP layer needs exactly one of q_derope and query_rotation")
    kernel = _triton_module() if impl != "reference" and (q.is_cuda or impl == "triton") else None
    if impl == "triton" and kernel is None:
        raise RuntimeError("the SAAP Triton kernel is not available (runtime_kernels.saap.triton did not import)")
    if kernel is not None:
        return kernel.saap_decode_attention_triton(q, q_derope, k_cache, v_cache, state, artifact_layer,
                                                   top_l=top_l, scale=scale, cache_len=cache_len,
                                                   query_rotation=query_rotation)
    if query_rotation is not None and not artifact_layer.dense:
        q_derope = classifier_input(q, query_rotation, artifact_layer)
    if cache_len is not None:
        t = int(cache_len.max())
        k_cache, v_cache = k_cache[:, :, :t], v_cache[:, :, :t]
    return saap_decode_attention_reference(q, q_derope, k_cache, v_cache, state, artifact_layer, top_l, scale,
                                           cache_len=cache_len)


# --------------------------------------------------------------------------------------------------
# transformers integration (runtime_kernels.hf): SAAP as a decode runtime
# --------------------------------------------------------------------------------------------------


@dataclass
class AttentionPositions:
    """The part of an attention call's context that de-RoPE needs when no call is at hand: the model's
    rotary module (positions then default to consecutive ones)."""

    rotary_emb: Any
    position_ids: torch.Tensor | None = None


INDEX_CHUNK = 8192  # cache positions de-RoPE'd and assigned at a time when an index is built from the cache
INDEX_CHUNK_LAYERS = 4  # an index build of several layers stacks this many chunks' keys: fewer, larger launches


class SaapDecode:
    """SAAP as the decode runtime of :func:`runtime_kernels.hf.apply` (``phase = "decode"``).

    At prefill (``observe_prefill``) each non-dense layer de-RoPEs the prompt's keys with the model's
    rotary module and builds its :class:`BucketIndex`; at each decode step the new key is appended and
    :func:`saap_decode_attention` runs. Dense layers (layer 0), layers at ℓ >= C (they read every key:
    dense attention is the same keys, exact and cheaper, so evaluation and serving both run it), a batch
    with a padding mask, or a layer whose index does not match the cache (no prefill seen) return ``None``:
    the model's own attention.

    Under the static loop (:meth:`before_graph`) the indexes live in storage allocated once per (cache,
    layer) and end where the view puts them, so the loop keeps SAAP's step graphs across
    requests like dense ones (:attr:`reads_request_state`, :attr:`graph_variant`).

    Artifact layout (written by ``calib``'s SAAP recipe): hyper-parameters ``sink``, ``window``
    (= sink + recent), ``top_l``, ``dense_layers`` (list), ``bn_eps``; tensors
    ``layers.<l>.<field>`` for every non-dense layer ``l`` and every
    :attr:`SaapLayerParams.TENSOR_FIELDS` field.

    ``stats=True`` (the default; what ``calib eval`` reports) also ranks the buckets once more per step
    in PyTorch to count what the step visited, so :meth:`pop_stats` returns the mean ``selectivity``
    (visited bucket keys / all bucket keys, the paper's Table 5: keys outside the dense region) and
    ``selectivity_with_window`` (visited keys incl. sink and window / all valid keys) over every (step,
    SAAP layer, batch row, KV head) since the last call. The extra ranking doubles the classifier's
    cost, so serving sets ``stats=False``.

    The counts are summed on the device into one buffer, ``[selectivity, selectivity_with_window,
    count]`` float64, allocated at the first step and then only added to in place (no host sync, copy
    or allocation per step), so the static loop's CUDA graphs count their steps too: a graph adds to
    the buffer that existed when it was captured, at every replay. :meth:`pop_stats` therefore zeroes
    it in place, and :meth:`stats_checkpoint` / :meth:`stats_restore` let the loop drop its uncaptured
    warm-up steps.
    """

    method = "saap"
    phase = "decode"

    def __init__(self, layers: list[SaapLayerParams], top_l: int, *, impl: str = "auto", stats: bool = True,
                 top_l_layers: dict[int, int] | None = None) -> None:
        per_layer = {int(k): int(v) for k, v in (top_l_layers or {}).items()}
        bad = {k: v for k, v in per_layer.items() if v < 1 or not 0 <= k < len(layers)}
        if bad:
            raise ArtifactError(f"SAAP top_l_layers must name layers 0..{len(layers) - 1} with ℓ >= 1, got {bad}")
        self.layers = layers
        self.top_l = int(top_l)
        self.top_l_layers = per_layer
        self.impl = impl
        self.stats = stats
        self.index: dict[int, BucketIndex] = {}
        self._prefill_ctx: AttentionPositions | None = None  # the rotary module, for before_graph
        self._rot: torch.Tensor | None = None  # [B, 2, D] de-RoPE coefficients of this step's query position
        self._rot_layer = -1  # the layer that used it last: a lower or equal one starts a new step
        self._params_on: dict[tuple[int, str, torch.dtype], SaapLayerParams] = {}  # (layer, device, weight dtype)
        self._centroids_on: dict[tuple[int, str], torch.Tensor] = {}  # (layer, device)
        self._sums: torch.Tensor | None = None  # [selectivity, selectivity_with_window, count] summed
        # static index storage: per cache (freed with it), per layer
        self._storage: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._view_aligned = True  # every static index ends where the view puts it (before_graph)
        self._trig: dict | None = None  # cos/sin by positions, shared by the layers during before_graph
        self._all_signatures: tuple | None = None  # cost_signatures': (settings, layers, signatures)

    def layer_top_l(self, layer: int) -> int:
        """ℓ of layer ``layer``: its ``top_l_layers`` entry, else ``top_l``."""
        return self.top_l_layers.get(layer, self.top_l)

    def reads_every_key(self, layer: int) -> bool:
        """True for a SAAP layer whose ℓ visits every bucket (ℓ >= C): it runs dense attention."""
        p = self.layers[layer]
        return not p.dense and p.w2 is not None and self.layer_top_l(layer) >= p.w2.shape[-1]

    def _sums_on(self, device: torch.device) -> torch.Tensor:
        """The statistics buffer (class docstring), made at the first step on ``device``."""
        if self._sums is None:  # the first step: eager, or the static loop's uncaptured warm-up
            with torch.inference_mode(False):  # a normal tensor: pop_stats zeroes it outside inference mode
                self._sums = torch.zeros(3, dtype=torch.float64, device=device)
        return self._sums

    def _record_every_key(self, entries: int, device: torch.device) -> None:
        """A step of a layer at ℓ >= C: ``entries`` (batch row, KV head) pairs read every key."""
        sums = self._sums_on(device)
        sums[:2].add_(float(entries))  # Python numbers: nothing to copy, nothing to sync
        sums[2].add_(entries)

    def _record(self, layer: int, q_de: torch.Tensor, idx: BucketIndex, t: int | torch.Tensor) -> None:
        """Add this step's visited fractions for layer ``layer`` (``q_de [B, Hq, D]``, the classifier's
        input) to the sums, in place.

        ``t``: the valid keys, an int (eager) or ``cache_len [B]`` on the device (a static-cache step,
        whose view ``k`` is longer). A static step's index lags the cache (:meth:`advance`): the keys in
        ``[idx.searchable_hi, t)`` are attended densely with the window, and count as window keys here.
        Nothing here syncs with the host, so a CUDA graph captures it.
        """
        counts = idx.bucket_count.long()  # [B, Hkv, C]: keys in each bucket's list
        g = q_de.shape[1] // counts.shape[1]
        buckets = rank_buckets(classify_queries(q_de, self._params(layer, q_de.device)), g, self.layer_top_l(layer))
        visited = counts.gather(-1, buckets).sum(-1).double()  # [B, Hkv]
        candidates = counts.sum(-1).double()
        sel = torch.where(candidates > 0, visited / candidates.clamp(min=1), torch.zeros_like(visited))
        valid = t.double()[:, None] if isinstance(t, torch.Tensor) else float(t)  # [B, 1] or a number
        with_window = (visited + (valid - candidates)) / valid  # [B, Hkv]
        sums = self._sums_on(q_de.device)
        sums[:2].add_(torch.stack([sel.sum(), with_window.sum()]).to(sums.device))
        sums[2].add_(sel.numel())  # a Python number: no host-to-device copy

    def pop_stats(self) -> dict[str, float]:
        """Mean selectivities since the last call (class docstring); ``{}`` when no SAAP step ran since.

        Reads the sums (one host sync) and zeroes them in place, never drops them: a CUDA graph captured
        earlier keeps adding to this buffer at each replay."""
        if self._sums is None:
            return {}
        sel, with_window, n = self._sums.tolist()
        self._sums.zero_()
        if n == 0:
            return {}
        return {"selectivity": sel / n, "selectivity_with_window": with_window / n}

    def stats_checkpoint(self) -> torch.Tensor | None:
        """A copy of the sums (``None`` before the first step) for :meth:`stats_restore`: the static loop
        runs two uncaptured warm-up steps before each capture, which must not count."""
        return None if self._sums is None else self._sums.clone()

    def stats_restore(self, saved: torch.Tensor | None) -> None:
        """Put back the sums of :meth:`stats_checkpoint` (zeros for ``None``), in place: the buffer stays
        the one the next captured graph adds to."""
        if self._sums is None:
            return
        if saved is None:
            self._sums.zero_()
        else:
            self._sums.copy_(saved)

    @classmethod
    def from_artifact(cls, artifact, model, *, top_l: int | None = None,
                      top_l_layers: dict[int, int] | None = None, stats: bool = False) -> "SaapDecode":
        """The runtime of a ``saap`` artifact; ``top_l`` overrides the artifact's ℓ (an ℓ sweep),
        ``top_l_layers`` (``{layer: ℓ}``) the ℓ of some layers (default: the artifact's optional
        ``top_l_layers`` hyper-parameter). ``stats`` is off for serving (``hf.apply``'s default): the
        selectivity count ranks the buckets a second time per step; ``calib eval`` turns it on."""
        hp = artifact.manifest.hyperparameters
        n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        if n_layers is None:
            n_layers = 1 + max(int(k.split(".")[1]) for k in artifact.tensors if k.startswith("layers."))
        sink, recent = int(hp["sink"]), int(hp["window"]) - int(hp["sink"])
        dense = {int(x) for x in hp.get("dense_layers", [0])}
        layers = [SaapLayerParams.from_tensors(artifact.tensors, sink=sink, recent=recent, dense=i in dense,
                                               bn_eps=float(hp.get("bn_eps", 1e-5)), prefix=f"layers.{i}.")
                  for i in range(n_layers)]
        if top_l is not None and int(top_l) < 1:
            raise ArtifactError(f"SAAP top_l must be >= 1 (got {top_l})")
        if top_l_layers is None:
            top_l_layers = {int(k): int(v) for k, v in (hp.get("top_l_layers") or {}).items()}
        return cls(layers, int(hp["top_l"] if top_l is None else top_l), top_l_layers=top_l_layers, stats=stats)

    def _params(self, layer: int, device: torch.device, dtype: torch.dtype = torch.float32) -> SaapLayerParams:
        """Layer ``layer``'s tensors on ``device``, the classifier weights ``w1, w2`` in the serving dtype
        (the model's, for a 16-bit model: half the bytes per step; the kernels accumulate in float32, and
        ``tests/runtime/saap`` bound the effect on the ranked buckets), converted once."""
        wdt = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        key = (layer, str(device), wdt)
        if key not in self._params_on:
            self._params_on[key] = self.layers[layer].to(device, weight_dtype=wdt)
        return self._params_on[key]

    @staticmethod
    def _positions(ctx, batch: int, first: int, n: int, device: torch.device) -> torch.Tensor:
        pos = getattr(ctx, "position_ids", None)
        if pos is None or pos.shape[-1] != n:
            pos = torch.arange(first, first + n, device=device)[None]
        return pos.to(device).expand(batch, -1)

    def _derope(self, x: torch.Tensor, ctx, first: int) -> torch.Tensor:
        """``x [B, Hkv, T, D]`` (RoPE'd, positions ``first ..`` or ``ctx.position_ids``) de-RoPE'd. Inside
        :meth:`before_graph` the cos/sin of consecutive positions are computed once for every layer."""
        b, _, t, _ = x.shape
        cos, sin = self._trig_for(ctx, b, first, t, x.device)
        return derope(x, cos[:, None], sin[:, None])  # cos, sin [B, 1, T, D] against x [B, Hkv, T, D]

    def _trig_for(self, ctx, b: int, first: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``cos, sin [B, T, D]`` of positions ``first ..`` (or ``ctx.position_ids``), memoized
        during :meth:`before_graph`."""
        key = (first, t, b, str(device), id(ctx.rotary_emb))
        memo = self._trig if getattr(ctx, "position_ids", None) is None else None
        trig = None if memo is None else memo.get(key)
        if trig is None:
            pos = self._positions(ctx, b, first, t, device)
            trig = ctx.rotary_emb(torch.empty(0, dtype=torch.float32, device=device), pos)
            if memo is not None:
                memo[key] = trig
        return trig

    def cost_signature(self, layer: int) -> str | None:
        """What a decode step of ``layer`` costs depends on (:mod:`runtime_kernels.serving_policy`); None
        for a layer that reads every key anyway (dense, or ℓ >= C), where flash-decoding is exact and cheaper."""
        p = self.layers[layer]
        if p.dense or p.w1 is None or self.reads_every_key(layer):
            return None
        return (f"saap|C{p.w2.shape[-1]}|l{self.layer_top_l(layer)}|hidden{p.w1.shape[-1]}|"
                f"classifiers{p.num_classifiers}|sink{p.sink}|recent{p.recent}|stats{int(self.stats)}|{self.impl}")

    def cost_signatures(self) -> tuple[str | None, ...]:
        """:meth:`cost_signature` of every layer, kept while the settings (ℓ, per-layer ℓ, statistics,
        kernels) and every layer's parameters stay the same objects: the static loop asks at every new
        view, and a walk over the layers there costs more host time than the step's upkeep."""
        settings = (self.top_l, tuple(sorted(self.top_l_layers.items())), self.stats, self.impl)
        kept = self._all_signatures
        if (kept is None or kept[0] != settings or len(kept[1]) != len(self.layers)
                or any(a is not b for a, b in zip(kept[1], self.layers))):
            kept = self._all_signatures = (settings, tuple(self.layers),
                                           tuple(self.cost_signature(layer) for layer in range(len(self.layers))))
        return kept[2]

    def _query_rotation(self, layer: int, q: torch.Tensor, ctx, first: int) -> torch.Tensor:
        """De-RoPE coefficients ``[B, 2, D]`` of the position of ``q [B, Hq, 1, D]``
        (:func:`runtime_kernels.rope.derope_coefficients`): built once per step, at the first SAAP layer
        (every layer's query has the same position); the classifier kernel applies them as it loads the
        query, so a layer pays no de-RoPE launch."""
        if self._rot is None or layer <= self._rot_layer:
            pos = self._positions(ctx, q.shape[0], first, 1, q.device)  # [B, 1]
            cos, sin = ctx.rotary_emb(torch.empty(0, dtype=torch.float32, device=q.device), pos)  # [B, 1, D]
            self._rot = derope_coefficients(cos[:, 0], sin[:, 0])
        self._rot_layer = layer
        return self._rot

    @staticmethod
    def _padded(ctx, batch: int) -> bool:
        return batch > 1 and getattr(ctx, "attention_mask", None) is not None

    def observe_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> None:
        """Build layer ``layer``'s index from the prompt: ``k [B, Hkv, T, D]`` RoPE'd. Under the static
        loop (``ctx.rows`` set) the index is built later from the cache, by :meth:`before_graph`, and only
        for the layers the step will run SAAP in: the prompt's forward pass pays nothing."""
        self.index.pop(layer, None)
        self._prefill_ctx = AttentionPositions(ctx.rotary_emb)
        p = self.layers[layer]
        if (p.dense or self.reads_every_key(layer) or self._padded(ctx, k.shape[0]) or k.shape[2] != q.shape[2]
                or getattr(ctx, "rows", None) is not None):
            return
        self.build_index(layer, k, ctx)

    def build_index(self, layer: int, k: torch.Tensor, ctx, cache: Any = None) -> None:
        """Index the prompt's keys ``k [B, Hkv, T, D]`` (RoPE'd, positions ``0 .. T-1``) for layer
        ``layer``; ``ctx`` needs ``rotary_emb`` (an :class:`AttentionPositions` will do). Keys are
        de-RoPE'd and assigned :data:`INDEX_CHUNK` positions at a time (memory bounded at any length).
        ``cache`` (the static loop's): the lists go to this layer's storage for that cache, allocated once
        and reused by every later request (:meth:`_storage_for`)."""
        p = self.layers[layer]
        self._prefill_ctx = AttentionPositions(ctx.rotary_emb)
        centroids = self._centroids(layer, k.device)
        kb = [BucketIndex._assign(self._derope(k[:, :, s:s + INDEX_CHUNK], self._prefill_ctx, s), centroids, s, p.sink)
              for s in range(0, k.shape[2], INDEX_CHUNK)]
        kb = torch.cat(kb, -1) if kb else torch.empty(*k.shape[:2], 0, dtype=torch.int32, device=k.device)
        storage = None if cache is None else self._storage_for(layer, cache)
        self.index[layer] = BucketIndex.from_assignments(kb, centroids, sink=p.sink, recent=p.recent, storage=storage)

    def _centroids(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer ``layer``'s centroids ``[Hkv, C, D]`` float32 on ``device``, moved once: an index build needs
        them alone (not a float32 copy of the classifier weights beside the serving dtype's)."""
        key = (layer, str(device))
        if key not in self._centroids_on:
            self._centroids_on[key] = self.layers[layer].centroids.to(device, torch.float32)
        return self._centroids_on[key]

    def _build_indexes(self, layers: list[int], cache: Any, target: int) -> None:
        """Index the first ``target`` cache keys of every layer in ``layers`` (as :meth:`build_index` with
        ``cache``), layers of one bucket count, sink and window together: their keys de-RoPE'd and
        assigned as one stack, their lists laid out in one batched pass
        (:meth:`BucketIndex.from_assignments_many`), so a request's first step pays a few dozen launches
        for all its layers rather than as many per layer. A stack holds ``INDEX_CHUNK_LAYERS ·
        INDEX_CHUNK`` positions' keys (bounded memory whatever the length)."""
        groups: dict[tuple[int, int, int], list[int]] = {}
        for layer in layers:
            p = self.layers[layer]
            groups.setdefault((p.num_clusters, p.sink, p.recent), []).append(layer)
        for (_, sink, recent), group in groups.items():
            if len(group) == 1:
                self.build_index(group[0], cache.keys[group[0]][:, :, :target], self._prefill_ctx, cache=cache)
                continue
            keys = [cache.keys[layer][:, :, :target] for layer in group]
            per_layer = [self._centroids(layer, keys[0].device) for layer in group]
            centroids = torch.stack(per_layer)  # [L, Hkv, C, D]
            b, hkv = keys[0].shape[:2]
            step = max(1, INDEX_CHUNK_LAYERS * INDEX_CHUNK // len(group))
            kb = [self._assign_stack([k[:, :, s:s + step] for k in keys], centroids, s, sink)
                  for s in range(0, target, step)]
            kb = torch.cat(kb, -1) if kb else torch.empty(len(group), b, hkv, 0, dtype=torch.int32,
                                                          device=keys[0].device)
            built = BucketIndex.from_assignments_many(kb, per_layer, sink=sink, recent=recent,
                                                      storages=[self._storage_for(layer, cache) for layer in group])
            self.index.update(zip(group, built))

    def _assign_stack(self, keys: list[torch.Tensor], centroids: torch.Tensor, first: int, sink: int) -> torch.Tensor:
        """Bucket ids ``[L, B, Hkv, n]`` int32 of the RoPE'd keys ``keys[l] [B, Hkv, n, D]`` at positions
        ``first ..`` of L layers (``centroids [L, Hkv, C, D]``), de-RoPE'd as one stack."""
        x = torch.stack(keys)  # [L, B, Hkv, n, D]
        cos, sin = self._trig_for(self._prefill_ctx, x.shape[1], first, x.shape[3], x.device)
        return BucketIndex._assign(derope(x, cos[None, :, None], sin[None, :, None]), centroids, first, sink)

    def _storage_for(self, layer: int, cache: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s index storage for ``cache`` (``keys[layer] [B, Hkv, T, D]``: any index of at
        most ``T`` keys): the same tensors for every request the cache serves, so step graphs that read
        them can be replayed by later requests. Held as long as the cache (its generator) lives."""
        try:
            per_cache = self._storage.setdefault(cache, {})
        except TypeError:  # a cache object that cannot be referenced weakly: a fresh index, kept by no graph
            return None
        if layer not in per_cache:
            b, hkv, t, _ = cache.keys[layer].shape
            per_cache[layer] = BucketIndex.storage_for(b, hkv, self.layers[layer].num_clusters, t,
                                                       cache.keys[layer].device)
        return per_cache[layer]

    def advance(self, layer: int, q: torch.Tensor, k: torch.Tensor, ctx) -> tuple[BucketIndex, torch.Tensor] | None:
        """One decode step's index upkeep: the new (last) key of ``k [B, Hkv, T, D]`` appended to layer
        ``layer``'s index, and the query's de-RoPE coefficients ``[B, 2, D]``; None (index dropped) when this step
        runs dense: no index, a dense layer, a padded batch, or an index out of step with the cache.

        Static-cache steps (``ctx.cache_len`` set) append nothing: the index was brought up to the
        step's view by :meth:`before_graph`, and the keys that left the window since are attended as
        part of it (``[index.searchable_hi, cache_len)``), so the step never syncs with the host."""
        idx = self.index.get(layer)
        cache_len = getattr(ctx, "cache_len", None)
        if cache_len is not None:
            if idx is None or self.layers[layer].dense:
                return None
            if getattr(ctx, "position_ids", None) is None:
                raise ValueError("a static-cache SAAP step needs the position ids (the query's position)")
            return idx, self._query_rotation(layer, q, ctx, 0)
        t = k.shape[2]
        if idx is None or self.layers[layer].dense or self._padded(ctx, k.shape[0]) or idx.length != t - 1:
            self.index.pop(layer, None)
            return None
        idx.append(self._derope(k[:, :, -1:], ctx, t - 1))
        return idx, self._query_rotation(layer, q, ctx, t - 1)

    def before_graph(self, cache, valid: int, view: int, layers: "set[int] | None" = None,
                     stable: int | None = None) -> None:
        """Static-cache hook (:class:`runtime_kernels.generate.StaticGenerator`), outside any graph: the index
        of every SAAP layer in ``layers`` (None: all) is built from ``cache`` (``keys[layer] [B, Hkv,
        max_len + 1, D]``, ``valid`` written) or absorbs the keys that arrived since it was last brought up to
        date, up to ``min(valid - 1, stable)`` keys (the newest one, which the next step writes, never).
        Indexes of other layers are dropped.

        ``valid`` is the shortest row's count in a ragged batch: one index length serves every row, and a
        longer row attends its keys past the index densely, with its window (``[searchable_hi, cache_len)``).
        ``stable``: the keys every request at this view holds (the loop's view less one length bucket).
        Indexes ending there live in storage kept across requests (:meth:`_storage_for`), so what a step
        graph reads (the lists' addresses, where they end) depends on the view alone and the graph may
        serve later requests (:attr:`reads_request_state`); the keys between ``stable`` and ``valid`` are
        attended exactly, with the window."""
        if layers is not None and not layers:  # every layer dense at this step: no index to keep
            self.index.clear()
            self._view_aligned = True
            return
        target = valid - 1 if stable is None else min(valid - 1, stable)
        self._trig = {}  # every layer de-RoPEs the same positions
        try:
            rebuild = []
            for layer, p in enumerate(self.layers):
                if (p.dense or p.w1 is None or self.reads_every_key(layer)
                        or (layers is not None and layer not in layers)):
                    self.index.pop(layer, None)
                    continue
                idx = self.index.get(layer)
                if idx is None or idx.length > target or not idx.fixed:  # (re)built in this cache's storage
                    rebuild.append(layer)
                elif target > idx.length:
                    keys = cache.keys[layer][:, :, idx.length:target]
                    idx.append(self._derope(keys, self._prefill_ctx, idx.length))
            self._build_indexes(rebuild, cache, target)
        finally:
            self._trig = None
        self._view_aligned = not self.index or (stable is not None and target == stable
                                                and all(idx.fixed for idx in self.index.values()))

    @property
    def reads_request_state(self) -> bool:
        """Whether a static step reads state of this request alone, so that its graph may not serve another:
        false once :meth:`before_graph` ended every index where the view alone puts it (or built none)."""
        return not self._view_aligned

    @property
    def graph_variant(self) -> object:
        """What the static loop keys kept step graphs by beside the view: one value for view-aligned
        indexes, a new one for each request's own (never matched, :meth:`before_graph`)."""
        return "view-aligned" if self._view_aligned else object()

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               ctx) -> torch.Tensor | None:
        """``q [B, Hq, 1, D]``, ``k, v [B, Hkv, T, D]`` (the cache, new token last) -> ``[B, Hq, 1, D]`` or None.

        With ``ctx.cache_len [B]`` (a static-cache step) ``k, v`` are views longer than the valid keys.
        ``stats``: the step's selectivity is added on the device, eager or static (:meth:`_record`)."""
        if self.reads_every_key(layer):
            if self.stats:
                self._record_every_key(q.shape[0] * k.shape[1], q.device)
            return None
        step = self.advance(layer, q, k, ctx)
        if step is None:
            return None
        idx, rotation = step
        t = k.shape[2]
        cache_len = getattr(ctx, "cache_len", None)
        params = self._params(layer, q.device, q.dtype)
        out = saap_decode_attention(q[:, :, 0], k, v, idx, params, top_l=self.layer_top_l(layer),
                                    query_rotation=rotation, scale=scale, impl=self.impl, cache_len=cache_len)
        if self.stats:
            self._record(layer, classifier_input(q[:, :, 0], rotation, params), idx,
                         t if cache_len is None else cache_len)
        return out.unsqueeze(2)
