"""The SAAP artifact's manifest fields and tensors from a finished calibration (split out of
:mod:`calib.saap.recipe`, which calls :func:`method_output` at its end).

The classifier weights ``w1, w2`` are stored in the calibrated model's dtype when it is 16-bit (the
rest, small, stays float32): the runtime serves them in the model's dtype anyway
(:meth:`runtime_kernels.saap.SaapDecode._params`), so a bf16 model's artifact loses nothing at serving
and takes half the bytes. A float32 model keeps float32 weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from omegaconf import DictConfig

from calib.data import dataset_hash
from calib.run import MethodOutput
from calib.saap.kmeans import faiss_available
from runtime_kernels.manifest import DataRecord
from runtime_kernels.saap.reference import SaapLayerParams

if TYPE_CHECKING:
    from calib.saap.recipe import Settings


def hyperparameters(s: "Settings", keys: int, calib_lengths: list[int], eval_length: int,
                    bn_eps: float) -> dict[str, Any]:
    """The manifest's hyperparameters: what the runtime reads plus every calibration setting."""
    backend = s.kmeans_backend if s.kmeans_backend != "auto" else ("faiss" if faiss_available() else "torch")
    return {"clusters": s.clusters, "iterations": s.iterations, "window": s.window, "sink": s.sink,
            "recent": s.recent, "long_range": s.long_range, "top_l": s.top_l,
            "top_l_layers": {str(k): v for k, v in sorted(s.top_l_layers.items())}, "top_ls": s.evaluated_ls,
            "dense_layers": sorted(set(s.dense_layers)), "bn_eps": bn_eps, "causal_targets": s.causal_targets,
            "kmeans": {"backend": backend, "use_gpu": s.kmeans_use_gpu,
                       "max_points_per_centroid": s.max_points_per_centroid, "keys_per_prompt": keys,
                       "excluded": "sink and the final window (positions < sink or >= T - recent)"},
            "classifier": {"hidden": s.hidden, "lr": s.lr, "steps": s.steps, "batch": s.batch,
                           "queries_per_prompt": s.queries_per_prompt, "query_candidates": s.query_candidates,
                           "seed": s.classifier_seed, "heads": s.classifier_heads,
                           "teacher_forced_answer": s.teacher_forced_answer,
                           "optimizer": "adam", "batch_norm": True, "loss": "KL(A·H_k || softmax f_q(q))"},
            "prompts": s.prompts, "calib_lengths": calib_lengths, "eval_length": eval_length,
            "eval_prompts": s.eval_prompts, "report": s.report,
            "baseline_probe": s.baseline_probe if s.full_report else None, "oracle": s.oracle and s.full_report}


def artifact_weight_dtype(model: Any) -> torch.dtype:
    """The dtype the artifact stores ``w1, w2`` in: the model's when 16-bit, else float32."""
    dtype = getattr(model, "dtype", torch.float32)
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def method_output(cfg: DictConfig, s: "Settings", loaded: Any, params: dict[int, SaapLayerParams],
                  prompts: Sequence[Any], held_out: Sequence[Any], calib_lengths: list[int], metrics: dict[str, Any],
                  payload: dict[str, Any], keys: int) -> MethodOutput:
    """The :class:`calib.run.MethodOutput`: per-layer tensors, hyperparameters, data record, metrics."""
    weight_dtype = artifact_weight_dtype(loaded.model)
    tensors = {f"layer_{l}": p.to("cpu", weight_dtype=weight_dtype).to_tensors(prefix=f"layers.{l}.")
               for l, p in sorted(params.items())}
    data = DataRecord(source=str(cfg.data.get("source", "synthetic")), seed=int(cfg.data.seed), count=len(prompts),
                      lengths=sorted({int(p.length) for p in prompts}), content_hash=dataset_hash(prompts),
                      tasks=sorted({str(p.task) for p in prompts}),
                      details={"prompt_ids": [p.prompt_id for p in prompts],
                               "tokens": [len(p.input_ids) for p in prompts], "heldout_seed": int(cfg.eval.seed),
                               "heldout_prompt_ids": [p.prompt_id for p in held_out],
                               "heldout_hash": dataset_hash(held_out)})
    hyper = hyperparameters(s, keys, calib_lengths, payload["eval_length"], next(iter(params.values())).bn_eps)
    return MethodOutput(tensors=tensors, hyperparameters=hyper,
                        model=loaded.facts.to_dict(), data=data, metrics=metrics, payload=payload)
