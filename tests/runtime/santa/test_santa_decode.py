"""S²ANTA decode tilings (prop, flash; App. P, Q) and their budgets, against hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.santa import (
    decode_sample_counts,
    exact_attention,
    expected_prop_output,
    flash_tile_budget,
    largest_remainder,
    santa_decode_attention,
)
from runtime_kernels.santa.reference import decode_samples

F64 = torch.float64


def _two_tiles():
    """One head, 4 keys in 2 tiles of 2; softmax weights (1, 2, .5, .5)/4, V = (1, 4, -2, 6).

    Tile masses m̄ = (3/4, 1/4); tile means μ_0 = (1·1 + 2·4)/3 = 3, μ_1 = (−2 + 6)/2 = 2;
    exact attention 0.75·3 + 0.25·2 = 2.75.
    """
    q = torch.ones(1, 1, 1, dtype=F64)
    k = torch.log(torch.tensor([1.0, 2.0, 0.5, 0.5], dtype=F64)).view(1, 1, 4, 1)
    v = torch.tensor([1.0, 4.0, -2.0, 6.0], dtype=F64).view(1, 1, 4, 1)
    return q, k, v


def _decode_problem(seed, b=1, hq=4, hkv=2, tk=11, d=3, sharp=1.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g, dtype=F64) * sharp
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=F64)
    v = torch.randn(b, hkv, tk, d, generator=g, dtype=F64)
    return q, k, v


def _repeat(x, r):
    return x.expand(r, *x.shape[1:]).contiguous()


# ---------------------------------------------------------------- budgets


def test_largest_remainder_hand_examples():
    q = torch.tensor([[2.0, 1.2, 0.8], [1.35, 1.05, 0.6], [0.5, 0.5, 1.0]], dtype=F64)
    total = torch.tensor([4, 3, 2])
    # floors (2,1,0) + 1 to frac .8; floors (1,1,0) + 1 to frac .6; floors (0,0,1) + tie -> lower index.
    assert largest_remainder(q, total).tolist() == [[2, 1, 1], [1, 1, 1], [1, 0, 1]]
    valid = torch.tensor([[True, True, False]] * 3)
    # Slot 2 is invalid: its 0.7 never wins; floors (0, 1) + remainder 2 -> fracs .7 (slot 0), .6 (slot 1).
    masked = largest_remainder(torch.tensor([[0.7, 1.6, 0.7]], dtype=F64), torch.tensor([3]), valid[:1])
    assert masked.tolist() == [[1, 2, 0]]


def test_largest_remainder_sums_exactly():
    g = torch.Generator().manual_seed(0)
    mass = torch.softmax(torch.randn(500, 9, generator=g, dtype=F64) * 3, -1)
    total = torch.randint(1, 300, (500,), generator=g)
    budgets = largest_remainder(mass * total[:, None], total)
    assert torch.equal(budgets.sum(-1), total) and (budgets >= 0).all()
    assert ((budgets - mass * total[:, None]).abs() < 1).all()  # each within one of its quota


def test_flash_tile_budget_hand_examples():
    s = torch.tensor([5, 2, 10, 1, 256, 7])
    t = torch.tensor([3, 4, 4, 10, 128, 2])
    # 5/3=1.67->2, 2/4=.5->1 (half up), 10/4=2.5->3 (half up), 1/10->0->max 1, 256/128=2, 7/2=3.5->4
    assert flash_tile_budget(s, t).tolist() == [2, 1, 3, 1, 2, 4]


def test_prop_budgets_hand_example():
    q, k, _ = _two_tiles()
    # S=3: quotas 3·(3/4, 1/4) = (2.25, 0.75) -> floors (2, 0), remainder 1 -> tile 1: (2, 1).
    drawn = decode_samples(q, k, torch.tensor([3]), tiling="prop", tile=2, scale=1.0,
                           tile_uniforms=torch.zeros(1, 1, 2, dtype=F64), cache_len=torch.tensor([4]))
    assert drawn.tile_budgets.tolist() == [[[2, 1]]]
    assert torch.allclose(drawn.tile_mass, torch.tensor([[[0.75, 0.25]]], dtype=F64))
    assert drawn.counts.sum().item() == 3


def test_prop_budgets_sum_to_s_with_partial_tiles():
    q, k, _ = _decode_problem(1, b=2, tk=257)
    cache_len = torch.tensor([257, 130])
    for s in (1, 3, 64, 1000):
        drawn = decode_samples(q, k, torch.tensor([s, s]), tiling="prop", tile=16, scale=3**-0.5,
                               tile_uniforms=torch.rand(2, 4, 17, dtype=F64), cache_len=cache_len)
        assert torch.all(drawn.tile_budgets.sum(-1) == s) and torch.all(drawn.counts.sum(-1) == s)
        assert drawn.tile_budgets[1, :, 9:].sum() == 0  # tiles past cache_len 130 (9 tiles) get nothing
        assert drawn.counts[1, :, 130:].sum() == 0


# ---------------------------------------------------------------- prop: biased exactly as defined


def test_prop_expectation_hand_example():
    q, k, v = _two_tiles()
    # Budgets (2, 1): E[O] = (2/3)·μ_0 + (1/3)·μ_1 = 2 + 2/3 = 8/3, not the exact 2.75.
    exp = expected_prop_output(q, k, v, 3, tile=2, scale=1.0)
    assert exp.item() == pytest.approx(8 / 3, rel=1e-12)
    assert exact_attention(q, k, v, scale=1.0).item() == pytest.approx(2.75, rel=1e-12)
    # Tile 0, 2 samples, CDF (1/3, 1): u < 2/3 -> keys (0, 1), else (1, 1); tile 1, 1 sample at u/1:
    # key 2 if u < 1/2 else key 3. Offsets (0.5, 0.25): (1 + 4 + (-2)) / 3 = 1.
    out = santa_decode_attention(q, k, v, 3, tiling="prop", tile=2, scale=1.0,
                                 tile_uniforms=torch.tensor([[[0.5, 0.25]]]))
    assert out.item() == pytest.approx(1.0, rel=1e-12)
    r = 4000
    g = torch.Generator().manual_seed(3)
    est = santa_decode_attention(_repeat(q, r), _repeat(k, r), _repeat(v, r), 3, tiling="prop", tile=2,
                                 scale=1.0, generator=g)
    se = est.std(0) / math.sqrt(r)
    assert (est.mean(0) - exp[0]).abs().item() <= 5 * se.item()
    assert (est.mean(0) - 2.75).abs().item() > 5 * se.item()  # the rounding bias is visible


def test_prop_mean_matches_expected_prop_output():
    q, k, v = _decode_problem(4, tk=13)
    r = 2000
    g = torch.Generator().manual_seed(8)
    est = santa_decode_attention(_repeat(q, r), _repeat(k, r), _repeat(v, r), 5, tiling="prop", tile=4,
                                 generator=g)
    exp = expected_prop_output(q, k, v, 5, tile=4)[0]
    se = est.std(0) / math.sqrt(r)
    assert torch.all((est.mean(0) - exp).abs() <= 5 * se + 1e-9)


# ---------------------------------------------------------------- flash: unbiased


def test_flash_unbiased_partial_tiles_and_cache_len():
    """Two cache lengths (11: tiles 4,4,3, S_tile=2; 7: tiles 4,3, S_tile=3) with S=5, NaN padding."""
    q, k, v = _decode_problem(5, tk=11)
    r = 2000
    qs, ks, vs = _repeat(q, 2 * r), _repeat(k, 2 * r).clone(), _repeat(v, 2 * r).clone()
    cache_len = torch.tensor([11, 7]).repeat(r)
    ks[1::2, :, 7:] = float("nan")
    vs[1::2, :, 7:] = float("nan")
    g = torch.Generator().manual_seed(12)
    est = santa_decode_attention(qs, ks, vs, 5, tiling="flash", tile=4, generator=g, cache_len=cache_len)
    assert torch.isfinite(est).all()
    for row, n in ((0, 11), (1, 7)):
        e = est[row::2]
        exact = exact_attention(q, k[:, :, :n], v[:, :, :n])[0]
        se = e.std(0) / math.sqrt(r)
        assert torch.all((e.mean(0) - exact).abs() <= 5 * se + 1e-9), (row, (e.mean(0) - exact).abs().max())
    counts = decode_sample_counts(qs[:2], ks[:2], 5, tiling="flash", tile=4, cache_len=cache_len[:2])
    assert counts[0].sum(-1).tolist() == [6] * 4 and counts[1].sum(-1).tolist() == [6] * 4  # 3·2, 2·3
    assert counts[1, :, 7:].sum() == 0


def test_flash_hand_example():
    q, k, v = _two_tiles()
    # S=2, T=2 -> S_tile=1. Offsets (0.5, 0.25): tile 0 point .5 -> key 1 (CDF 1/3, 1); tile 1 point
    # .25 -> key 2. O = 0.75·4 + 0.25·(−2) = 2.5.
    out = santa_decode_attention(q, k, v, 2, tiling="flash", tile=2, scale=1.0,
                                 tile_uniforms=torch.tensor([[[0.5, 0.25]]]))
    assert out.item() == pytest.approx(2.5, rel=1e-12)


# ---------------------------------------------------------------- consistency, shapes, S


@pytest.mark.parametrize("tiling", ["prop", "flash"])
def test_single_tile_equals_untiled_sys(tiling):
    q, k, v = _decode_problem(6, b=2, tk=9)
    u = torch.rand(2, 4, 1, generator=torch.Generator().manual_seed(0), dtype=F64)
    tiled = santa_decode_attention(q, k, v, 6, tiling=tiling, tile=16, tile_uniforms=u)
    flat = santa_decode_attention(q, k, v, 6, tiling="none", uniforms=u)
    assert torch.allclose(tiled, flat, rtol=1e-12, atol=1e-12)
    assert torch.equal(decode_sample_counts(q, k, 6, tiling=tiling, tile=16, tile_uniforms=u),
                       decode_sample_counts(q, k, 6, tiling="none", uniforms=u))


@pytest.mark.parametrize("estimator", ["iid", "strat", "sys"])
def test_untiled_decode_unbiased(estimator):
    q, k, v = _decode_problem(7, tk=10)
    r = 2000
    g = torch.Generator().manual_seed(13)
    est = santa_decode_attention(_repeat(q, r), _repeat(k, r), _repeat(v, r), 4, tiling="none",
                                 estimator=estimator, generator=g)
    exact = exact_attention(q, k, v)[0]
    se = est.std(0) / math.sqrt(r)
    assert torch.all((est.mean(0) - exact).abs() <= 5 * se + 1e-9)


def test_tile_256_default_with_odd_length():
    q, k, v = _decode_problem(8, b=2, hq=8, hkv=2, tk=600, d=16)
    q4 = q[:, :, None].float()
    lens = torch.tensor([600, 257])
    out = santa_decode_attention(q4, k.float(), v.float(), 64, tiling="flash", cache_len=lens)
    assert out.shape == (2, 8, 16) and out.dtype == torch.float32 and torch.isfinite(out).all()
    counts = decode_sample_counts(q4, k.float(), 64, tiling="flash", cache_len=lens)
    # T = 3 tiles (256, 256, 88) -> S_tile = round(64/3) = 21; T = 2 (256, 1) -> 32.
    assert torch.all(counts[0].sum(-1) == 63) and torch.all(counts[1].sum(-1) == 64)
    assert torch.all(counts[1, :, 256] == 32) and counts[1, :, 257:].sum() == 0  # one-key last tile
    with pytest.raises(ValueError, match="shape"):  # one offset per (b, head, tile): [2, 8, 3]
        santa_decode_attention(q, k, v, 64, tile_uniforms=torch.rand(2, 8, 2))


def test_decode_gqa_mapping():
    q, k, _ = _decode_problem(9, hq=4, hkv=2, tk=10)
    v = torch.stack([torch.zeros(10, 3), torch.ones(10, 3)])[None].to(F64)
    for tiling in ("prop", "flash", "none"):
        out = santa_decode_attention(q, k, v, 8, tiling=tiling, tile=4)
        assert torch.allclose(out[:, :2], torch.zeros(1, 2, 3, dtype=F64), atol=1e-12)
        assert torch.allclose(out[:, 2:], torch.ones(1, 2, 3, dtype=F64), atol=1e-12)


@pytest.mark.parametrize("tiling", ["prop", "flash", "none"])
def test_decode_zero_samples_evaluated_as_one(tiling):
    q, k, v = _decode_problem(10, b=2, tk=9)
    kw = {"uniforms": torch.rand(2, 4, 1)} if tiling == "none" else {"tile_uniforms": torch.rand(2, 4, 3)}
    zero = santa_decode_attention(q, k, v, torch.tensor([0, 0]), tiling=tiling, tile=4, **kw)
    assert torch.equal(zero, santa_decode_attention(q, k, v, 1, tiling=tiling, tile=4, **kw))
    if tiling != "flash":
        assert torch.all(decode_sample_counts(q, k, 0, tiling=tiling, tile=4, **kw).sum(-1) == 1)


def test_tiled_decode_rejects_other_estimators():
    q, k, v = _decode_problem(11)
    with pytest.raises(ValueError, match="sys"):
        santa_decode_attention(q, k, v, 4, tiling="flash", estimator="iid")
