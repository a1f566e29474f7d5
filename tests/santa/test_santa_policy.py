"""REINFORCE math of the SANTA schedule policy (Lee et al., arXiv:2605.01910, App. K), against hand-worked
cases and independent computations (torch autograd, finite differences, float64 references)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calib.santa.policy import (
    NonFiniteUpdate,
    evaluation_budgets,
    log_prob_grad,
    reinforce_update,
    sample_schedule,
    schedule_from_policy,
    uniform_placements,
    softmax,
)


def test_softmax_is_stable_and_normalised():
    p = softmax(np.array([1000.0, 1000.0, -1000.0]))
    np.testing.assert_allclose(p, [0.5, 0.5, 0.0], atol=1e-300)
    p = softmax(np.log(np.array([1.0, 2.0, 5.0])))
    np.testing.assert_allclose(p, [0.125, 0.25, 0.625], rtol=1e-15)


def test_sample_schedule_sums_to_budget_and_is_unbiased():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    draws = np.stack([sample_schedule(p, 32, rng) for _ in range(4000)])  # [4000, 4]
    assert draws.dtype == np.int64 and (draws.sum(axis=1) == 32).all() and (draws >= 0).all()
    # E[s] = N p; the standard error of the mean is sqrt(N p (1-p) / 4000) <= 0.045 here.
    np.testing.assert_allclose(draws.mean(axis=0), 32 * p, atol=0.2)


def test_zero_sample_layers_are_evaluated_with_one_sample():
    assert evaluation_budgets(np.array([0, 5, 0, 3])) == [1, 5, 1, 3]


def _log_multinomial_torch(theta: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n = s.sum()
    logp = torch.log_softmax(theta, dim=0)
    return torch.lgamma(n + 1) - torch.lgamma(s + 1).sum() + (s * logp).sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_prob_grad_matches_autograd_and_finite_differences(seed):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=6)
    s = rng.multinomial(48, softmax(theta)).astype(np.float64)
    t = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    _log_multinomial_torch(t, torch.tensor(s, dtype=torch.float64)).backward()
    ours = log_prob_grad(s, softmax(theta))
    np.testing.assert_allclose(ours, t.grad.numpy(), rtol=1e-12, atol=1e-12)

    def logpmf(th: np.ndarray) -> float:
        logp = th - math.log(np.exp(th).sum())
        return float((s * logp).sum())  # the multinomial coefficient does not depend on theta

    eps = 1e-6
    fd = np.array([(logpmf(theta + eps * e) - logpmf(theta - eps * e)) / (2 * eps) for e in np.eye(6)])
    np.testing.assert_allclose(ours, fd, rtol=1e-6, atol=1e-7)


def test_reinforce_update_hand_worked():
    # L=2, N=4, theta=0 -> p=[.5,.5], Np=[2,2]. s1=[3,1] r1=1, s2=[1,3] r2=0 -> b=.5,
    # g = ((.5)[1,-1] + (-.5)[-1,1]) / 2 = [.5,-.5]; theta' = 0.02 g = [.01,-.01].
    step = reinforce_update(np.zeros(2), np.array([[3, 1], [1, 3]]), np.array([1.0, 0.0]),
                            np.array([[0.5, 0.5], [0.5, 0.5]]), lr=0.02)
    assert step.baseline == 0.5
    np.testing.assert_allclose(step.gradient, [0.5, -0.5], rtol=0, atol=1e-15)
    np.testing.assert_allclose(step.theta, [0.01, -0.01], rtol=0, atol=1e-15)


def test_reinforce_update_uses_each_results_own_policy():
    # Result 1 came from p=[.75,.25] (Np=[3,1]), result 2 from p=[.5,.5] (Np=[2,2]); N=4.
    # s1=[4,0] r1=.75, s2=[2,2] r2=.25 -> b=.5; g = (.25*[1,-1] + (-.25)*[0,0]) / 2 = [.125,-.125].
    theta = np.array([0.3, -0.2])
    step = reinforce_update(theta, np.array([[4, 0], [2, 2]]), np.array([0.75, 0.25]),
                            np.array([[0.75, 0.25], [0.5, 0.5]]), lr=0.1)
    np.testing.assert_allclose(step.gradient, [0.125, -0.125], rtol=0, atol=1e-15)
    np.testing.assert_allclose(step.theta, theta + 0.1 * np.array([0.125, -0.125]), rtol=0, atol=1e-15)


def test_reinforce_single_result_or_equal_rewards_do_not_move_theta():
    theta = np.array([0.1, 0.2, 0.3])
    step = reinforce_update(theta, np.array([[5, 0, 1]]), np.array([0.9]), softmax(theta)[None], lr=0.02)
    np.testing.assert_array_equal(step.theta, theta)
    step = reinforce_update(theta, np.array([[5, 0, 1], [0, 6, 0]]), np.array([0.5, 0.5]),
                            np.stack([softmax(theta)] * 2), lr=0.02)
    np.testing.assert_array_equal(step.theta, theta)


def test_reinforce_update_matches_surrogate_autograd():
    # The score-function gradient equals the autograd gradient of mean((r - b) log pi_theta(s)).
    rng = np.random.default_rng(7)
    theta = rng.normal(size=5)
    s = np.stack([rng.multinomial(40, softmax(theta)) for _ in range(9)]).astype(np.float64)
    r = rng.uniform(size=9)
    t = torch.tensor(theta, requires_grad=True)
    st_ = torch.tensor(s)
    adv = torch.tensor(r - r.mean())
    torch.stack([a * _log_multinomial_torch(t, row) for a, row in zip(adv, st_)]).mean().backward()
    step = reinforce_update(theta, s, r, np.stack([softmax(theta)] * 9), lr=0.02)
    np.testing.assert_allclose(step.gradient, t.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", ["reward_nan", "reward_inf", "probs_nan", "theta_nan"])
def test_reinforce_update_rejects_non_finite_inputs(bad):
    theta, s, r, p = np.zeros(2), np.array([[3.0, 1.0], [1.0, 3.0]]), np.array([1.0, 0.0]), np.full((2, 2), 0.5)
    if bad == "reward_nan":
        r[0] = np.nan
    elif bad == "reward_inf":
        r[1] = np.inf
    elif bad == "probs_nan":
        p[1, 0] = np.nan
    else:
        theta[0] = np.nan
    with pytest.raises(ValueError):
        reinforce_update(theta, s, r, p, lr=0.02)


def test_reinforce_update_rejects_overflowing_theta():
    with pytest.raises(NonFiniteUpdate):
        reinforce_update(np.array([1.7e308, 0.0]), np.array([[4.0, 0.0], [0.0, 4.0]]), np.array([1.0, 0.0]),
                         np.full((2, 2), 0.5), lr=1e308)


def test_reinforce_update_rejects_bad_shapes():
    with pytest.raises(ValueError):
        reinforce_update(np.zeros(3), np.ones((2, 2)), np.ones(2), np.ones((2, 2)), lr=0.02)


@pytest.mark.parametrize(
    "probs, budget, expected",
    [
        ([0.5, 0.3, 0.2], 8, [4, 2, 2]),  # quotas 4, 2.4, 1.6 -> floors 4,2,1 + largest remainder (1.6)
        ([0.25, 0.25, 0.25, 0.25], 10, [3, 3, 2, 2]),  # equal remainders: ties to the lower layer
        ([0.96, 0.02, 0.02], 10, [8, 1, 1]),  # 9.6,.2,.2 -> lifted to 9,1,1 (=11): take 1 from layer 0
        ([0.9, 0.05, 0.05], 4, [2, 1, 1]),  # 3.6,.2,.2 -> 3,1,1 (=5) -> 2,1,1
        ([0.45, 0.45, 0.05, 0.05], 8, [3, 3, 1, 1]),  # 3.6,3.6,.4,.4 -> 3,3,1,1 (=8) already
        ([0.7, 0.2, 0.1], 3, [1, 1, 1]),  # N = L: one each
    ],
)
def test_schedule_from_policy_examples(probs, budget, expected):
    out = schedule_from_policy(np.log(np.array(probs)), budget)
    assert out.tolist() == expected


def test_schedule_from_policy_needs_budget_of_at_least_one_per_layer():
    with pytest.raises(ValueError, match="at least one"):
        schedule_from_policy(np.zeros(5), 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-8, 8), min_size=1, max_size=12), st.integers(0, 80))
def test_schedule_from_policy_properties(theta, extra):
    theta = np.array(theta)
    budget = len(theta) + extra
    s = schedule_from_policy(theta, budget)
    quota = budget * softmax(theta)
    assert s.sum() == budget and (s >= 1).all()
    floor = np.floor(quota)
    if (floor >= 1).all() and not np.isclose(quota, np.round(quota), atol=1e-9).any():
        # nothing lifted: plain largest remainder -- floors, plus one for the largest remainders
        bumped = s == floor + 1
        assert (bumped | (s == floor)).all()
        rem = quota - floor
        if bumped.any() and (~bumped).any():
            assert rem[bumped].min() >= rem[~bumped].max()


@pytest.mark.parametrize("layers, budget, count", [(4, 8, 1), (4, 5, 4), (4, 6, 6), (4, 7, 4), (3, 3, 1), (5, 12, 10)])
def test_uniform_placements_are_every_floor_ceil_schedule(layers, budget, count):
    got = uniform_placements(layers, budget)
    assert len(got) == count == math.comb(layers, budget % layers)
    assert len({tuple(s) for s in got}) == count
    for s in got:
        assert s.sum() == budget and set(s.tolist()) <= {budget // layers, -(-budget // layers)}
    assert np.array_equal(got[0], schedule_from_policy(np.zeros(layers), budget))  # theta = 0's own placement


def test_uniform_placements_need_one_sample_per_layer():
    with pytest.raises(ValueError, match="at least one sample"):
        uniform_placements(4, 3)

