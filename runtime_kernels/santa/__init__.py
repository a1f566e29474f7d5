"""SANTA / S²ANTA sampled value aggregation (Lee et al., arXiv:2605.01910; docs/methods.md, SANTA / S²ANTA).

``santa_attention`` (prefill / general: iid, strat, sys per query row) and ``santa_decode_attention``
(one decode step: prop / flash tilings, or the untiled estimators) with this layer's sample budget S.
``api.py`` dispatches to ``reference.py`` (PyTorch, float64 sampling: the definition of correct) or,
on CUDA, to ``triton.py`` when present. ``reference.py`` documents how uniform offsets become keys.
``schedule.py`` turns the learned per-layer share into a schedule for any total budget, and
``runtime.py`` holds ``SantaDecode``, the per-layer-schedule runtime that ``runtime_kernels.hf`` attaches.

The names below are imported on first use (PEP 562), so ``runtime_kernels.santa.schedule`` (plain
Python) can be used without importing torch — calibration's aggregator pod never needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SantaDecode": "runtime", "decode_sample_counts": "api", "exact_attention": "api", "expected_prop_output": "api",
    "normalize_num_samples": "api", "per_row_sample_counts": "api", "santa_attention": "api",
    "santa_decode_attention": "api", "flash_tile_budget": "tiling", "largest_remainder": "tiling",
    "prop_tile_budgets": "tiling", "apportion": "schedule",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
