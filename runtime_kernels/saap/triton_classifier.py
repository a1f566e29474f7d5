"""SAAP's per-step bucket selection in Triton (Mazaré et al., arXiv:2502.08246, §4, App. F):
the query classifier MLP of every query head or KV head (``q_derope @ w1 + b1``, eval batch-norm, ReLU,
``@ w2 + b2``), then the top-ℓ buckets of each KV head (:mod:`runtime_kernels.saap.triton_rank`), on the
GPU without a host sync.

The classifier path is chosen by batch size: ``B <= CONFIG.small_batch_max_b`` (16) takes
:mod:`~runtime_kernels.saap.triton_classifier_small_batch` (layer 1 writing three-term hidden, layer 2
one pass over w2), larger batches :mod:`~runtime_kernels.saap.triton_classifier_large_batch` (two
tensor-core launches on four-term activations). Both give float32-exact logits from 16-bit weights.
"""

from __future__ import annotations

import torch

from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.reference import SaapLayerParams, classifier_rows, query_head_logits
from runtime_kernels.saap.triton_classifier_large_batch import large_batch_logits
from runtime_kernels.saap.triton_classifier_small_batch import small_batch_logits
from runtime_kernels.saap.triton_rank import saap_rank_buckets_triton


def _logits(q_derope: torch.Tensor, params: SaapLayerParams) -> torch.Tensor:
    """The classifier path of this batch size (logits ``[B, Hq, C]`` float32, possibly a strided view).
    Classifiers shared by a KV head's query heads see the group's queries as batch rows
    (:func:`reference.classifier_rows`): each classifier's weights are read once for all of them."""
    if params.w1.device != q_derope.device:
        raise ValueError(f"classifier weights on {params.w1.device}, query on {q_derope.device}")
    b, hq, _ = q_derope.shape
    if params.num_classifiers != hq:
        return query_head_logits(_logits(classifier_rows(q_derope, params.num_classifiers), params), b)
    if b <= _tc.CONFIG.small_batch_max_b:
        return small_batch_logits(q_derope, params)
    return large_batch_logits(q_derope, params)


def saap_classifier_logits_triton(q_derope: torch.Tensor, params: SaapLayerParams) -> torch.Tensor:
    """Classifier logits of every query head: ``q_derope [B, Hq, D]`` -> ``[B, Hq, C]`` float32.

    ``softmax(-1)`` of the result is :func:`reference.classify_queries` (to float32 rounding)."""
    return _logits(q_derope, params).contiguous()


def saap_select_buckets_triton(q_derope: torch.Tensor, params: SaapLayerParams, group: int, top_l: int
                               ) -> torch.Tensor:
    """Classifier + ranking of one decode step: ``[B, Hkv, min(ℓ, C)]`` int32 bucket ids, best first.

    Same buckets as :func:`reference.rank_buckets` on :func:`reference.classify_queries` (up to float32
    rounding at exact near-ties)."""
    return saap_rank_buckets_triton(_logits(q_derope, params), group, top_l)


__all__ = ["saap_classifier_logits_triton", "saap_rank_buckets_triton", "saap_select_buckets_triton"]
