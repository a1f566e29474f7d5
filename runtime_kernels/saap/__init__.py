"""SAAP decode attention (Mazaré et al., arXiv:2502.08246): bucket index, query classifier, sparse attention."""

from runtime_kernels.saap.api import SaapDecode, derope, saap_decode_attention
from runtime_kernels.saap.bucket_index import BucketIndex, nearest_centroid, searchable_range
from runtime_kernels.saap.reference import (
    SaapLayerParams,
    classify_queries,
    dense_decode_attention,
    merge_partials,
    partial_attention,
    rank_buckets,
    saap_decode_attention_reference,
    sparse_attention_reference,
)

__all__ = [
    "BucketIndex",
    "SaapDecode",
    "SaapLayerParams",
    "classify_queries",
    "dense_decode_attention",
    "derope",
    "merge_partials",
    "nearest_centroid",
    "partial_attention",
    "rank_buckets",
    "saap_decode_attention",
    "saap_decode_attention_reference",
    "searchable_range",
    "sparse_attention_reference",
]
