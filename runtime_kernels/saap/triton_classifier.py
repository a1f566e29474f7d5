"""SAAP's per-step bucket selection in Triton (Mazaré et al., arXiv:2502.08246, §4, App. F):
the query classifier MLP of every query head or KV head (``q_derope @ w1 + b1``, eval batch-norm, ReLU,
``@ w2 + b2``), then the top-ℓ buckets of each KV head (:mod:`runtime_kernels.saap.triton_rank`), on the
GPU without a host sync.

The classifier path is chosen by rows per classifier (B, or B·G for a classifier per KV head):
``<= CONFIG.small_batch_max_b`` (32: a classifier per KV head at B = 8) takes
:mod:`~runtime_kernels.saap.triton_classifier_small_batch` (layer 1 writing three-term hidden, layer 2
one pass over w2), larger batches :mod:`~runtime_kernels.saap.triton_classifier_large_batch` (two
tensor-core launches on four-term activations). Both give float32-exact logits from 16-bit weights, and
both can take the RoPE'd query with its position's de-RoPE coefficients and de-RoPE it as they load it.
"""

from __future__ import annotations

import torch

from runtime_kernels.saap import triton_config as _tc
from runtime_kernels.saap.reference import SaapLayerParams
from runtime_kernels.saap.triton_classifier_large_batch import large_batch_logits
from runtime_kernels.saap.triton_classifier_small_batch import small_batch_logits
from runtime_kernels.saap.triton_rank import saap_rank_buckets_triton


def _logits(x: torch.Tensor, params: SaapLayerParams, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """The classifier path of this many rows (logits ``[B, Hq, C]`` float32, possibly a strided view) of
    ``x [B, Hq, D]``: the de-RoPE'd query, or the RoPE'd one with its de-RoPE coefficients ``rotation
    [B, 2, D]`` (applied as layer 1 loads it). Classifiers shared by a KV head's query heads see the
    group's queries as batch rows (:func:`reference.classifier_rows`, indexed in place): each
    classifier's weights are read once for all of them."""
    if params.w1.device != x.device:
        raise ValueError(f"classifier weights on {params.w1.device}, query on {x.device}")
    b, hq, d = x.shape
    if hq % params.num_classifiers:
        raise ValueError(f"{hq} query heads do not split over {params.num_classifiers} classifiers")
    if rotation is not None and (rotation.shape != (b, 2, d) or rotation.dtype != torch.float32 or d % 2):
        raise ValueError(f"query_rotation must be [B, 2, D] = {(b, 2, d)} float32 (D even), got "
                         f"{tuple(rotation.shape)} {rotation.dtype}")
    if b * (hq // params.num_classifiers) <= _tc.CONFIG.small_batch_max_b:
        return small_batch_logits(x, params, rotation)
    return large_batch_logits(x, params, rotation)


def saap_classifier_logits_triton(q_derope: torch.Tensor, params: SaapLayerParams,
                                  rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier logits of every query head: ``q_derope [B, Hq, D]`` -> ``[B, Hq, C]`` float32. With
    ``rotation`` (:func:`runtime_kernels.rope.derope_coefficients`), the first argument is the RoPE'd query.

    ``softmax(-1)`` of the result is :func:`reference.classify_queries` (to float32 rounding) of the
    de-RoPE'd query (:func:`reference.classifier_input` with ``rotation``)."""
    return _logits(q_derope, params, rotation).contiguous()


def saap_select_buckets_triton(q_derope: torch.Tensor, params: SaapLayerParams, group: int, top_l: int,
                               rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier + ranking of one decode step: ``[B, Hkv, min(ℓ, C)]`` int32 bucket ids, best first
    (``rotation``: as :func:`saap_classifier_logits_triton`).

    Same buckets as :func:`reference.rank_buckets` on :func:`reference.classify_queries` (up to float32
    rounding at exact near-ties)."""
    return saap_rank_buckets_triton(_logits(q_derope, params, rotation), group, top_l)


__all__ = ["saap_classifier_logits_triton", "saap_rank_buckets_triton", "saap_select_buckets_triton"]
