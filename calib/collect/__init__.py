"""The Q/K/V collector shared by all methods (docs/methods.md, Shared machinery).

* :func:`run_layer_callbacks` — the per-layer, per-prompt hook: a callback sees each layer's pre/post
  RoPE queries and keys, values and (optionally) per-head attention output for one prompt while the
  forward pass holds them, so methods compute whole-prompt quantities without storing Q/K/V.
* :func:`collect` — per-head sampled Q/K/V of a prompt set, streamed to per-prompt shards under a
  content-hash directory, resumable and reused across runs; read back with :class:`CollectedSet`.
"""

from calib.collect.capture import (CAPTURE_IMPL, LayerCapture, capture_session, register_capture_attention,
                                   run_layer_callbacks)
from calib.collect.collector import CollectConfig, collect
from calib.collect.store import CollectedSet

__all__ = ["CAPTURE_IMPL", "CollectConfig", "CollectedSet", "LayerCapture", "capture_session", "collect",
           "register_capture_attention", "run_layer_callbacks"]
