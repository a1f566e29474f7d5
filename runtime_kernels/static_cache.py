"""The static KV cache of the serving loop (:class:`runtime_kernels.generate.StaticGenerator`): buffers
preallocated per layer that the model's attention layers write in place, and the decode step's write of
each row's new key and value at that row's own position (:func:`write_step_kv`)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache as _HFCache  # so `isinstance(cache, Cache)` in model code holds


@functools.cache
def _step_row_writer() -> Callable[..., None] | None:
    """:func:`runtime_kernels.triton_kv_write.write_step_rows`, or None without Triton (imported once)."""
    try:
        from runtime_kernels.triton_kv_write import write_step_rows
    except ImportError:
        return None
    return write_step_rows


def write_step_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  pos: torch.Tensor) -> None:
    """A decode step's ``k, v [B, Hkv, 1, D]`` into ``k_cache, v_cache [B, Hkv, T, D]`` at each row's
    position ``pos [B]``: one Triton launch for both on CUDA (:mod:`runtime_kernels.triton_kv_write`), else
    ``scatter_`` (two launches)."""
    writer = _step_row_writer() if k_cache.is_cuda else None
    if writer is not None:
        writer(k_cache, v_cache, k, v, pos)
        return
    at = pos.view(-1, 1, 1, 1).expand_as(k)
    k_cache.scatter_(2, at, k.to(k_cache.dtype))
    v_cache.scatter_(2, at, v.to(v_cache.dtype))


class StaticKVCache(_HFCache):
    """Preallocated keys and values ``[B, Hkv, max_len + 1, D]`` per layer, written in place.

    The model's attention layers call :meth:`update`, which copies the new ``[B, Hkv, n, D]`` keys and
    values to the positions in :attr:`write_pos` (a device tensor the generator sets) and returns the
    views ``[:, :, :view]`` (``view`` a host int set by the generator: static within a CUDA graph).
    ``length [B]`` is the number of valid keys once this step's keys are written.

    :attr:`rows` restricts writes and views to some batch rows: a ragged batch's prefill runs a run of
    rows (or one row) at a time; a slice, or (a run of rows that are not adjacent) a tensor of row indices,
    which a prefill call writes and then attends as written. During decode steps :attr:`step_pos` ``[B]``
    holds each row's write position (one key per row, each at its own position).

    Only the few transformers ``Cache`` members a decoder-only model calls are provided (``update``,
    ``get_seq_length``, ``is_compileable`` and the layer-kind lists mask helpers read); the generator
    always passes a ready 4D mask, which transformers' mask creation returns unchanged.
    """

    is_compileable = True

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        # Cache.__init__ is not called on purpose: its per-layer classes change between transformers
        # releases; this class holds its own buffers and answers the calls the model makes.
        # one row past max_len, never written or read: a view [:, :, :view] is then never the whole
        # buffer, so its strides relate to its length alike at every view (a compiled model's SDPA
        # guards on that relation and would recompile at the view that reaches the end)
        shape = (batch, num_kv_heads, max_len + 1, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len = int(max_len)
        self.batch = int(batch)
        self.view = 0
        self.write_pos = torch.zeros(1, dtype=torch.long, device=device)  # prefill: the positions written
        self.step_pos: torch.Tensor | None = None  # decode: [B] each row's position (set by the generator)
        self.rows: slice | torch.Tensor = slice(None)  # the batch rows a call writes and sees
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.layers: list[Any] = []  # transformers' mask helpers iterate per-layer kinds through these lists

    @classmethod
    def for_model(cls, model: Any, batch: int, max_len: int) -> "StaticKVCache":
        """A cache sized for ``model`` (a transformers causal LM) on its device and dtype."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, head_dim, max_len, p.device, p.dtype)

    # -------------------------------------------------------------------- what the model calls
    # Never traced (a graph break under torch.compile): calib attention breaks the graph in every
    # layer, so each layer's attention frame would trace this alone, and ``self.keys[layer_idx]`` would
    # pin the frame to one layer: a compile per layer up to dynamo's recompile limit, then eager.
    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states, value_states [b, Hkv, n, D]`` of :attr:`rows` at :attr:`write_pos` (a decode
        step: one key per row at :attr:`step_pos`); return the views ``[b, Hkv, view, D]``."""
        if not isinstance(self.rows, slice):  # scattered rows prefill from position 0: the view is what they write
            n = key_states.shape[2]
            for buf, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
                buf[:, :, :n].index_copy_(0, self.rows, new.to(buf.dtype))
            return key_states.to(self.keys[layer_idx].dtype), value_states.to(self.values[layer_idx].dtype)
        k_buf, v_buf = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]
        if self.step_pos is not None:
            write_step_kv(k_buf, v_buf, key_states, value_states, self.step_pos)
        else:
            k_buf.index_copy_(2, self.write_pos, key_states.to(k_buf.dtype))
            v_buf.index_copy_(2, self.write_pos, value_states.to(v_buf.dtype))
        return k_buf[:, :, : self.view], v_buf[:, :, : self.view]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.view

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for transformers' mask creation (prefill from position 0)."""
        return self.view, 0

    def get_query_offset(self, *args: Any, **kwargs: Any) -> int:
        return 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.keys)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.keys)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)
