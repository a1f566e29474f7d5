"""SAAP's per-layer checkpoints (:mod:`calib.checkpoint`): k-means, targets and classifiers.

Each stage's per-layer result is a flat tensor dict, so a run killed in the middle of a stage and
started again with the same config loads the finished layers and computes only the rest:

* ``kmeans``: ``centroids [Hkv, C, D]``, ``rope_centroids [Hkv, C, D]`` (method.report=full only), ``imbalance []`` (float64);
* ``targets``: the layer's :class:`calib.saap.recipe.TrainingRows`, one tensor per prompt and field
  (``x.<i>``, ``targets.<i>``, ...) plus ``prompt [P]``; the second pass runs only over the layers
  without a file (every layer's rows depend on its own centroids and sampling seed alone);
* ``classifier``: the layer's :class:`SaapLayerParams` tensors (``params.<field>``) and its loss
  curve ``curve [steps, Hc]`` (one column per classifier).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from calib.checkpoint import StageCheckpoints, stage_checkpoints
from calib.config import to_container
from calib.data import dataset_hash
from runtime_kernels.saap.reference import SaapLayerParams

_ROW_FIELDS = ("x", "targets", "long_range", "answer", "positions")


def saap_checkpoints(cfg: Any, model_hash: str | None, prompts: Sequence[Any]) -> StageCheckpoints:
    """The checkpoints of this SAAP calibration: keyed by the resolved config, model and prompt set."""
    return stage_checkpoints("saap", to_container(cfg), model_hash=model_hash, data_hash=dataset_hash(prompts))


def rows_to_tensors(rows: Any) -> dict[str, torch.Tensor]:
    """A :class:`TrainingRows` as ``{<field>.<i>: tensor, prompt: [P] int64}``."""
    out = {f"{name}.{i}": t for name in _ROW_FIELDS for i, t in enumerate(getattr(rows, name))}
    out["prompt"] = torch.tensor(rows.prompt, dtype=torch.int64)
    return out


def rows_from_tensors(tensors: dict[str, torch.Tensor], rows_type: type) -> Any:
    """Inverse of :func:`rows_to_tensors` (``rows_type``: :class:`calib.saap.recipe.TrainingRows`)."""
    n = int(tensors["prompt"].numel())
    fields = {name: [tensors[f"{name}.{i}"] for i in range(n) if f"{name}.{i}" in tensors] for name in _ROW_FIELDS}
    return rows_type(prompt=[int(p) for p in tensors["prompt"].tolist()], **fields)


def checkpointed_rows(ckpt: StageCheckpoints, layers: list[int], compute: Callable[[list[int]], dict[int, Any]],
                      rows_type: type) -> dict[int, Any]:
    """Every layer's training rows: saved ones loaded, ``compute(missing layers)`` for the rest (then saved)."""
    rows: dict[int, Any] = {}
    for layer in layers:
        saved = ckpt.load("targets", layer)
        if saved is not None:
            rows[layer] = rows_from_tensors(saved, rows_type)
    missing = [l for l in layers if l not in rows]
    if missing:
        t0 = time.perf_counter()
        computed = compute(missing)  # one pass over the prompts for every missing layer: its time split evenly
        share = (time.perf_counter() - t0) / len(missing)
        for layer, fresh in computed.items():
            rows[layer] = rows_from_tensors(ckpt.save("targets", layer, rows_to_tensors(fresh), seconds=share), rows_type)
    return {l: rows[l] for l in layers}


def classifier_to_tensors(params: SaapLayerParams, curve: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's runtime record and loss curve ``[steps, Hc]`` as one flat tensor dict."""
    return {**params.to_tensors(prefix="params."), "curve": curve,
            "bn_eps": torch.tensor(params.bn_eps, dtype=torch.float64)}


def classifier_from_tensors(tensors: dict[str, torch.Tensor], *, sink: int,
                            recent: int) -> tuple[SaapLayerParams, torch.Tensor]:
    """Inverse of :func:`classifier_to_tensors`."""
    params = SaapLayerParams.from_tensors(tensors, sink=sink, recent=recent, bn_eps=float(tensors["bn_eps"]),
                                          prefix="params.")
    return params, tensors["curve"]

