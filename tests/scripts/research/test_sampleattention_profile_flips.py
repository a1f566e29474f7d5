"""scripts/research/sampleattention_profile_flips.py: its per-task counts and both rules on a hand-worked case."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

import scripts.research.sampleattention_profile_flips as flips


def test_counts_lost_and_gained_answers_and_both_rules_per_task():
    """Task a: dense answers 3 of 4, the point 3 of 4 with one flip each way: the mean rule sees 3/3, the
    retention rule 2/3. Task b: dense answers none: nothing to lose, both rules 1."""
    tasks = ["a", "a", "a", "a", "b", "b"]
    dense = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    sparse = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    evaluator = SimpleNamespace(dense_scores=[SimpleNamespace(score=d) for d in dense], task=lambda i: tasks[i])
    got = flips.per_task(evaluator, sparse)
    assert got["a"] == {"prompts": 4, "dense": 3.0, "sparse": 3.0, "lost": 1, "gained": 1, "mean_rule": 1.0,
                        "retention": pytest.approx(2 / 3)}
    assert got["b"]["lost"] == 0 and got["b"]["gained"] == 1 and got["b"]["mean_rule"] == got["b"]["retention"] == 1.0


def test_a_point_is_three_comma_separated_values():
    assert flips.parse_point("0.8,0.95,2") == flips.GridPoint(0.8, 0.95, 2)
    with pytest.raises(argparse.ArgumentTypeError, match="alpha_c,alpha_s,chunk_n"):
        flips.parse_point("0.8,0.95")
