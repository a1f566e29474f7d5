"""scripts/santa_starved.py: the starved-budget choice and the result-line reader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import santa_starved as S  # noqa: E402


def _pt(r: float) -> dict:
    return {"reward": r, "ci_low": r - 0.05, "ci_high": r + 0.05, "n": 500.0}


def test_choice_is_inside_the_band_nearest_its_middle_and_never_one_per_layer():
    table = {2048: {"1": _pt(0.5), "2": _pt(0.8), "4": _pt(0.95), "dense": _pt(0.5)},
             4096: {"1": _pt(0.2), "2": _pt(0.35), "4": _pt(0.62), "dense": _pt(0.99)}}
    # 2048/1 sits at the middle but leaves nothing to reallocate; dense is not a budget
    assert S.choose(table, 0.3, 0.7) == (4096, 4)  # |0.62 - 0.5| < |0.35 - 0.5|
    table[4096]["8"] = _pt(0.38)  # as near the middle as 0.62: the larger budget wins the tie
    assert S.choose(table, 0.3, 0.7) == (4096, 8)
    assert S.choose({512: {"2": _pt(0.9), "4": _pt(0.99)}}, 0.3, 0.7) is None


def test_last_json_line_skips_progress_noise():
    out = 'loading\n{"a": 1}\nprogress 100%\n{"uniform_reward": {"2": 3}}\n\n'
    assert S.last_json(out) == {"uniform_reward": {"2": 3}}
    with pytest.raises(ValueError, match="no JSON"):
        S.last_json("nothing here\n[1, 2]\n")
