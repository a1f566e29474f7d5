"""scripts/research/smollm2_methods.py: the starved-budget pick and the summary table (the runs are GPU work)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    path = ROOT / "scripts" / "research" / "smollm2_methods.py"
    spec = importlib.util.spec_from_file_location("smollm2_methods", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sweep(rewards: dict[str, float]) -> dict[str, dict]:
    return {k: {"reward": v} for k, v in rewards.items()}


def test_starved_budget_is_the_in_band_reward_nearest_the_middle(script):
    got = script.pick_starved_budget(_sweep({"1": 0.05, "2": 0.35, "4": 0.55, "8": 0.9, "dense": 0.95}))
    assert got == {"budget_per_layer": 4, "uniform_reward": 0.55, "in_band": True}


def test_no_budget_in_band_takes_the_nearest_and_says_so(script):
    got = script.pick_starved_budget(_sweep({"1": 0.1, "2": 0.92, "4": 0.95, "dense": 0.96}))
    assert got == {"budget_per_layer": 1, "uniform_reward": 0.1, "in_band": False}
    with pytest.raises(ValueError, match="no budget"):
        script.pick_starved_budget(_sweep({"dense": 0.9}))


def test_summary_table_reads_the_eval_and_run(script):
    rows = {"sale": {"run": {"wall_s": 45.2}, "eval": {
        "metrics": {"dense_acc": 0.86, "sparse_acc": 0.85, "diff": -0.01, "diff_ci_low": -0.03, "diff_ci_high": 0.01,
                    "niah_single@1024.diff_ci_low": -0.02, "niah_multikey@1024.diff_ci_low": -0.07,
                    "len1024.diff_ci_low": -0.05, "nll_increase": 0.0123},
        "summary": {"summary/sparsity": 0.31}}}, "saap": {"run": {"exit_code": 1}}}
    lines = script.summary_table(rows).splitlines()
    assert lines[2] == "| sale | 0.860 | 0.850 | -0.010 [-0.030, +0.010] | -0.070 | 0.310 | +1.23 | 45 |"
    assert lines[3] == "| saap | - | - | - [-, -] | - | - | - | - |"
