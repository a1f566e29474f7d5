"""Plug calib artifacts into a transformers model through ``transformers.AttentionInterface``.

``apply(model, artifact_or_uri, ...)`` verifies each artifact against the model (every sha256, the
architecture facts), builds the method's runtime object (:data:`RUNTIMES`), registers one attention function
``"calib_sparse"`` and switches the model to it — no model class is patched. Methods compose: at most
one *prefill* method (SALE, SampleAttention) and one *decode* method (SAAP, SANTA). A call with more
than one query is a prefill, a single query a decode step; whatever phase has no method runs the
model's previous attention implementation (SDPA by default), as does any call the method cannot take
(e.g. a padded batch for a prefill method), logged once.

What a method runtime provides: :func:`attach`. What a decode runtime sees under the static-cache serving
loop (:class:`runtime_kernels.generate.StaticGenerator`): :func:`calib_attention_forward`. Serving modes:
``serve="fastest"`` (the default) runs a method only where it times faster than dense attention on this GPU
(per layer, batch and length: :mod:`runtime_kernels.serving_policy`); ``serve="method"`` runs it wherever it
can, which is what ``calib eval`` measures accuracy with.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from runtime_kernels.artifact import load_artifact
from runtime_kernels.errors import ArtifactError
from runtime_kernels.manifest import Artifact, check_model_facts, facts_from_hf_config
from runtime_kernels.serving_policy import PrefillChooser, PrefillGuard

# Imported where used: transformers' attention registry (its modeling_utils takes seconds to import, and a
# caller holding a model has it loaded already) and runtime_kernels.generate (it imports this module).

log = logging.getLogger(__name__)

ATTN_NAME = "calib_sparse"
SERVE_MODES = ("fastest", "method")

# method -> "module:factory"; the factory is ``from_artifact(artifact, model) -> runtime``.
RUNTIMES: dict[str, str] = {
    "sale": "runtime_kernels.sale.api:SalePrefill",
    "sampleattention": "runtime_kernels.sampleattention.api:SampleAttentionPrefill",
    "saap": "runtime_kernels.saap.api:SaapDecode",
    "santa": "runtime_kernels.santa.runtime:SantaDecode",
}


@dataclass
class AttentionCall:
    """What a method runtime may need beyond q/k/v for one attention call."""

    module: torch.nn.Module
    position_ids: torch.Tensor | None
    rotary_emb: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None
    attention_mask: torch.Tensor | None
    cache_len: torch.Tensor | None = None  # [B] valid keys of a static-cache decode step (calib_attention_forward)
    rows: slice | list[int] | None = None  # the batch rows a prefill call covers (a ragged batch's run); None: all
    lengths: list[int] | None = None  # each row's own token count in a padded prefill call (``ragged_prefill``)


@dataclass
class CalibAttention:
    """The state ``apply`` attaches to a model (``model.calib_attention``)."""

    prefill: Any | None
    decode: Any | None
    artifacts: list[Artifact]
    fallback: str
    rotary_emb: Any | None
    warned: set[str] = field(default_factory=set)
    static_len: torch.Tensor | None = None  # set by generate.StaticGenerator during its decode steps
    static_rows: slice | list[int] | None = None  # set by generate.StaticGenerator during a ragged batch's prefill
    static_lengths: list[int] | None = None  # set by generate.StaticGenerator during a padded prefill of rows
    serve: str = "fastest"  # SERVE_MODES (module docstring)
    serve_dense: frozenset[int] = frozenset()  # layers the current static decode graph runs densely
    static_method_layers: set[int] = field(default_factory=set)  # layers whose decode method ran in a static step
    prefill_identity: str | None = None  # the prefill artifact's content hash: its timings' cache key
    prefill_chooser: PrefillChooser = field(default_factory=PrefillChooser)
    prefill_guard: PrefillGuard = field(default_factory=PrefillGuard)  # whole prefills (the static loop)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(message)


def _factory(method: str) -> Callable[[Artifact, Any], Any]:
    if method not in RUNTIMES:
        raise ArtifactError(f"no runtime for method {method!r}; known: {', '.join(sorted(RUNTIMES))}")
    module, _, name = RUNTIMES[method].partition(":")
    return getattr(importlib.import_module(module), name).from_artifact


def model_facts(model: Any) -> dict[str, Any]:
    """Architecture facts of a transformers model, plus ``model_hash`` if the loader recorded one."""
    facts = facts_from_hf_config(model.config)
    facts_hash = getattr(model, "calib_model_hash", None)
    if facts_hash:
        facts["model_hash"] = facts_hash
    return facts


def _rotary(model: Any) -> Any | None:
    inner = getattr(model, "model", model)
    return getattr(inner, "rotary_emb", None)


_WARNED_DRY_RUN: set[str] = set()  # dry-run artifacts apply() has warned about


def apply(model: Any, *artifacts: str | os.PathLike | Artifact, tracking_uri: str | None = None,
          options: dict[str, dict[str, Any]] | None = None, serve: str = "fastest") -> CalibAttention:
    """Enable the artifacts' methods on ``model``; returns the attached :class:`CalibAttention`.

    Each artifact may be a directory, ``models:/name@alias``/``models:/name/version`` or an already
    loaded :class:`Artifact` (re-checked against this model). ``options`` overrides runtime settings
    per method, e.g. ``{"saap": {"top_l": 32}}`` (SAAP: buckets visited instead of the artifact's ℓ;
    ``"top_l_layers": {3: 192}``: per-layer ℓ on top of that, layers not named keep ``top_l``).
    ``serve``: ``"fastest"`` or ``"method"`` (module docstring).
    Raises :class:`ArtifactError` for an artifact calibrated for another model, two methods of the
    same phase, or an option the method's runtime does not take.
    """
    if not artifacts:
        raise ArtifactError("apply() needs at least one artifact")
    facts = model_facts(model)
    loaded: list[Artifact] = []
    for a in artifacts:
        if isinstance(a, Artifact):
            check_model_facts(a.manifest.model, facts, where=str(a.path))
            loaded.append(a)
        else:
            loaded.append(load_artifact(a, model=facts, tracking_uri=tracking_uri))
    for art in loaded:  # once per artifact directory and process
        if art.manifest.model.dry_run and str(art.path) not in _WARNED_DRY_RUN:
            _WARNED_DRY_RUN.add(str(art.path))
            log.warning("%s artifact %s was calibrated on random weights: for measuring cost only",
                        art.method, art.path)
    options = dict(options or {})
    unused = set(options) - {art.method for art in loaded}
    if unused:
        raise ArtifactError(f"runtime options for {', '.join(sorted(unused))}, but no such artifact was given")
    runtimes: dict[str, Any] = {"prefill": None, "decode": None}
    for art in loaded:
        opts = options.get(art.method) or {}
        try:
            rt = _factory(art.method)(art, model, **opts)
        except TypeError as exc:
            if not opts:
                raise
            raise ArtifactError(f"the {art.method} runtime does not take the options {sorted(opts)} ({exc})") from exc
        for phase in (("prefill", "decode") if rt.phase == "both" else (rt.phase,)):
            if runtimes[phase] is not None:
                raise ArtifactError(f"two {phase} methods given ({runtimes[phase].method} and {art.method}); combine "
                                    "one prefill method (sale, sampleattention) with one decode method (saap, santa)")
            runtimes[phase] = rt
    prefill_art = next((a for a in loaded if runtimes["prefill"] is not None and a.method == runtimes["prefill"].method), None)
    return attach(model, prefill=runtimes["prefill"], decode=runtimes["decode"], artifacts=loaded, serve=serve,
                  prefill_identity=None if prefill_art is None else artifact_identity(prefill_art))


def artifact_identity(art: Artifact) -> str:
    """A short hash of an artifact's tensors (their recorded sha256s): what its prefill timings depend on."""
    digest = hashlib.sha256("".join(sorted(f"{t.name}:{t.sha256}" for t in art.manifest.tensors)).encode())
    return digest.hexdigest()[:16]


def attach(model: Any, *, prefill: Any | None = None, decode: Any | None = None,
           artifacts: list[Artifact] | None = None, serve: str = "method",
           prefill_identity: str | None = None) -> CalibAttention:
    """Attach method runtime objects directly (calibration uses this to score candidate settings).

    ``apply`` is this plus artifact loading and verification. Replaces any earlier attachment. ``serve``
    defaults to ``"method"`` here: calibration scores the method itself; a prefill method is timed
    against dense only with a ``prefill_identity`` (the key its timings are cached under).

    A method runtime is an object with ``phase`` (``"prefill"``, ``"decode"`` or ``"both"``, e.g. SANTA
    sampling in prefill and decode) and

    * prefill: ``prefill(layer, q, k, v, scale, ctx) -> out | None`` with ``q: [B, Hq, T, D]``,
      ``k, v: [B, Hkv, T, D]`` (RoPE'd), returning ``[B, Hq, T, D]`` (``None`` = run dense). A runtime with
      ``ragged_prefill = True`` also takes rows padded after their last token (``ctx.lengths``: each row's
      own count), computing each row as it would alone and finite values in the padding; without it the
      static loop prefills such rows one at a time;
    * decode: ``observe_prefill(layer, q, k, v, ctx)`` (build per-layer state from the prompt's cache) and
      ``decode(layer, q, k, v, scale, ctx) -> out | None`` with ``q: [B, Hq, 1, D]`` and the full cache;
    * optionally ``pop_stats() -> dict`` (method statistics since the last call, which ``calib eval``
      reports) and ``stats_checkpoint() -> object`` / ``stats_restore(object)``, with which the static loop
      keeps its uncaptured warm-up steps out of those statistics;
    * optionally ``cost_signature(layer) -> str | None`` (decode): layers of equal signatures cost the same,
      ``None`` never beats dense (:mod:`runtime_kernels.serving_policy`);
    * optionally ``reads_request_state = False`` (decode): its steps read nothing built for one request
      (FlashDecode), so the static loop replays a step graph captured for an earlier request. Without it
      a graph is kept across requests only when the method ran in no layer of the step.
    """
    if serve not in SERVE_MODES:
        raise ArtifactError(f"serve must be one of {', '.join(SERVE_MODES)} (got {serve!r})")
    remove(model)
    _register()
    fallback = model.config._attn_implementation or "sdpa"
    state = CalibAttention(prefill, decode, list(artifacts or []), fallback, _rotary(model), serve=serve,
                           prefill_identity=prefill_identity)
    model.calib_attention = state
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
            module.calib_attention = state
    _set_impl(model, ATTN_NAME)
    return state


def remove(model: Any) -> None:
    """Undo :func:`apply`: restore the previous attention implementation."""
    state = getattr(model, "calib_attention", None)
    if state is None:
        return
    _set_impl(model, state.fallback)
    for module in model.modules():
        if module is not model and getattr(module, "calib_attention", None) is state:
            del module.calib_attention
    del model.calib_attention


def _set_impl(model: Any, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            return
        except (ValueError, AttributeError, TypeError):
            pass
    model.config._attn_implementation = name


def _register() -> None:
    """Register the attention function, and SDPA's mask builder under the same name: transformers then
    passes ``None`` for an unpadded causal batch (SDPA's ``is_causal`` fast path, and what the prefill
    methods take as unpadded) instead of a dense ``[B, 1, T, T]`` mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, _untraced_attention_forward())
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@functools.cache
def _untraced_attention_forward() -> Callable[..., tuple[torch.Tensor, None]]:
    """:func:`calib_attention_forward` as the model calls it: never traced by ``torch.compile`` (a
    graph break; it runs eagerly inside a compiled model). The method runtimes hold Python state (SAAP's
    index, the call counters) and launch Triton kernels whose arguments a trace would freeze. One
    wrapper for the process, so compiled code guarding on the registered function stays valid across
    ``attach`` calls; wrapped here rather than at import because ``torch.compiler.disable`` imports
    dynamo (a second of import time) and only a model's forward reaches this."""
    return torch.compiler.disable(calib_attention_forward)


def _dense(state: CalibAttention) -> Callable[..., Any]:
    from transformers import AttentionInterface

    fallback = state.fallback if state.fallback != ATTN_NAME else "sdpa"
    return AttentionInterface()[fallback]


def _plain_prefill(mask: torch.Tensor | None, batch: int, q_len: int, k_len: int) -> bool:
    """An unpadded causal prefill from position 0, which is what the prefill methods assume.

    With one sequence there is no padding, whatever mask transformers built; with several, only a
    ``None`` mask (transformers' "all causal, no padding" fast path) is taken as unpadded.
    """
    return q_len == k_len and (batch == 1 or mask is None)


def calib_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``query [B, Hq, Tq, D]``, ``key/value [B, Hkv, Tk, D]``.

    Returns ``([B, Tq, Hq, D], None)`` like transformers' SDPA integration. ``ctx`` (the runtime's last
    argument) is an :class:`AttentionCall` carrying the module, the position ids and the model's rotary
    embedding (for de-RoPE). Under :class:`runtime_kernels.generate.StaticGenerator` (a preallocated cache,
    CUDA graphs) decode calls get ``k, v`` as views of the preallocated buffers, longer than the valid
    length, and ``ctx.cache_len [B]`` (int64, on the device) says how many keys are valid; a decode runtime
    must then read no key past it and must not synchronize with the host (``ctx.cache_len is None`` in the
    eager path, where ``k.shape[2]`` is the length).
    """
    state: CalibAttention | None = getattr(module, "calib_attention", None)
    if state is None:
        raise RuntimeError("calib_sparse attention called on a module without calib state; use runtime_kernels.hf.apply")
    layer = int(module.layer_idx)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    ctx = AttentionCall(module, kwargs.get("position_ids"), state.rotary_emb, attention_mask,
                        rows=state.static_rows, lengths=state.static_lengths)
    q_len, k_len = query.shape[2], key.shape[2]
    out = None
    if q_len > 1:
        if state.decode is not None and state.decode is not state.prefill:
            state.decode.observe_prefill(layer, query, key, value, ctx)
        if state.prefill is not None:
            if _plain_prefill(attention_mask, query.shape[0], q_len, k_len):
                out = _prefill(state, layer, module, query, key, value, attention_mask, scale, ctx, dropout, kwargs)
            else:
                state.warn_once("padded", "calib: padded or chunked prefill falls back to dense attention")
    elif state.decode is not None and not (state.static_len is not None and layer in state.serve_dense):
        if state.static_len is not None:  # the 4D mask only hides the view's tail: the length says it
            ctx = AttentionCall(module, kwargs.get("position_ids"), state.rotary_emb, None, state.static_len)
        out = state.decode.decode(layer, query, key, value, scale, ctx)
        if out is not None and state.static_len is not None:
            state.static_method_layers.add(layer)  # read by the static loop: may its graph serve a later request?
    if out is None and q_len == 1 and state.static_len is not None:  # a dense layer of a static-cache step
        from runtime_kernels.generate import flash_decode

        out = flash_decode(query, key, value, scale, state.static_len)
    if out is None:
        return _dense(state)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return out.transpose(1, 2).contiguous(), None


def _prefill(state: CalibAttention, layer: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, mask: torch.Tensor | None, scale: float, ctx: AttentionCall, dropout: float,
             kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The prefill method's output ``[B, Hq, T, D]`` for this call, or None (dense): under
    ``serve="fastest"`` only where it measured faster than dense at this layer and shape."""
    def method() -> torch.Tensor | None:
        return state.prefill.prefill(layer, query, key, value, scale, ctx)

    if state.serve != "fastest" or state.prefill_identity is None:
        return method()

    def dense() -> torch.Tensor:
        out = _dense(state)(module, query, key, value, mask, dropout=dropout, scaling=scale, **kwargs)[0]
        return out.transpose(1, 2)

    signature = (f"{state.prefill.method}|{state.prefill_identity}|layer{layer}|{tuple(query.shape[1:2])}"
                 f"{tuple(key.shape[1:2])}|D{query.shape[-1]}|{query.dtype}")
    return state.prefill_chooser.run(signature, query, key, method, dense)
