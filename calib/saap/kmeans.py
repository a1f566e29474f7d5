"""SAAP key partition: L2 k-means per (layer, KV head) on de-RoPE'd keys (Mazaré et al., arXiv:2502.08246, §4, App. A).

Two backends run the same algorithm (Faiss's ``Clustering``): subsample to at most
``max_points_per_centroid · C`` points, random init from ``C`` distinct data points, ``iters`` Lloyd
iterations (assign to the nearest centroid, move each centroid to its members' mean), and an empty
cluster takes half of a large one (Faiss's split: copy a centroid chosen with probability
∝ ``size - 1`` and perturb both copies by ``±1/1024`` in alternating dimensions).

* ``faiss``: ``faiss.Kmeans`` (``spherical=False``), on GPU when faiss-gpu sees one; one head at a time.
* ``torch``: the same steps batched over heads (``[H, N, D]`` at once), on CUDA when available; used
  when faiss is missing (the GPU box has none). Random streams differ from Faiss's, so the two backends
  give different (equally valid) centroids for one seed.

Head ``h`` of :func:`fit_kmeans_heads` uses seed ``seed + h`` on both backends.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from runtime_kernels.saap.bucket_index import nearest_centroid

# faiss is imported where used: it is optional (the `cpu` / `gpu` extras); without it the torch backend runs.

log = logging.getLogger(__name__)

_SPLIT_EPS = 1.0 / 1024.0  # Faiss's EPS for empty-cluster splits


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def _resolve_backend(backend: str) -> str:
    if backend not in ("auto", "faiss", "torch"):
        raise ValueError(f"k-means backend must be auto, faiss or torch, got {backend!r}")
    if backend == "auto":
        return "faiss" if faiss_available() else "torch"
    if backend == "faiss" and not faiss_available():
        raise ImportError("k-means backend 'faiss' needs faiss: pip install 'calib[cpu]' (faiss-cpu) or "
                          "'calib[gpu]' (faiss-gpu-cu12), or set method.kmeans.backend=torch")
    return backend


def _check(x: torch.Tensor, c: int) -> None:
    if x.shape[-2] < c:
        raise ValueError(f"k-means with C={c} clusters needs at least {c} points, got {x.shape[-2]}; "
                         f"collect more keys or lower method.clusters")


def fit_kmeans(x: torch.Tensor, C: int, iters: int, seed: int = 0, use_gpu: bool | str = "auto",
               backend: str = "auto", max_points_per_centroid: int = 256) -> torch.Tensor:
    """L2 k-means of ``x: [N, D]`` float32 -> centroids ``[C, D]`` float32 (on ``x.device``)."""
    return fit_kmeans_heads(x.unsqueeze(0), C, iters, seed, use_gpu, backend, max_points_per_centroid)[0]


def fit_kmeans_heads(x: torch.Tensor, C: int, iters: int, seed: int = 0, use_gpu: bool | str = "auto",
                     backend: str = "auto", max_points_per_centroid: int = 256) -> torch.Tensor:
    """One k-means per head: ``x: [H, N, D]`` -> centroids ``[H, C, D]`` float32 (on ``x.device``).

    ``use_gpu``: ``"auto"`` (a GPU when the backend can use one), True or False.
    """
    _check(x, C)
    backend = _resolve_backend(backend)
    if backend == "faiss":
        out = _fit_faiss(x, C, iters, seed, use_gpu, max_points_per_centroid)
    else:
        out = _fit_torch(x, C, iters, seed, use_gpu, max_points_per_centroid)
    return out.to(x.device)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid (L2): ``x [..., N, D]``, ``centroids [..., C, D]`` -> ``[..., N]`` int64.

    The runtime's own function, so calibration and decode assign keys identically.
    """
    return nearest_centroid(x, centroids)


def inertia(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Mean squared distance to the nearest centroid, per head: ``[..., N, D]`` -> ``[...]`` float64."""
    a = assign(x, centroids)
    near = centroids.double().gather(-2, a.unsqueeze(-1).expand(*a.shape, centroids.shape[-1]))
    return ((x.double() - near) ** 2).sum(-1).mean(-1)


# ------------------------------------------------------------------------------------------- faiss
def _fit_faiss(x: torch.Tensor, C: int, iters: int, seed: int, use_gpu: bool | str, mppc: int) -> torch.Tensor:
    import faiss

    gpu = faiss.get_num_gpus() > 0 if use_gpu == "auto" else bool(use_gpu)
    log.info("k-means: faiss %s on %s, %d heads x %d points, C=%d, %d iterations",
             faiss.__version__, "GPU" if gpu else "CPU", x.shape[0], x.shape[1], C, iters)
    out = []
    for h in range(x.shape[0]):
        xh = np.ascontiguousarray(x[h].detach().float().cpu().numpy())
        km = faiss.Kmeans(xh.shape[1], C, niter=iters, seed=seed + h, spherical=False, gpu=gpu,
                          max_points_per_centroid=mppc, verbose=False)
        km.train(xh)
        out.append(torch.from_numpy(km.centroids.copy()))
    return torch.stack(out)


# ------------------------------------------------------------------------------------------- torch
def _fit_torch(x: torch.Tensor, C: int, iters: int, seed: int, use_gpu: bool | str, mppc: int) -> torch.Tensor:
    want_gpu = torch.cuda.is_available() if use_gpu == "auto" else bool(use_gpu)
    device = x.device if x.is_cuda else torch.device("cuda" if want_gpu else "cpu")
    h, n, d = x.shape
    log.info("k-means: torch on %s, %d heads x %d points, C=%d, %d iterations", device, h, n, C, iters)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(h)]
    keep = min(n, C * mppc)
    rows = torch.stack([torch.randperm(n, generator=g)[:keep] if keep < n else torch.arange(n) for g in gens])
    xs = x.detach().float().to(device).gather(1, rows.to(device).unsqueeze(-1).expand(h, keep, d))  # [H, n', D]
    init = torch.stack([torch.randperm(keep, generator=g)[:C] for g in gens]).to(device)  # C distinct points
    cent = xs.gather(1, init.unsqueeze(-1).expand(h, C, d)).clone()  # [H, C, D]
    for _ in range(iters):
        a = nearest_centroid(xs, cent)  # [H, n']
        sums = torch.zeros(h, C, d, device=device).scatter_add_(1, a.unsqueeze(-1).expand(h, keep, d), xs)
        counts = torch.zeros(h, C, device=device).scatter_add_(1, a, torch.ones(h, keep, device=device))
        cent = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), cent)
        if bool((counts == 0).any()):
            _split_empty(cent, counts, gens)
    return cent.cpu()


def _split_empty(cent: torch.Tensor, counts: torch.Tensor, gens: list[torch.Generator]) -> None:
    """Faiss's empty-cluster handling, in place, head by head (rare: only heads with an empty cluster)."""
    h_count, c, d = cent.shape
    sign = torch.where(torch.arange(d, device=cent.device) % 2 == 0, 1.0, -1.0) * _SPLIT_EPS
    for h in torch.nonzero((counts == 0).any(-1)).flatten().tolist():
        cnt = counts[h].tolist()
        n = sum(cnt)
        for ci in range(c):
            if cnt[ci] > 0:
                continue
            cj = 0
            while True:  # pick a cluster with probability (size - 1) / (n - C), cycling like Faiss
                if torch.rand(1, generator=gens[h]).item() < (cnt[cj] - 1) / max(1, n - c):
                    break
                cj = (cj + 1) % c
            cent[h, ci] = cent[h, cj] * (1 + sign)
            cent[h, cj] = cent[h, cj] * (1 - sign)
            cnt[ci] = cnt[cj] // 2
            cnt[cj] -= cnt[ci]
