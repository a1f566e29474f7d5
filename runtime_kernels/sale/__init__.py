"""SALE prefill: low-bit Selection-Pass + block-sparse attention (Ji et al., arXiv:2505.24179)."""

from runtime_kernels.sale.api import SalePrefill, sale_block_scores, sale_prefill_attention, sale_select
from runtime_kernels.sale.reference import (
    SaleSelectionConfig,
    approximate_scores,
    quantize_blockwise,
    select_blocks,
    sink_local_stats,
)

__all__ = [
    "SalePrefill",
    "SaleSelectionConfig",
    "approximate_scores",
    "quantize_blockwise",
    "sale_block_scores",
    "sale_prefill_attention",
    "sale_select",
    "select_blocks",
    "sink_local_stats",
]
