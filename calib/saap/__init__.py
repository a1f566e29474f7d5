"""SAAP calibration (Mazaré et al., arXiv:2502.08246; docs/methods.md, SAAP): the math, free of I/O and tracking.

* :mod:`calib.saap.kmeans`: per-KV-head L2 k-means on de-RoPE'd keys (Faiss, or a torch fallback).
* :mod:`calib.saap.targets`: long-range query selection and the KL targets ``A·H_k`` of one prompt.
* :mod:`calib.saap.classifier`: the per-query-head MLP classifiers, trained batched over heads.
* :mod:`calib.saap.metrics`: selectivity / recall / output error of SAAP vs the paper's baselines.

The runtime side (bucket index, decode attention) is :mod:`runtime_kernels.saap`; the pipeline is
:mod:`calib.saap.recipe`. Per non-dense layer (layer 0 stays dense), with ``W = window``,
``recent = W - sink``:

1. de-RoPE'd keys of positions ``[sink, T - recent)`` -> :func:`fit_kmeans_heads` ``[Hkv, C, D]``;
2. per prompt while its q/k are in memory: ``kb = assign(k_derope, centroids)``, then
   :func:`prompt_training_rows` (:func:`select_training_queries`, :func:`kl_targets`, and the decode
   positions of a teacher-forced answer) keeps ``q_derope`` and ``targets`` at the chosen positions;
   held-out prompts: :func:`evaluate_layer`;
3. :func:`fit_query_classifiers` on the kept rows, then ``model.layer_params(centroids, sink=...,
   recent=...)`` is the runtime's ``SaapLayerParams``.
"""

from calib.saap.classifier import BatchedQueryClassifier, fit_query_classifiers, kl_loss_per_head
from calib.saap.kmeans import assign, faiss_available, fit_kmeans, fit_kmeans_heads, inertia
from calib.saap.metrics import (
    LayerEvaluation,
    attention_recall,
    eval_query_positions,
    evaluate_layer,
    output_relative_error,
    probe_top_l_by_inner_product,
    recall_at_selectivity,
    selectivity,
)
from calib.saap.targets import (
    PromptRows,
    answer_query_positions,
    kl_targets,
    long_range_query_mask,
    prompt_training_rows,
    sample_queries,
    select_training_queries,
    top1_key_distance,
)

__all__ = [
    "BatchedQueryClassifier",
    "LayerEvaluation",
    "PromptRows",
    "answer_query_positions",
    "assign",
    "attention_recall",
    "eval_query_positions",
    "evaluate_layer",
    "faiss_available",
    "fit_kmeans",
    "fit_kmeans_heads",
    "fit_query_classifiers",
    "inertia",
    "kl_loss_per_head",
    "kl_targets",
    "long_range_query_mask",
    "output_relative_error",
    "probe_top_l_by_inner_product",
    "prompt_training_rows",
    "recall_at_selectivity",
    "sample_queries",
    "select_training_queries",
    "selectivity",
    "top1_key_distance",
]
