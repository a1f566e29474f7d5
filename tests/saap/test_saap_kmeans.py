"""SAAP k-means: both backends beat their random init and assign to the true nearest centroid;
de-RoPE'd keys get the same bucket wherever they sit in the prompt."""

from __future__ import annotations

import pytest
import torch

from calib.saap.kmeans import _split_empty, assign, faiss_available, fit_kmeans, fit_kmeans_heads, inertia
from runtime_kernels.saap.bucket_index import BucketIndex
from tests.saap.saap_synth import derope, rope, rope_cos_sin

BACKENDS = ["torch", pytest.param("faiss", marks=pytest.mark.skipif(not faiss_available(), reason="no faiss"))]


def _blobs(h=2, n=3000, d=8, k=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(h, k, d, generator=g) * 4
    lab = torch.randint(k, (h, n), generator=g)
    return centres.gather(1, lab.unsqueeze(-1).expand(-1, -1, d)) + torch.randn(h, n, d, generator=g)


def _brute_ok(x, cents, a):
    """The assigned centroid is a nearest one (float64, ties allowed)."""
    d2 = ((x.double().unsqueeze(-2) - cents.double().unsqueeze(-3)) ** 2).sum(-1)  # [H, N, C]
    got = d2.gather(-1, a.unsqueeze(-1)).squeeze(-1)
    return bool((got <= d2.min(-1).values * (1 + 1e-6) + 1e-9).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_kmeans_beats_random_and_assigns_nearest(backend):
    x = _blobs()
    c = fit_kmeans_heads(x, 16, iters=10, seed=3, backend=backend, use_gpu=False)
    assert c.shape == (2, 16, 8) and c.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    rand = torch.stack([x[h, torch.randperm(x.shape[1], generator=g)[:16]] for h in range(2)])  # random points
    assert (inertia(x, c) < 0.8 * inertia(x, rand)).all()
    assert _brute_ok(x, c, assign(x, c))
    single = fit_kmeans(x[0], 16, iters=10, seed=3, backend=backend, use_gpu=False)
    assert single.shape == (16, 8)


def test_torch_heads_equal_single_head_runs():
    x = _blobs(h=3, n=1000)
    batched = fit_kmeans_heads(x, 8, iters=5, seed=7, backend="torch", use_gpu=False)
    for h in range(3):
        alone = fit_kmeans(x[h], 8, iters=5, seed=7 + h, backend="torch", use_gpu=False)
        assert torch.allclose(batched[h], alone, atol=1e-5)


def test_torch_subsamples_like_faiss():
    x = _blobs(h=1, n=3000)
    c = fit_kmeans_heads(x, 4, iters=3, seed=0, backend="torch", use_gpu=False, max_points_per_centroid=10)
    assert torch.isfinite(c).all()


def test_empty_clusters_are_split():
    # 3 distinct points repeated: duplicated inits leave clusters empty until split; must end exact
    pts = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = pts.repeat_interleave(50, 0).unsqueeze(0)  # [1, 150, 2]
    c = fit_kmeans_heads(x, 3, iters=25, seed=0, backend="torch", use_gpu=False)
    assert inertia(x, c).item() < 1e-6
    cent = torch.tensor([[[1.0, 2.0], [5.0, 5.0], [0.0, 0.0]]])
    counts = torch.tensor([[10.0, 6.0, 0.0]])
    _split_empty(cent, counts, [torch.Generator().manual_seed(0)])
    assert not torch.equal(cent[0, 2], torch.zeros(2))  # took a copy of a non-empty centroid
    assert torch.allclose(cent[0, 2], cent[0, 0], rtol=2e-3) or torch.allclose(cent[0, 2], cent[0, 1], rtol=2e-3)


def test_too_few_points_and_bad_backend():
    with pytest.raises(ValueError, match="at least 16 points"):
        fit_kmeans(torch.randn(10, 4), 16, iters=2)
    with pytest.raises(ValueError, match="backend"):
        fit_kmeans(torch.randn(100, 4), 4, iters=2, backend="sklearn")


def test_derope_assignment_is_position_invariant_and_matches_runtime():
    """The same pre-RoPE key at many positions: de-RoPE'd it always gets one bucket; RoPE'd it does not."""
    t, d = 600, 16
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, d, generator=g) * 2
    k_pre = base[torch.arange(t) % 40].unsqueeze(0)  # [1, T, D]: each of 40 keys repeated at 15 positions
    cos, sin = rope_cos_sin(t, d)
    k_rope = rope(k_pre, cos, sin)
    k_de = derope(k_rope, cos, sin)
    assert torch.allclose(k_de, k_pre, atol=1e-5)
    cents = fit_kmeans_heads(k_de, 8, iters=10, seed=0, backend="torch", use_gpu=False)
    a = assign(k_de, cents)[0].view(15, 40)  # [repeat, key]
    assert (a == a[0]).all()
    rope_cents = fit_kmeans_heads(k_rope, 8, iters=10, seed=0, backend="torch", use_gpu=False)
    ar = assign(k_rope, rope_cents)[0].view(15, 40)
    assert not (ar == ar[0]).all()  # RoPE'd keys drift across buckets with position (the paper's point)
    idx = BucketIndex.build(k_de.unsqueeze(0), cents, sink=1, recent=8)
    assert torch.equal(idx.key_bucket[0, 0, 1:].long(), assign(k_de, cents)[0, 1:])
