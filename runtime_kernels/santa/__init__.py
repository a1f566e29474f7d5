"""SANTA / S²ANTA sampled value aggregation (papers/santa.txt; SPEC §5.4).

``santa_attention`` (prefill / general: iid, strat, sys per query row) and ``santa_decode_attention``
(one decode step: prop / flash tilings, or the untiled estimators) with this layer's sample budget S.
``api.py`` dispatches to ``reference.py`` (PyTorch, float64 sampling: the definition of correct) or,
on CUDA, to ``triton.py`` when present. ``reference.py`` documents how uniform offsets become keys.
"""

from runtime_kernels.santa.api import (
    SantaDecode,
    decode_sample_counts,
    exact_attention,
    expected_prop_output,
    normalize_num_samples,
    per_row_sample_counts,
    santa_attention,
    santa_decode_attention,
)
from runtime_kernels.santa.tiling import flash_tile_budget, largest_remainder, prop_tile_budgets

__all__ = [
    "SantaDecode",
    "decode_sample_counts",
    "exact_attention",
    "expected_prop_output",
    "flash_tile_budget",
    "largest_remainder",
    "normalize_num_samples",
    "per_row_sample_counts",
    "prop_tile_budgets",
    "santa_attention",
    "santa_decode_attention",
]
