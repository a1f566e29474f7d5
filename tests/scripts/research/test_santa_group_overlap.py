"""scripts/research/santa_group_overlap.py: the per-head, sum and union shares of sampled keys on a
hand-worked example, and a run on the embedded tiny model through the real decode path."""

from __future__ import annotations

import json

import pytest
import torch

from tests.scripts.research.loader import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("santa_group_overlap")


def test_group_overlap_by_hand(script):
    """Two KV heads of two query heads each, four keys. KV head 0: head 0 draws keys {0, 1} (key 1 twice),
    head 1 draws {1, 2}: 2 + 2 = 4 rows loaded per head, 3 as a union. KV head 1: both draw key 3 only:
    2 rows against 1."""
    counts = torch.zeros(1, 4, 4)
    counts[0, 0, [0, 1]] = torch.tensor([1.0, 2.0])
    counts[0, 1, [1, 2]] = 1.0
    counts[0, 2, 3] = 3.0
    counts[0, 3, 3] = 1.0
    got = script.group_overlap(counts, hkv=2)
    assert got["per_head"] == pytest.approx((2 + 2 + 1 + 1) / 4 / 4)
    assert got["sum"] == pytest.approx((4 + 2) / 2 / 4)
    assert got["union"] == pytest.approx((3 + 1) / 2 / 4)
    assert got["union_over_sum"] == pytest.approx((3 / 4 + 1 / 2) / 2)


def test_run_on_the_tiny_model(script, tmp_path):
    """Every sparse-capable layer is probed at the decode step, and the shares are ordered: one head's
    keys <= the union <= the sum = G x one head's (the union can only merge what the heads drew)."""
    out = tmp_path / "overlap.json"
    assert script.main(["--model", "tiny", "--length", "300", "--prompts", "2", "--samples", "16",
                        "--tile", "32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["layers"]) == 4 and result["prompts"] == 2
    for row in result["layers"].values():
        assert 0 < row["per_head"] <= row["union"] + 1e-12 <= row["sum"] + 2e-12
        assert row["sum"] == pytest.approx(4 * row["per_head"])  # tiny: G = 4
        assert 0 < row["union_over_sum"] <= 1
    with pytest.raises(SystemExit):
        script.main(["--model", "tiny", "--length", "1"])
