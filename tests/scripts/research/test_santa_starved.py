"""scripts/research/santa_starved.py: the starved-budget choice and the result-line reader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "research"))

import santa_starved as S  # noqa: E402


def _pt(r: float, schedule: list[int]) -> dict:
    return {"reward": r, "ci_low": r - 0.05, "ci_high": r + 0.05, "n": 500.0, "schedule": schedule}


def test_choice_is_inside_the_band_nearest_its_middle_and_never_one_per_layer():
    table = {2048: {"1": _pt(0.5, [1, 1]), "2": _pt(0.8, [2, 2]), "4": _pt(0.95, [4, 4]), "dense": _pt(0.5, None)},
             4096: {"1": _pt(0.2, [1, 1]), "2": _pt(0.35, [2, 2]), "4": _pt(0.62, [4, 4]),
                    "dense": _pt(0.99, None)}}
    # 2048/1 sits at the middle but leaves nothing to reallocate; dense is not a budget
    assert S.choose(table, 0.3, 0.7) == (4096, 8)  # |0.62 - 0.5| < |0.35 - 0.5|; N = 4 x 2 layers
    table[4096]["8"] = _pt(0.38, [8, 8])  # as near the middle as 0.62: the larger N wins the tie
    assert S.choose(table, 0.3, 0.7) == (4096, 16)
    assert S.choose({512: {"2": _pt(0.9, [2, 2]), "4": _pt(0.99, [4, 4])}}, 0.3, 0.7) is None


def test_choice_takes_total_budgets_between_l_and_2l_but_not_placements():
    table = {2048: {"1": _pt(0.2, [1, 1, 1]), "2": _pt(0.9, [2, 2, 2]), "N4": _pt(0.45, [2, 1, 1]),
                    "N4:1-1-2": _pt(0.5, [1, 1, 2]), "N4:mean": _pt(0.5, None), "N5": _pt(0.75, [2, 2, 1])}}
    assert S.choose(table, 0.3, 0.7) == (2048, 4)
    del table[2048]["N4"]
    assert S.choose(table, 0.3, 0.7) is None  # placements and means are reports, not candidates


def test_last_json_line_skips_progress_noise():
    out = 'loading\n{"a": 1}\nprogress 100%\n{"uniform_reward": {"2": 3}}\n\n'
    assert S.last_json(out) == {"uniform_reward": {"2": 3}}
    with pytest.raises(ValueError, match="no JSON"):
        S.last_json("nothing here\n[1, 2]\n")
