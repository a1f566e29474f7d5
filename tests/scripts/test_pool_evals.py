"""scripts/pool_evals.py: runs of one setting pooled across seeds, paired per prompt."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import pool_evals  # noqa: E402


def _run(seed: int, top_l: int | None, ranking: str | None, dense: list[bool], sparse: list[bool],
         task: str = "niah_single", sel: float = 0.04, artifact: str = "A") -> dict:
    preds = lambda xs: [{"task": task, "length": 8192, "prediction": "x", "correct": c, "stats": {}}  # noqa: E731
                        for c in xs]
    return {"config": {"artifact": artifact, "eval": {"seed": seed, "top_l": top_l, "ranking": ranking}},
            "metrics": {f"{task}@8192.selectivity": sel, "len8192.selectivity": sel},
            "dense_predictions": preds(dense), "sparse_predictions": preds(sparse)}


def test_pooled_counts_and_difference_are_those_of_the_concatenated_prompts():
    # seed 2: 4 prompts, sparse loses 2; seed 1: 2 prompts, sparse wins 1 -> 6 prompts, diff (1 - 2) / 6
    runs = [_run(2, 16, None, [True] * 4, [True, False, False, True], sel=0.05),
            _run(1, 16, "mass", [False, True], [True, True], sel=0.02)]
    (row,) = pool_evals.pool(runs, resamples=500)
    assert row["seeds"] == [1, 2] and row["prompts"] == 6 and row["ranking"] == "mass"
    assert row["dense"] == pytest.approx(5 / 6) and row["sparse"] == pytest.approx(4 / 6)
    assert row["diff"] == pytest.approx(-1 / 6)
    assert (row["sparse_better"], row["sparse_worse"]) == (1, 2)
    assert row["ci_low"] <= row["diff"] <= row["ci_high"]
    assert row["selectivity"] == pytest.approx((2 * 0.02 + 4 * 0.05) / 6)  # weighted by prompts


def test_settings_are_kept_apart_and_identical_runs_give_a_zero_width_interval():
    runs = [_run(1, 16, "density", [True, False], [True, False]),
            _run(1, 32, "density", [True, True], [False, True]),
            _run(1, 16, None, [True, True], [True, True])]
    rows = pool_evals.pool(runs, resamples=200)
    keys = [(r["top_l"], r["ranking"]) for r in rows]
    assert keys == [(16, "density"), (16, "mass"), (32, "density")]
    same = rows[0]
    assert same["diff"] == same["ci_low"] == same["ci_high"] == 0.0
    layered = [_run(1, None, None, [True], [False]), _run(1, None, None, [True], [True]),
               _run(2, None, None, [True], [True])]
    layered[1]["config"]["eval"]["top_l_layers"] = {"3": 192, "1": 8}  # JSON keys are strings
    layered[2]["config"]["eval"]["top_l_layers"] = {"1": 8, "3": 192}  # the same map, another order
    rows = pool_evals.pool(layered, resamples=200)
    assert [(r["top_l_layers"], r["seeds"]) for r in rows] == [("", [1]), ("1:8,3:192", [1, 2])]
    # an artifact's own per-layer default (no eval override) is read from the runtime record and pools with
    # the same operating point given as overrides
    default = [_run(3, None, None, [True], [True]), _run(4, 16, None, [True], [False])]
    default[0]["runtime"] = {"top_l": 16, "top_l_layers": {"3": 192}, "ranking": "mass"}
    default[1]["config"]["eval"]["top_l_layers"] = {"3": 192}
    (row,) = pool_evals.pool(default, resamples=200)
    assert (row["top_l"], row["top_l_layers"], row["seeds"]) == (16, "3:192", [3, 4])


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="do not pair"):
        pool_evals.pool([_run(1, 16, None, [True, True], [True])])
    with pytest.raises(ValueError, match="seed repeated"):
        pool_evals.pool([_run(1, 16, None, [True], [True]), _run(1, 16, None, [False], [False])])
    bad = _run(1, 16, None, [True], [True])
    bad["sparse_predictions"][0]["task"] = "kv_retrieval"
    with pytest.raises(ValueError, match="order differs"):
        pool_evals.pool([bad])


def test_cli_writes_summary_and_per_prompt_records(tmp_path, capsys):
    files = []
    for i, run in enumerate([_run(5, 16, None, [True, True], [True, False]), _run(6, 16, None, [True], [True])]):
        f = tmp_path / f"{i}.json"
        f.write_text(json.dumps(run))
        files.append(str(f))
    out = tmp_path / "pooled.json"
    assert pool_evals.main(files + ["--out", str(out), "--resamples", "200"]) == 0
    data = json.loads(out.read_text())
    assert data["summary"][0]["prompts"] == 3 and data["summary"][0]["sparse_worse"] == 1
    assert [r["seed"] for r in data["runs"]] == [5, 6]
    assert data["runs"][0]["prompts"][1] == {"task": "niah_single@8192", "dense": True, "sparse": False}
    assert "niah_single@8192" in capsys.readouterr().out
