"""The REINFORCE policy over per-layer sample budgets (Lee et al., arXiv:2605.01910, App. K, Algorithm 1).

The policy is a vector of logits ``theta: [L]`` (one per attention layer), ``p = softmax(theta)``; a
schedule ``s: [L]`` of non-negative integers summing to the total budget ``N`` is drawn as
``s ~ Multinomial(N, p)``. For a batch of ``K`` episodes with rewards ``r: [K]`` the update is

    b = mean(r)
    g = (1/K) * sum_k (r_k - b) * (s_k - N * p_k)
    theta <- theta + lr * g

where ``s - N p`` is the gradient of ``log Multinomial(s; N, softmax(theta))`` with respect to
``theta`` and ``p_k`` is the policy that produced ``s_k`` (with asynchronous workers a result may come
from an older policy iteration than the aggregator's current one).

Everything here is array-in, array-out math (float64); the file protocol lives in
:mod:`calib.santa.inbox`, the loops in :mod:`calib.santa.worker` and :mod:`calib.santa.aggregator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np

from runtime_kernels.santa.schedule import apportion


class NonFiniteUpdate(ValueError):
    """The REINFORCE step produced NaN/inf (rejected: NaN never enters theta)."""


def softmax(theta: np.ndarray) -> np.ndarray:
    """Numerically stable softmax of logits ``theta: [L]`` (or ``[K, L]``, row-wise) in float64."""
    theta = np.asarray(theta, dtype=np.float64)
    z = theta - theta.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sample_schedule(probs: np.ndarray, budget: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``s ~ Multinomial(budget, probs)``: ``probs: [L]`` -> ``s: [L]`` int64, ``s.sum() == budget``."""
    probs = np.asarray(probs, dtype=np.float64)
    if budget < 0:
        raise ValueError(f"budget must be >= 0 (got {budget})")
    # numpy checks sum(p[:-1]) <= 1; renormalising guards against a last-ulp excess.
    return rng.multinomial(int(budget), probs / probs.sum()).astype(np.int64)


def evaluation_budgets(schedule: np.ndarray | list[int]) -> list[int]:
    """Per-layer ``S`` used to evaluate a schedule: a layer that drew 0 samples runs with ``S = 1``."""
    return [max(int(x), 1) for x in schedule]


def log_prob_grad(schedule: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """``d/dtheta log Multinomial(s; N, softmax(theta)) = s - N * p`` with ``N = s.sum()``: [L] or [K, L]."""
    s = np.asarray(schedule, dtype=np.float64)
    n = s.sum(axis=-1, keepdims=True)
    return s - n * np.asarray(probs, dtype=np.float64)


@dataclass(frozen=True)
class ReinforceStep:
    """One aggregated update: the new logits, the mean-reward baseline and the gradient ``g``."""

    theta: np.ndarray  # [L] theta after the step
    baseline: float
    gradient: np.ndarray  # [L]


def reinforce_update(
    theta: np.ndarray,
    schedules: np.ndarray,
    rewards: np.ndarray,
    probs: np.ndarray,
    lr: float,
) -> ReinforceStep:
    """One REINFORCE step with the mean-reward baseline (Algorithm 1, lines 12-14).

    theta: [L] current logits; schedules: [K, L] integer draws (each row sums to the budget N);
    rewards: [K]; probs: [K, L], row k the policy that produced ``schedules[k]``; lr: alpha.
    Raises ``ValueError`` on inconsistent shapes or non-finite inputs and :class:`NonFiniteUpdate` if
    the gradient or the new theta is not finite.
    """
    theta = np.asarray(theta, dtype=np.float64)
    s = np.asarray(schedules, dtype=np.float64)
    r = np.asarray(rewards, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    k = r.shape[0] if r.ndim == 1 else -1
    if k < 1 or s.shape != (k, theta.shape[0]) or p.shape != s.shape:
        raise ValueError(f"shapes: theta {theta.shape}, schedules {s.shape}, rewards {r.shape}, probs {p.shape}")
    for name, arr in (("theta", theta), ("schedules", s), ("rewards", r), ("probs", p)):
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} contains NaN or inf")
    baseline = float(r.mean())
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected and rejected below
        grad = ((r - baseline)[:, None] * log_prob_grad(s, p)).mean(axis=0)  # [L]
        new_theta = theta + float(lr) * grad
    if not (np.all(np.isfinite(grad)) and np.all(np.isfinite(new_theta))):
        raise NonFiniteUpdate("REINFORCE gradient or updated theta is not finite; update rejected")
    return ReinforceStep(theta=new_theta, baseline=baseline, gradient=grad)


def schedule_from_policy(theta: np.ndarray, budget: int) -> np.ndarray:
    """The schedule of a policy: ``N * softmax(theta)`` by largest remainder, >= 1 per layer, sum N.

    :func:`runtime_kernels.santa.schedule.apportion` with ``minimum = 1`` (Hamilton apportionment:
    floors, the remaining samples to the largest fractional parts, ties to the lower layer index; a
    layer lifted to one sample is paid for by the most over-served layer). theta: [L]; requires
    ``budget >= L``. Returns ``[L]`` int64.
    """
    p = softmax(theta)
    if budget < p.shape[0]:
        raise ValueError(f"budget {budget} < {p.shape[0]} layers: cannot give every layer at least one sample")
    return np.asarray(apportion(p.tolist(), int(budget), minimum=1), dtype=np.int64)


def deployment_probs(theta: np.ndarray) -> np.ndarray:
    """``softmax(theta)`` rounded to float32 and back: the ``probs`` an artifact stores ([L] float64).

    Schedules for deployment budgets are apportioned from these, in calibration and in the runtime
    alike, so a schedule stored in an artifact is exactly what the runtime makes of ``probs``."""
    return softmax(theta).astype(np.float32).astype(np.float64)


def uniform_placements(num_layers: int, budget: int) -> list[np.ndarray]:
    """Every as-uniform-as-possible integer schedule: each layer ``floor(N/L)`` or ``ceil(N/L)``, sum N.

    When ``L`` divides ``N`` this is the one uniform schedule; otherwise the ``r = N mod L`` extra
    samples can sit on any ``r`` layers, ``C(L, r)`` placements, and :func:`schedule_from_policy` at
    ``theta = 0`` picks one of them (the lowest layer indices, its tie rule). A fair "uniform at N"
    for a budget that L does not divide is then the mean over placements (each equally uniform), and
    a strict one is the best placement. In lexicographic order of the extra layers' indices;
    ``schedule_from_policy(zeros, N)`` is the first. Requires ``N >= L``.
    """
    if budget < num_layers:
        raise ValueError(f"budget {budget} < {num_layers} layers: cannot give every layer at least one sample")
    base, extra = divmod(int(budget), int(num_layers))
    out = []
    for chosen in combinations(range(num_layers), extra):
        s = np.full(num_layers, base, dtype=np.int64)
        s[list(chosen)] += 1
        out.append(s)
    return out
