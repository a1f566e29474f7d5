"""SAAP's first stage per layer (Mazaré et al., arXiv:2502.08246, §4, App. A): the bucket candidates' keys of the
collected prompts, one k-means per KV head on the de-RoPE'd keys, the balance of the result.

Split out of :mod:`calib.saap.recipe`, which calls :func:`kmeans_layer` per layer (checkpointed)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from calib.errors import UserError
from calib.saap.kmeans import assign, fit_kmeans_heads

if TYPE_CHECKING:
    from calib.saap.recipe import Settings

log = logging.getLogger("calib.saap.recipe")


def candidate_keys(collected: Any, layer: int, sink: int, recent: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per KV head the sampled bucket candidates ``[sink, T - recent)`` of every prompt.

    Returns ``(de-RoPE'd [N_h, D] per head, RoPE'd [N_h, D] per head)`` float32 (``N_h`` may differ).
    """
    lengths = [int(n) for n in collected.meta["prompt_lengths"]]
    derope: list[list[torch.Tensor]] = []
    rope: list[list[torch.Tensor]] = []
    for i, shard in enumerate(collected.iter_layer(layer, ("k_pos", "k_pre", "k_post"))):
        keep = (shard["k_pos"] >= sink) & (shard["k_pos"] < lengths[i] - recent)  # [Hkv, n]
        if not derope:
            derope, rope = [[] for _ in range(keep.shape[0])], [[] for _ in range(keep.shape[0])]
        for h in range(keep.shape[0]):
            derope[h].append(shard["k_pre"][h][keep[h]].float())
            rope[h].append(shard["k_post"][h][keep[h]].float())
    return [torch.cat(x) for x in derope], [torch.cat(x) for x in rope]


def fit_heads(points: list[torch.Tensor], s: "Settings", seed: int, device: torch.device) -> torch.Tensor:
    """One k-means per head (seed ``seed + h``): ``points[h] [N_h, D]`` -> centroids ``[H, C, D]`` (CPU)."""
    out = []
    for h, x in enumerate(points):
        if x.shape[0] < s.clusters:
            raise UserError(f"k-means with method.clusters={s.clusters} needs at least that many keys outside the "
                            f"sink and window per KV head, got {x.shape[0]}: raise method.prompts, use longer "
                            f"prompts or lower method.clusters")
        x = x.to(device) if device.type == "cuda" else x
        cent = fit_kmeans_heads(x[None], s.clusters, s.iterations, seed=seed + h, use_gpu=s.kmeans_use_gpu,
                                backend=s.kmeans_backend, max_points_per_centroid=s.max_points_per_centroid)
        out.append(cent[0].cpu())  # [C, D]
    return torch.stack(out)


def imbalance(points: list[torch.Tensor], centroids: torch.Tensor) -> float:
    """Mean over heads of the imbalance factor ``C·Σn²/(Σn)²`` (1 = perfectly balanced buckets)."""
    vals = []
    for h, x in enumerate(points):
        n = torch.bincount(assign(x, centroids[h]), minlength=centroids.shape[1]).double()
        vals.append(float(centroids.shape[1] * (n * n).sum() / n.sum() ** 2))
    return sum(vals) / len(vals)


def kmeans_layer(collected: Any, layer: int, s: "Settings", seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One layer's k-means: ``centroids [Hkv, C, D]``, ``imbalance []`` (float64) and, for the full report
    only, ``rope_centroids [Hkv, C, D]`` (the k-means-on-RoPE'd-keys baseline)."""
    derope_pts, rope_pts = candidate_keys(collected, layer, s.sink, s.recent)
    centroids = fit_heads(derope_pts, s, seed, device)
    balance = imbalance(derope_pts, centroids)
    log.info("saap: layer %d k-means on %s keys per KV head, imbalance %.3f", layer,
             [int(x.shape[0]) for x in derope_pts], balance)
    out = {"centroids": centroids, "imbalance": torch.tensor(balance, dtype=torch.float64)}
    if s.full_report:
        out["rope_centroids"] = fit_heads(rope_pts, s, seed, device)
    return out
