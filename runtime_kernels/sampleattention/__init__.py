"""SampleAttention prefill: two-stage column/slash block selection + block-sparse attention."""

from runtime_kernels.sampleattention.api import (
    SampleAttentionPrefill,
    bucket_table_tensor,
    sampleattention_prefill_attention,
    sampleattention_prefill_mask,
)
from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable
from runtime_kernels.sampleattention.reference import (
    Selection,
    cumulative_residual_attention,
    sample_scores,
    sampled_query_rows,
    sampleattention_select,
    select_and_report,
    stage1_reductions,
    stage2_select,
)

__all__ = [
    "BucketRow",
    "BucketTable",
    "SampleAttentionPrefill",
    "Selection",
    "bucket_table_tensor",
    "cumulative_residual_attention",
    "sample_scores",
    "sampleattention_prefill_attention",
    "sampleattention_prefill_mask",
    "sampled_query_rows",
    "sampleattention_select",
    "select_and_report",
    "stage1_reductions",
    "stage2_select",
]
