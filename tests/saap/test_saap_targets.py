"""SAAP KL targets and long-range query selection against float64 brute force."""

from __future__ import annotations

import math

import pytest
import torch

from calib.saap.targets import (
    kl_targets,
    long_range_query_mask,
    sample_queries,
    select_training_queries,
    top1_key_distance,
)


def _qk(hq=4, hkv=2, t=60, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, t, d, generator=g), torch.randn(hkv, t, d, generator=g) * 2


def _brute_targets(q, k, kb, qidx, c, causal, sink):
    hq, t, d = q.shape
    g = hq // k.shape[0]
    out = torch.zeros(hq, qidx.shape[-1], c, dtype=torch.float64)
    for h in range(hq):
        for n, i in enumerate(qidx[h].tolist()):
            hi = i + 1 if causal else t
            s = torch.tensor([q[h, i].double() @ k[h // g, j].double() / math.sqrt(d) for j in range(sink, hi)])
            p = torch.softmax(s, 0)
            for j, pj in zip(range(sink, hi), p):
                out[h, n, kb[h // g, j]] += pj
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_kl_targets_brute_force_and_rows_sum_to_one(causal, per_head):
    q, k = _qk()
    kb = torch.randint(5, (2, 60), generator=torch.Generator().manual_seed(1))
    kb[:, 0] = -1  # the sink's value must not matter
    qidx = torch.randint(1, 60, (4, 7)) if per_head else torch.randint(1, 60, (7,))
    tgt = kl_targets(q, k, kb, qidx, 5, causal=causal, sink=1, chunk=3)
    assert tgt.shape == (4, 7, 5)
    assert torch.allclose(tgt.sum(-1), torch.ones(4, 7), atol=1e-5)
    assert (tgt >= 0).all()
    expect = _brute_targets(q, k, kb, qidx.expand(4, -1), 5, causal, 1)
    assert torch.allclose(tgt.double(), expect, atol=1e-5)


def test_sink_is_excluded():
    q, k = _qk()
    kb = torch.randint(5, (2, 60))
    qidx = torch.arange(10, 20)
    a = kl_targets(q, k, kb, qidx, 5, sink=2)
    k2 = k.clone()
    k2[:, :2] *= 100  # a huge sink would dominate if it were counted
    assert torch.allclose(a, kl_targets(q, k2, kb, qidx, 5, sink=2), atol=1e-6)


def test_causal_needs_a_key():
    q, k = _qk()
    with pytest.raises(ValueError, match="sink"):
        kl_targets(q, k, torch.zeros(2, 60, dtype=torch.long), torch.tensor([0, 5]), 3, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_top1_distance_brute_force(causal):
    q, k = _qk(t=50)
    dist = top1_key_distance(q, k, sink=1, causal=causal, chunk=7)
    for h in range(4):
        for i in range(50):
            hi = i + 1 if causal else 50
            if hi <= 1:
                assert dist[h, i] == -1
                continue
            s = torch.stack([q[h, i].double() @ k[h // 2, j].double() for j in range(1, hi)])
            assert dist[h, i] == i - (int(s.argmax()) + 1)
    assert torch.equal(long_range_query_mask(q, k, 10, causal=causal, chunk=7), dist > 10)


def test_long_range_hand_case():
    # one KV head, keys = basis vectors; query i points at key 1 (far) or at itself (local)
    t, d = 40, 40
    k = torch.eye(d)[:t].unsqueeze(0) * 5
    q = torch.zeros(1, t, d)
    q[0, :20] = k[0, torch.arange(20)]  # queries 0..19 look at themselves: distance 0
    q[0, 20:] = k[0, 1]  # queries 20..39 look at key 1: distance i - 1
    mask = long_range_query_mask(q, k, 25)
    assert mask[0].nonzero().flatten().tolist() == list(range(27, 40))


def test_sample_queries_prefers_long_range():
    dist = torch.tensor([[0, 5, 50, 60, 2, 70, 1, 3], [0, 1, 2, 3, 4, 5, 6, 7]])
    pos, is_lr = sample_queries(dist, long_range=10, n=4, generator=torch.Generator().manual_seed(0))
    assert set(pos[0].tolist()) >= {2, 3, 5} and is_lr[0].sum() == 3
    assert set(pos[1].tolist()) == {4, 5, 6, 7} and is_lr[1].sum() == 0  # filled by largest distance
    with pytest.raises(ValueError, match="cannot sample"):
        sample_queries(dist, 10, 8)  # 8 columns, min position 1


def test_top1_distance_at_positions():
    q, k = _qk(t=50)
    pos = torch.tensor([3, 17, 49])
    assert torch.equal(top1_key_distance(q, k, positions=pos), top1_key_distance(q, k)[:, pos])


def test_top1_distance_at_unsorted_positions_in_small_chunks():
    """Each chunk scores only the keys up to its latest query: unsorted chunks against float64 brute force."""
    q, k = _qk(t=50)
    pos = torch.tensor([49, 3, 30, 2, 17, 44, 9])
    dist = top1_key_distance(q, k, positions=pos, sink=1, causal=True, chunk=2)
    for h in range(4):
        for n, i in enumerate(pos.tolist()):
            s = torch.stack([q[h, i].double() @ k[h // 2, j].double() for j in range(1, i + 1)])
            assert dist[h, n] == i - (int(s.argmax()) + 1)


def test_select_training_queries_from_candidates():
    # long-range hand case: queries >= 20 look at key 1
    t, d = 64, 64
    k = torch.eye(d)[:t].unsqueeze(0) * 5
    q = k.clone()
    q[0, 20:] = k[0, 1]
    pos, is_lr = select_training_queries(q, k, 8, long_range=10, candidates=30,
                                         generator=torch.Generator().manual_seed(0))
    assert pos.shape == (1, 8) and is_lr.all()
    assert (pos > 11).all() and (pos >= 20).all()
