"""SAAP batched query classifiers: KL goes down, heads are independent, runtime export matches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from calib.saap.classifier import BatchedQueryClassifier, fit_query_classifiers, kl_loss_per_head
from runtime_kernels.saap.reference import classify_queries


def _teacher(hq=3, n=2048, d=8, c=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(hq, n, d, generator=g)
    w = torch.randn(hq, d, c, generator=g) * 1.5
    return x, torch.softmax(torch.relu(x) @ w, -1)  # learnable by the MLP


def test_training_lowers_kl():
    x, t = _teacher()
    model, curve = fit_query_classifiers(x, t, hidden=64, lr=3e-3, steps=200, batch=128, progress=False)
    assert curve.shape == (200, 3)
    with torch.no_grad():
        final = kl_loss_per_head(model(x), t)
    assert (final < 0.25 * curve[:5].mean(0)).all(), (curve[:5].mean(0), final)


def test_batched_equals_per_head_training():
    x, t = _teacher(n=512)
    kw = dict(hidden=32, lr=1e-2, steps=40, batch=64, seed=5, progress=False)
    batched, curve = fit_query_classifiers(x, t, **kw)
    for h in range(3):
        alone, c1 = fit_query_classifiers(x[h:h + 1], t[h:h + 1], head_seeds=[5 + h], **kw)
        for name, p in alone.export_params().items():
            assert torch.allclose(batched.export_params()[name][h], p[0], atol=1e-5, rtol=1e-4), name
        assert torch.allclose(curve[:, h], c1[:, 0], atol=1e-5)


def test_batchnorm_matches_torch():
    model = BatchedQueryClassifier(2, 5, 3, hidden=7, seeds=[0, 1]).train()
    bn = nn.BatchNorm1d(7)
    x = torch.randn(2, 20, 5)
    for _ in range(3):
        model(x)
        h1 = torch.baddbmm(model.b1.unsqueeze(1), x, model.w1)[1]
        bn.train()(h1.detach())  # same pre-activations as head 1
    assert torch.allclose(model.bn_mean[1], bn.running_mean, atol=1e-6)
    assert torch.allclose(model.bn_var[1], bn.running_var, atol=1e-6)


def test_runtime_classifier_equals_eval_mode():
    x, t = _teacher(n=256)
    model, _ = fit_query_classifiers(x, t, hidden=16, steps=20, batch=64, progress=False)
    params = model.layer_params(torch.randn(1, 6, 8), sink=1, recent=7)  # 3 heads, 1 KV head
    q = torch.randn(5, 3, 8)  # [B, Hq, D]
    with torch.no_grad():
        expect = torch.softmax(model.eval()(q.transpose(0, 1)), -1).transpose(0, 1)
    assert torch.allclose(classify_queries(q, params), expect, atol=1e-6)


def test_batches_from_one_prompt_and_on_step():
    x, t = _teacher(n=300)
    prompt = torch.arange(300) // 100
    seen = []
    fit_query_classifiers(x, t, hidden=8, steps=5, batch=50, prompt_index=prompt, progress=False,
                          on_step=lambda s, loss: seen.append((s, loss.shape)))
    assert seen == [(s, (3,)) for s in range(5)]
    from calib.saap.classifier import _batch_rows
    rows = _batch_rows(torch.Generator().manual_seed(0), 300, 50, prompt)
    assert rows.numel() == 50 and prompt[rows].unique().numel() == 1


def test_loss_with_precomputed_entropy_equals_kl_in_float64():
    """The training loop's KL (constant term precomputed per row) against a float64 sum over buckets."""
    from calib.saap.classifier import target_neg_entropy

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, 7, generator=g)
    t = torch.softmax(torch.randn(3, 40, 7, generator=g) * 2, -1)
    t[0, 0] = torch.tensor([1.0, 0, 0, 0, 0, 0, 0])  # zero targets: 0·log 0 = 0
    lq, td = torch.log_softmax(logits.double(), -1), t.double()
    expect = torch.where(td > 0, td * (td.clamp(min=1e-300).log() - lq), 0.0).sum(-1).mean(-1)
    neg_h = target_neg_entropy(t, chunk=16)
    assert neg_h.shape == (3, 40)
    torch.testing.assert_close(kl_loss_per_head(logits, t, neg_h).double(), expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl_loss_per_head(logits, t).double(), expect, rtol=1e-5, atol=1e-6)


def test_a_kv_head_classifier_fits_the_teacher_of_its_own_query_heads():
    """``group=2`` over 4 query heads: classifier 0 trains on heads 0-1 (teacher A), classifier 1 on heads
    2-3 (teacher B); each fits its own group's teacher, not the other's, and the runtime applies it to
    each of its query heads."""
    xa, ta = _teacher(hq=1, n=1024, seed=1)
    xb, tb = _teacher(hq=1, n=1024, seed=2)
    x, t = torch.cat([xa, xa, xb, xb]), torch.cat([ta, ta, tb, tb])  # [4, N, ·]
    model, curve = fit_query_classifiers(x, t, hidden=64, lr=3e-3, steps=200, batch=64, group=2, progress=False)
    assert model.w1.shape[0] == 2 and curve.shape == (200, 2)
    with torch.no_grad():
        own = kl_loss_per_head(model(torch.cat([xa, xb])), torch.cat([ta, tb]))
        crossed = kl_loss_per_head(model(torch.cat([xb, xa])), torch.cat([tb, ta]))
    assert (own < 0.25 * curve[:5].mean(0)).all() and (crossed > 4 * own).all(), (own, crossed)
    params = model.layer_params(torch.randn(2, 6, 8), sink=1, recent=7)  # 2 KV heads of 2 query heads
    q = torch.stack([xa[0, :5], xa[0, :5], xb[0, :5], xb[0, :5]], 1)  # [B, Hq, D]
    probs = classify_queries(q, params)
    assert torch.allclose(probs[:, 0], probs[:, 1]) and torch.allclose(probs[:, 2], probs[:, 3])
    with torch.no_grad():
        expect = torch.softmax(model.eval()(torch.stack([xa[0, :5], xb[0, :5]])), -1)  # [2, B, C]
    assert torch.allclose(probs[:, 0], expect[0], atol=1e-6) and torch.allclose(probs[:, 2], expect[1], atol=1e-6)


def test_group_must_divide_the_query_heads():
    x, t = _teacher(hq=3, n=64)
    with pytest.raises(ValueError, match="group must divide the 3 query heads"):
        fit_query_classifiers(x, t, steps=1, group=2, progress=False)
