"""Per-layer, per-prompt capture of queries, keys and values inside the model's forward pass.

Capture goes through a registered attention function (``transformers.AttentionInterface``), never a
copy of model source: the model is switched to the implementation ``calib_capture``, which calls the
model's own implementation (``sdpa``, ``eager``, ...) unchanged and then hands the layer's tensors to
a callback. Pre-RoPE queries/keys come from forward hooks on ``q_proj``/``k_proj`` (``q_norm``/``k_norm``
where a model normalizes heads before RoPE, as Qwen3 does). The callback runs while the layer's
tensors are alive, so a method can compute what needs the whole prompt (SAAP's KL targets, SALE's
per-head errors, SampleAttention's scores) layer by layer and keep only its results.

How transformers 5.x (checked on 5.17 and 5.23) calls an attention function::

    fn(module, query, key, value, attention_mask, *, dropout, scaling, position_ids, ..., **kwargs)

``query: [B, Hq, T, D]`` and ``key/value: [B, Hkv, T, D]`` are post-RoPE (GQA heads not repeated);
``module.layer_idx`` names the layer; ``position_ids: [B or 1, T]`` arrives in ``kwargs`` (the decoder
layer forwards it); there is no ``cache_position`` in 5.x. The function returns
``(attn_output: [B, T, Hq, D], weights | None)``, i.e. the per-head output before ``o_proj``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from calib.collect.memory import peak_gpu_bytes, peak_host_rss_bytes, reset_gpu_peak
from calib.errors import UserError

# transformers is imported where used: its import is heavy, and the CLI imports this module (through the
# recipes and calib.recipe_settings) for checks that must fail fast.

CAPTURE_IMPL = "calib_capture"


@dataclass
class LayerCapture:
    """One layer's tensors for one prompt (batch dim removed, padding cut off), on the model's device.

    Views into the forward pass's tensors: valid during the callback; copy (``.to("cpu")``, ``.clone()``)
    what must outlive it.
    """

    layer: int
    prompt_index: int
    q_pre: torch.Tensor  # [Hq, T, D] before RoPE
    q_post: torch.Tensor  # [Hq, T, D] after RoPE (what the attention used)
    k_pre: torch.Tensor  # [Hkv, T, D]
    k_post: torch.Tensor  # [Hkv, T, D]
    v: torch.Tensor  # [Hkv, T, D]
    positions: torch.Tensor  # [T] int64
    attn_output: torch.Tensor | None = None  # [Hq, T, D] per-head attention output before o_proj

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def to(self, device: str | torch.device) -> "LayerCapture":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[key] = value.to(device)
        return LayerCapture(**moved)


class _StopForward(Exception):
    """Raised after the last requested layer: the rest of the forward pass is not needed."""


_ACTIVE: "CaptureSession | None" = None


def _base_attention(impl: str, module: nn.Module) -> Callable[..., Any]:
    if impl == "eager":  # the model file's own eager function (not in the registry)
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers import AttentionInterface

    return AttentionInterface()[impl]


def _capture_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    session = _ACTIVE
    if session is not None and session.skips_attention(module):
        session._after_attention(module, query, key, value, None, kwargs)  # hands q/k/v over, then stops
    base = _base_attention(session.base_impl if session else "sdpa", module)
    out, weights = base(module, query, key, value, attention_mask, **kwargs)
    if session is not None:
        session._after_attention(module, query, key, value, out, kwargs)
    return out, weights


def _capture_mask(*args: Any, **kwargs: Any) -> Any:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    impl = _ACTIVE.base_impl if _ACTIVE is not None else "sdpa"
    return ALL_MASK_ATTENTION_FUNCTIONS[impl](*args, **kwargs)


def register_capture_attention() -> None:
    """Register ``calib_capture`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE_IMPL, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_IMPL, _capture_mask)


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index -> self-attention module (anything with ``layer_idx``, ``q_proj``, ``k_proj``)."""
    found = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj") and hasattr(module, "k_proj"):
            found[int(module.layer_idx)] = module
    if not found:
        raise ValueError(f"{type(model).__name__}: no attention modules with q_proj/k_proj/layer_idx found")
    return found


def normalize_prompts(prompts: Any) -> list[torch.Tensor]:
    """Prompts as a list of 1-D int64 CPU tensors (from lists of ids, 1-D tensors or a [N, T] tensor)."""
    if isinstance(prompts, torch.Tensor):
        prompts = list(prompts) if prompts.dim() == 2 else [prompts]
    return [torch.as_tensor(p, dtype=torch.long).reshape(-1).cpu() for p in prompts]


def check_prompt_lengths(prompts: Sequence[torch.Tensor], max_positions: int, model_name: str) -> None:
    """UserError (one line) for an empty prompt or one longer than the model's context."""
    for i, p in enumerate(prompts):
        n = int(p.numel())
        if n == 0:
            raise UserError(f"prompt {i} is empty: drop it from the data")
        if n > max_positions:
            raise UserError(f"prompt {i} has {n} tokens but model {model_name!r} accepts at most {max_positions} "
                            f"(max_position_embeddings): shorten it or lower the data's prompt length")


class CaptureSession:
    """The model switched to ``calib_capture`` with pre-RoPE hooks; call :meth:`forward` per batch."""

    def __init__(self, model: nn.Module, callback: Callable[[LayerCapture], None], layers: Sequence[int] | None,
                 keep_attn_output: bool, pad_token_id: int = 0):
        self.model = model
        self.callback = callback
        self.keep_attn_output = keep_attn_output
        self.pad_token_id = pad_token_id
        self.modules = attention_modules(model)
        num_layers = len(self.modules)
        self.layers = sorted(set(range(num_layers) if layers is None else (int(x) for x in layers)))
        if not self.layers or self.layers[0] < 0 or self.layers[-1] >= num_layers:
            raise UserError(f"layers={list(layers or [])} out of range: the model has layers 0..{num_layers - 1}")
        self.stop_after = self.layers[-1]
        self.base_impl = str(model.config._attn_implementation or "sdpa")
        self._pre: dict[tuple[int, str], torch.Tensor] = {}
        self._indices: list[int] | None = None  # set by forward(); None: a direct model call, rows 0..B-1
        self._lengths: list[int] | None = None
        self._positions: torch.Tensor | None = None

    def skips_attention(self, module: nn.Module) -> bool:
        """True for the last requested layer of our own :meth:`forward` when no attention output is kept:
        its q/k/v are all the callback needs, so the layer's attention (the costliest part of a long
        prefill) is not computed and the pass stops there."""
        return int(module.layer_idx) == self.stop_after and self._indices is not None and not self.keep_attn_output

    def _hook(self, layer: int, which: str) -> Callable[..., None]:
        def store(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            self._pre[(layer, which)] = output

        return store

    def _pre_heads(self, layer: int, which: str, batch: int, tokens: int, head_dim: int) -> torch.Tensor:
        raw = self._pre.pop((layer, which))  # [B, T, H*D] (q_proj) or [B, T, H, D] (q_norm)
        return raw.reshape(batch, tokens, -1, head_dim).transpose(1, 2)  # [B, H, T, D]

    def _after_attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         out: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        layer = int(module.layer_idx)
        if layer not in self.layers:
            return
        batch, _, tokens, head_dim = query.shape
        if key.shape[2] != tokens:
            raise RuntimeError("calib_capture expects a prefill without KV cache (use_cache=False)")
        q_pre = self._pre_heads(layer, "q", batch, tokens, head_dim)
        k_pre = self._pre_heads(layer, "k", batch, tokens, head_dim)
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = (self._positions if self._positions is not None else torch.arange(tokens, device=query.device))[None]
        indices = self._indices if self._indices is not None else range(batch)
        lengths = self._lengths if self._lengths is not None else [tokens] * batch
        for b, (index, n) in enumerate(zip(indices, lengths)):
            self.callback(LayerCapture(
                layer=layer, prompt_index=index,
                q_pre=q_pre[b, :, :n], q_post=query[b, :, :n], k_pre=k_pre[b, :, :n], k_post=key[b, :, :n],
                v=value[b, :, :n], positions=pos[min(b, pos.shape[0] - 1), :n],
                attn_output=out[b, :n].transpose(0, 1) if self.keep_attn_output and out is not None else None,
            ))
        if layer == self.stop_after and self._indices is not None:  # only our own forward() catches it
            raise _StopForward

    @torch.no_grad()
    def forward(self, prompts: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        """Run one batch (right-padded; padding never reaches a real token under the causal mask)."""
        device = next(self.model.parameters()).device
        self._indices = list(indices)
        self._lengths = [int(p.numel()) for p in prompts]
        width = max(self._lengths)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : p.numel()] = p
        self._positions = torch.arange(width, device=device)
        base = getattr(self.model, "base_model", self.model)  # skip the LM head: no [B, T, vocab] logits
        try:
            base(input_ids=ids.to(device), position_ids=self._positions[None].expand(len(prompts), -1), use_cache=False)
        except _StopForward:
            pass
        finally:
            self._pre.clear()
            self._indices = self._lengths = self._positions = None


@contextmanager
def capture_session(model: nn.Module, callback: Callable[[LayerCapture], None], *, layers: Sequence[int] | None = None,
                    keep_attn_output: bool = False, pad_token_id: int = 0) -> Iterator[CaptureSession]:
    """Switch ``model`` to ``calib_capture`` (and back on exit); yields the :class:`CaptureSession`."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a capture session is already active (sessions do not nest)")
    register_capture_attention()
    session = CaptureSession(model, callback, layers, keep_attn_output, pad_token_id)
    handles = []
    for layer in session.layers:
        attn = session.modules[layer]
        handles.append(getattr(attn, "q_norm", attn.q_proj).register_forward_hook(session._hook(layer, "q")))
        handles.append(getattr(attn, "k_norm", attn.k_proj).register_forward_hook(session._hook(layer, "k")))
    try:
        model.set_attn_implementation(CAPTURE_IMPL)
        _ACTIVE = session
        yield session
    finally:
        _ACTIVE = None
        if model.config._attn_implementation == CAPTURE_IMPL:
            model.set_attn_implementation(session.base_impl)
        for h in handles:
            h.remove()


def run_layer_callbacks(loaded: Any, prompts: Any, callback: Callable[[LayerCapture], None], *,
                        layers: Sequence[int] | None = None, keep_attn_output: bool = False,
                        batch_size: int = 1, progress: bool = True, desc: str = "prompts") -> dict[str, Any]:
    """Run every prompt through ``loaded.model`` and call ``callback(LayerCapture)`` per layer and prompt.

    The per-layer, per-prompt hook: ``callback`` runs inside the forward pass while that
    layer's tensors for that prompt are in memory (on the model's device); whatever it keeps is its
    own business, nothing full-length is stored here. Layers are visited in order 0..L-1 for a batch;
    the forward pass stops at the last requested layer, whose attention is not even computed unless
    ``keep_attn_output`` asks for its output. ``prompts``: lists of token ids, 1-D
    tensors or a [N, T] tensor; ``prompt_index`` in the captures is the position in this list.
    Returns throughput and peak-memory stats.
    """
    items = normalize_prompts(prompts)
    check_prompt_lengths(items, loaded.facts.max_position_embeddings, loaded.facts.name)
    pad = getattr(loaded.tokenizer, "pad_token_id", None) or 0
    reset_gpu_peak(loaded.device)
    start, tokens = time.perf_counter(), 0
    with capture_session(loaded.model, callback, layers=layers, keep_attn_output=keep_attn_output,
                         pad_token_id=pad) as session:
        for first in tqdm(range(0, len(items), batch_size), desc=desc, disable=not progress, unit="batch"):
            batch = items[first:first + batch_size]
            session.forward(batch, range(first, first + len(batch)))
            tokens += sum(int(p.numel()) for p in batch)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    seconds = time.perf_counter() - start
    return {"prompts": len(items), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
            "peak_gpu_bytes": peak_gpu_bytes(loaded.device), "peak_host_rss_bytes": peak_host_rss_bytes()}
