"""Per-layer sample schedules from a learned share ``p``: Hamilton (largest-remainder) apportionment.

A SANTA artifact keeps the learned distribution ``p: [L]`` over layers (``probs``), so a schedule can be
made for any total budget ``N`` at load time (``options={"santa": {"budget": N}}``), not only the budget
the policy was trained at. :func:`apportion` is the rule, shared by calibration (which stores the
schedule at the artifact's default budget) and the runtime (which rescales ``p`` for an override).

Properties: ``Σ s = N`` exactly; order-preserving (``p_i > p_j`` implies ``s_i >= s_j``); with
``minimum = 0``, plain Hamilton. Hamilton is not house-monotone: raising ``N`` by one can take a sample
away from a layer (the Alabama paradox; ``p = (6, 6, 2) / 14``: ``N = 10 -> [4, 4, 2]``,
``N = 11 -> [5, 5, 1]``), which is why a deployment budget is checked at the budget it runs at.
"""

from __future__ import annotations

import math
from typing import Sequence


def apportion(probs: Sequence[float], total: int, minimum: int = 1) -> list[int]:
    """Integer per-layer budgets ``[L]`` summing to ``total`` in proportion to ``probs``.

    probs: ``[L]`` non-negative finite shares with a positive sum (normalised here); total: ``N``;
    minimum: the least samples a layer gets (0 or 1 in practice). Raises ``ValueError`` on bad input.

    1. quotas ``q_i = N · p_i / Σ p`` (float64);
    2. ``s_i = floor(q_i)``, then each of the ``N − Σ s`` remaining samples goes to the layer with the
       largest fractional part ``q_i − floor(q_i)`` (ties: the lower layer index);
    3. minimum per layer: the kernels run a layer with ``S = 0`` as ``S = 1`` (``SantaDecode.budget``), so a
       zero would spend a sample the total did not count. Every layer below ``minimum`` is lifted to it
       first, and the samples this adds are taken back, one at a time, from the layer above the minimum
       whose ``q_i − s_i`` is smallest (the most over-served; ties: the lower index). Needs
       ``N >= minimum · L``.
    """
    p = [float(x) for x in probs]
    total, minimum = int(total), int(minimum)
    if not p:
        raise ValueError("probs must hold one share per layer (got none)")
    if any(not math.isfinite(x) or x < 0 for x in p) or sum(p) <= 0:
        raise ValueError(f"probs must be finite, >= 0 and not all 0 (got {p})")
    if minimum < 0:
        raise ValueError(f"minimum must be >= 0 (got {minimum})")
    if total < minimum * len(p):
        raise ValueError(f"budget {total} < {minimum} x {len(p)} layers: cannot give every layer at least "
                         f"{minimum} sample{'s' if minimum != 1 else ''}")
    norm = sum(p)
    quota = [total * x / norm for x in p]
    s = [int(math.floor(q)) for q in quota]
    order = sorted(range(len(p)), key=lambda i: (-(quota[i] - s[i]), i))  # largest fraction, then lower index
    for i in order[:total - sum(s)]:
        s[i] += 1
    s = [max(x, minimum) for x in s]
    while sum(s) > total:  # only after lifting: take back from the most over-served layer above the minimum
        over = [i for i in range(len(s)) if s[i] > minimum]
        s[min(over, key=lambda i: (quota[i] - s[i], i))] -= 1
    return s
