"""SAAP on CUDA: the reference and the torch k-means run on GPU tensors and agree with CPU."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels.saap import BucketIndex, saap_decode_attention_reference
from tests.runtime.saap.test_saap_reference import _case

pytestmark = pytest.mark.gpu


def test_reference_on_cuda_matches_cpu():
    q, qd, k, kd, v, params, idx = _case(2, 8, 2, 500, 32, 16, sink=1, recent=31)
    cpu = saap_decode_attention_reference(q, qd, k, v, idx, params, top_l=4)
    dev = "cuda"
    p2 = params.to(dev)
    idx2 = BucketIndex.build(kd[:, :, :400].to(dev), p2.centroids, sink=1, recent=31)
    for t in range(400, 500):
        idx2.append(kd[:, :, t:t + 1].to(dev))
    out = saap_decode_attention_reference(q.to(dev), qd.to(dev), k.to(dev), v.to(dev), idx2, p2, top_l=4)
    assert torch.allclose(out.cpu(), cpu, atol=1e-4, rtol=1e-4)
    assert torch.equal(idx2.csr()[1].cpu(), idx.csr()[1])


def test_torch_kmeans_on_cuda():
    from calib.saap.kmeans import fit_kmeans_heads, inertia

    x = torch.randn(2, 5000, 16)
    c = fit_kmeans_heads(x.cuda(), 32, iters=10, backend="torch", use_gpu=True)
    assert c.is_cuda and c.shape == (2, 32, 16)
    rand = x[:, :32]
    assert (inertia(x, c.cpu()) < inertia(x, rand)).all()
