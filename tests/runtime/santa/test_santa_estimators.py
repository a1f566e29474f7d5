"""SANTA / S²ANTA prefill estimators: hand-worked draws and statistical properties (docs/methods.md, SANTA / S²ANTA).

Statistical checks stack R seeds along the batch axis (one call, R independent draws per row) and use
fixed generator seeds, so they are deterministic. Targets are computed here in float64 from the
definitions (softmax, App. A.2 covariance, App. A.5 stratum covariances), never from the code under
test.
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.santa import exact_attention, per_row_sample_counts, santa_attention
from runtime_kernels.santa.reference import inverse_cdf

F64 = torch.float64


def _problem(seed: int, b=1, hq=2, hkv=1, tq=4, tk=6, d=3, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=F64) * sharp
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=F64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=F64)
    return q, k, v


def _repeat(x: torch.Tensor, r: int) -> torch.Tensor:
    return x.expand(r, *x.shape[1:]).contiguous()


def _draws(q, k, v, s, estimator, r, seed):
    """R independent estimates of the same problem: [R, Hq, Tq, D]."""
    g = torch.Generator().manual_seed(seed)
    return santa_attention(_repeat(q, r), _repeat(k, r), _repeat(v, r), s, estimator=estimator, generator=g)


def _softmax_rows(q, k, causal=True):
    """Exact probabilities [Hq, Tq, Tk] (batch 0, GQA by head // group), straight from the definition."""
    hq, tq, d = q.shape[1], q.shape[2], q.shape[3]
    tk, group = k.shape[2], q.shape[1] // k.shape[1]
    p = torch.empty(hq, tq, tk, dtype=F64)
    for h in range(hq):
        s = q[0, h] @ k[0, h // group].T / math.sqrt(d)  # [Tq, Tk]
        if causal:
            pos = torch.arange(tk - tq, tk)
            s = s.masked_fill(torch.arange(tk)[None, :] > pos[:, None], float("-inf"))
        p[h] = torch.softmax(s, dim=-1)
    return p


def _iid_mse(p, v, s, group):
    """App. A.2: E‖Ô − AV‖² = tr(Σ_q) / S per row, summed over (head, query). p: [Hq, Tq, Tk]."""
    total = 0.0
    for h in range(p.shape[0]):
        vh = v[0, h // group]  # [Tk, D]
        for i in range(p.shape[1]):
            mu = p[h, i] @ vh
            total += float((p[h, i] * ((vh - mu) ** 2).sum(-1)).sum()) / s
    return total


def _strat_mse(p, v, s, group):
    """App. A.5: Σ_m tr Σ^(m) / S², with P(key n | stratum m) = S·|[C_{n-1}, C_n) ∩ [m/S, (m+1)/S)|."""
    total = 0.0
    for h in range(p.shape[0]):
        vh = v[0, h // group]
        for i in range(p.shape[1]):
            c = torch.cumsum(p[h, i], 0)
            lo = torch.cat([torch.zeros(1, dtype=F64), c[:-1]])
            for m in range(s):
                a, b = m / s, (m + 1) / s
                w = torch.clamp(torch.clamp(c, max=b) - torch.clamp(lo, min=a), min=0) * s
                mu = w @ vh
                total += float((w * ((vh - mu) ** 2).sum(-1)).sum()) / s**2
    return total


def _mse(est, exact):
    """Mean over draws of Σ_(head, query) ‖Ô − AV‖²."""
    return float(((est - exact) ** 2).sum(-1).sum((1, 2)).mean())


# ---------------------------------------------------------------- hand-worked draws


def _four_keys():
    """One query, keys with softmax weights (0.1, 0.2, 0.3, 0.4) (scores log w, scale 1)."""
    q = torch.ones(1, 1, 1, 1, dtype=F64)
    k = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)).view(1, 1, 4, 1)
    v = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=F64).view(1, 1, 4, 1)
    return q, k, v


@pytest.mark.parametrize(
    "u, expected",
    [(0.3, [1, 0, 2, 1]), (0.5, [0, 1, 1, 2]), (0.0, [1, 1, 1, 1]), (0.95, [0, 1, 1, 2])],
    ids=["u0.3", "u0.5", "u0", "u0.95"],
)
def test_sys_hand_inverse_cdf(u, expected):
    # CDF (0.1, 0.3, 0.6, 1.0); points (j + u)/4: u=0.3 -> .075,.325,.575,.825 -> keys 0,2,2,3.
    # u=0 -> 0,.25,.5,.75 -> keys 0,1,2,3; u=0.95 -> .2375,.4875,.7375,.9875 -> keys 1,2,3,3.
    q, k, v = _four_keys()
    uni = torch.tensor([[[u]]], dtype=F64)
    counts = per_row_sample_counts(q, k, 4, estimator="sys", scale=1.0, uniforms=uni)
    assert counts[0, 0, 0].tolist() == expected
    out = santa_attention(q, k, v, 4, estimator="sys", scale=1.0, uniforms=uni)
    want = sum(c * x for c, x in zip(expected, [10.0, 20.0, 30.0, 40.0])) / 4
    assert out.item() == pytest.approx(want, rel=1e-12)


def test_strat_and_iid_hand_inverse_cdf():
    q, k, _ = _four_keys()
    # strat, S = 2: strata [0, .5), [.5, 1); u = (0.9, 0.1) -> points .45, .55 -> keys 2, 2.
    strat = per_row_sample_counts(q, k, 2, estimator="strat", scale=1.0,
                                  uniforms=torch.tensor([[[[0.9, 0.1]]]]))
    assert strat[0, 0, 0].tolist() == [0, 0, 2, 0]
    # iid, S = 3: points are the uniforms themselves: .05 -> 0, .95 -> 3, .35 -> 2 (with replacement).
    iid = per_row_sample_counts(q, k, 3, estimator="iid", scale=1.0,
                                uniforms=torch.tensor([[[[0.05, 0.95, 0.35]]]]))
    assert iid[0, 0, 0].tolist() == [1, 0, 1, 1]
    # iid may draw one key several times: all three points inside key 3's interval [0.6, 1).
    rep = per_row_sample_counts(q, k, 3, estimator="iid", scale=1.0,
                                uniforms=torch.tensor([[[[0.7, 0.8, 0.99]]]]))
    assert rep[0, 0, 0].tolist() == [0, 0, 0, 3]


def test_inverse_cdf_boundaries_and_zero_weights():
    # Key n owns [C_{n-1}, C_n): a point exactly on C_n goes to key n + 1; zero-weight keys are skipped.
    cum = torch.tensor([1.0, 3.0, 6.0, 10.0], dtype=F64)
    idx = inverse_cdf(cum, torch.tensor([0.0, 1.0, 2.999, 3.0, 9.999, 10.0], dtype=F64))
    assert idx.tolist() == [0, 1, 1, 2, 3, 3]  # 10.0 = Z (rounded up point) clamps to the last key
    cum0 = torch.cumsum(torch.tensor([0.0, 2.0, 0.0, 0.0, 2.0, 0.0], dtype=F64), 0)
    assert inverse_cdf(cum0, torch.tensor([0.0, 1.9, 2.0, 4.0], dtype=F64)).tolist() == [1, 1, 4, 4]


# ---------------------------------------------------------------- systematic: one uniform per query


def test_sys_uses_one_uniform_per_query():
    q, k, v = _problem(1, b=2, hq=2, tq=3, tk=5)
    g = torch.Generator().manual_seed(7)
    out = santa_attention(q, k, v, 8, estimator="sys", generator=g)
    g_ref = torch.Generator().manual_seed(7)
    u = torch.rand((2, 2, 3), generator=g_ref, dtype=F64)  # exactly B·Hq·Tq numbers consumed
    assert torch.equal(g.get_state(), g_ref.get_state())
    assert torch.equal(out, santa_attention(q, k, v, 8, estimator="sys", uniforms=u))
    with pytest.raises(ValueError, match="shape"):
        santa_attention(q, k, v, 8, estimator="sys", uniforms=torch.rand(2, 2, 3, 8))


def test_sys_same_uniform_same_indices():
    q, k, _ = _problem(2, b=1, hq=2, tq=3, tk=7)
    u = torch.rand(1, 2, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    a = per_row_sample_counts(q, k, 5, estimator="sys", uniforms=u)
    assert torch.equal(a, per_row_sample_counts(q, k, 5, estimator="sys", uniforms=u.clone()))
    u2 = u.clone()
    u2[0, 1, 2] = (u2[0, 1, 2] + 0.5) % 1.0  # change one query's offset: only that row may move
    b = per_row_sample_counts(q, k, 5, estimator="sys", uniforms=u2)
    changed = (a != b).any(-1)
    assert not changed[0, 0].any() and not changed[0, 1, :2].any()


# ---------------------------------------------------------------- unbiasedness


@pytest.mark.parametrize("estimator", ["iid", "strat", "sys"])
def test_prefill_unbiased(estimator):
    q, k, v = _problem(3, hq=4, hkv=2, tq=4, tk=7)
    r = 2000
    est = _draws(q, k, v, 3, estimator, r, seed=11)  # [R, Hq, Tq, D]
    exact = exact_attention(q, k, v)[0]
    mean, se = est.mean(0), est.std(0) / math.sqrt(r)
    # Row 0 (query at position 3) has several keys; deterministic elements have se = 0 and must be exact.
    assert torch.all((mean - exact).abs() <= 5 * se + 1e-9), (mean - exact).abs().max()


def test_noncausal_unbiased_with_longer_keys():
    q, k, v = _problem(4, hq=2, hkv=1, tq=2, tk=9)
    r = 2000
    g = torch.Generator().manual_seed(5)
    est = santa_attention(_repeat(q, r), _repeat(k, r), _repeat(v, r), 4, estimator="sys", causal=False,
                          generator=g)
    exact = exact_attention(q, k, v, causal=False)[0]
    se = est.std(0) / math.sqrt(r)
    assert torch.all((est.mean(0) - exact).abs() <= 5 * se + 1e-9)


# ---------------------------------------------------------------- variance


def test_strat_variance_not_above_iid():
    q, k, v = _problem(6, hq=2, hkv=1, tq=4, tk=8)
    s, r = 4, 3000
    p = _softmax_rows(q, k)
    iid_exact, strat_exact = _iid_mse(p, v, s, 2), _strat_mse(p, v, s, 2)
    assert strat_exact <= iid_exact  # Theorem A.6 on this problem
    exact = exact_attention(q, k, v)
    iid = _mse(_draws(q, k, v, s, "iid", r, 21), exact)
    strat = _mse(_draws(q, k, v, s, "strat", r, 22), exact)
    sys = _mse(_draws(q, k, v, s, "sys", r, 23), exact)
    assert iid == pytest.approx(iid_exact, rel=0.1)
    assert strat == pytest.approx(strat_exact, rel=0.1)
    assert strat < 0.9 * iid and sys < iid  # empirical ordering with margin (App. D: sys ≈ strat)


def test_error_scales_as_one_over_s():
    """SANTA-iid: E‖Ô − AV‖² = tr(Σ)/S exactly (App. A.2), so RMSE(4S) / RMSE(S) = 1/2.

    Checked as MSE(S)/MSE(4S) in [3.4, 4.7] with each MSE within 10% of tr(Σ)/S. For strat, refining
    every stratum into 4 gives Cov(4S) ≤ Cov(S)/4 (law of total covariance), so its exact MSE ratio
    is ≥ 4, and the empirical one ≥ 3.4.
    """
    q, k, v = _problem(8, hq=2, hkv=1, tq=4, tk=10)
    r = 3000
    p = _softmax_rows(q, k)
    exact = exact_attention(q, k, v)
    iid4, iid16 = (_mse(_draws(q, k, v, s, "iid", r, 30 + s), exact) for s in (4, 16))
    assert iid4 == pytest.approx(_iid_mse(p, v, 4, 2), rel=0.1)
    assert iid16 == pytest.approx(_iid_mse(p, v, 16, 2), rel=0.1)
    assert 3.4 <= iid4 / iid16 <= 4.7
    assert _strat_mse(p, v, 4, 2) >= 4 * _strat_mse(p, v, 16, 2) * (1 - 1e-9)
    st4, st16 = (_mse(_draws(q, k, v, s, "strat", r, 40 + s), exact) for s in (4, 16))
    assert st4 / st16 >= 3.4


# ---------------------------------------------------------------- GQA, causal, shapes, S


def test_gqa_query_head_reads_kv_head_h_div_group():
    b, hq, hkv, tq, tk, d = 1, 4, 2, 3, 6, 2
    g = torch.Generator().manual_seed(9)
    q = torch.randn(b, hq, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.stack([torch.zeros(tk, d), torch.ones(tk, d)])[None]  # KV head 0 -> 0, KV head 1 -> 1
    out = santa_attention(q, k, v, 4, estimator="iid", generator=g)
    assert torch.all(out[:, :2] == 0) and torch.all(out[:, 2:] == 1)
    # Same draws as with K/V expanded to one copy per query head.
    u = torch.rand(b, hq, tq, generator=g, dtype=F64)
    v = torch.randn(b, hkv, tk, d, generator=g)
    grouped = santa_attention(q, k, v, 4, uniforms=u)
    expanded = santa_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 4, uniforms=u)
    assert torch.allclose(grouped, expanded, rtol=1e-6, atol=1e-6)


def test_causal_mask_never_samples_future_keys():
    q, k, v = _problem(10, b=1, hq=2, tq=3, tk=7, sharp=0.1)  # nearly flat: every allowed key is likely
    u = torch.rand(1, 2, 3, 64, generator=torch.Generator().manual_seed(1), dtype=F64)
    counts = per_row_sample_counts(q, k, 64, estimator="iid", uniforms=u)
    future = torch.arange(7)[None, :] > torch.arange(4, 7)[:, None]  # query i sits at 4 + i
    assert counts[..., future].sum() == 0 and torch.all(counts.sum(-1) == 64)
    free = per_row_sample_counts(q, k, 64, estimator="iid", causal=False, uniforms=u)
    assert free[..., future].sum() > 0
    # Future keys and values have no influence on a causal output.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5:], v2[:, :, 5:] = 100.0, -100.0  # keys 5, 6 are future for query 0 (position 4)
    out = santa_attention(q, k, v, 64, estimator="iid", uniforms=u)
    out2 = santa_attention(q, k2, v2, 64, estimator="iid", uniforms=u)
    assert torch.equal(out[:, :, 0], out2[:, :, 0]) and not torch.equal(out[:, :, 2], out2[:, :, 2])


@pytest.mark.parametrize("shape", [(1, 4, 2, 1, 1, 8), (2, 2, 1, 13, 13, 5), (1, 8, 2, 7, 301, 16)],
                         ids=["B1-H4-Tq1-Tk1-D8", "B2-H2-T13-D5", "B1-H8-Tq7-Tk301-D16"])
@pytest.mark.parametrize("estimator", ["iid", "strat", "sys"])
def test_odd_shapes_and_dtypes(shape, estimator):
    b, hq, hkv, tq, tk, d = shape
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h, t in ((hq, tq), (hkv, tk), (hkv, tk)))
    out = santa_attention(q, k, v, 5, estimator=estimator, generator=g)
    assert out.shape == (b, hq, tq, d) and out.dtype == torch.float32 and torch.isfinite(out).all()
    counts = per_row_sample_counts(q, k, 5, estimator=estimator, generator=g)
    assert counts.shape == (b, hq, tq, tk) and torch.all(counts.sum(-1) == 5)
    half = santa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 5, estimator=estimator, generator=g)
    assert half.dtype == torch.bfloat16


def test_zero_samples_evaluated_as_one():
    q, k, v = _problem(12, b=2)
    u = torch.rand(2, 2, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    assert torch.equal(santa_attention(q, k, v, 0, uniforms=u), santa_attention(q, k, v, 1, uniforms=u))
    assert torch.all(per_row_sample_counts(q, k, 0, uniforms=u).sum(-1) == 1)
    per_row = per_row_sample_counts(q, k, torch.tensor([0, 6]), uniforms=u)  # S per batch row
    assert torch.all(per_row[0].sum(-1) == 1) and torch.all(per_row[1].sum(-1) == 6)
    with pytest.raises(ValueError, match=">= 0"):
        santa_attention(q, k, v, -1, uniforms=u)
