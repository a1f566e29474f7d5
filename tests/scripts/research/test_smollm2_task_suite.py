"""scripts/research/smollm2_task_suite.py: imports nothing heavy, agrees with `calib eval`'s one-at-a-time answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "research"))

import smollm2_task_suite as suite  # noqa: E402


def test_importing_the_script_pulls_in_no_hydra_omegaconf_mlflow_or_faiss():
    code = ("import sys; sys.path.insert(0, 'scripts/research'); import smollm2_task_suite; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'mlflow', 'faiss'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_wilson_interval_hand_worked():
    lo, hi = suite.wilson(5, 10)  # p = 0.5, n = 10: 0.5 -/+ 1.96 * sqrt(0.025 + 0.0096) / 1.384
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert suite.wilson(0, 4)[0] == 0.0 and suite.wilson(4, 4)[1] == pytest.approx(1.0)


class _P:
    def __init__(self, length: int, n_tokens: int) -> None:
        self.length, self.input_ids = length, [0] * n_tokens


def test_batches_hold_one_length_sorted_by_token_count_and_scale_with_the_budget():
    prompts = [_P(1024, 1020), _P(2048, 2040), _P(1024, 1001), _P(1024, 1024), _P(2048, 2000)]
    groups = suite.batches(prompts, batch_tokens=2048)
    assert [[p.length for p in g] for g in groups] == [[1024, 1024], [1024], [2048], [2048]]
    assert [len(p.input_ids) for p in groups[0]] == [1001, 1020]
    assert [len(p.input_ids) for p in groups[2]] == [2000]


def test_suite_on_tiny_matches_answering_one_prompt_at_a_time(tmp_path, monkeypatch):
    """The batched suite's predictions are `calib eval`'s (one prompt at a time) on the same prompts."""
    from calib.data import build_prompts
    from calib.evaluate import answer_prompts
    from calib.models import load_model

    monkeypatch.setenv("CALIB_HOME", str(tmp_path / "home"))
    out = tmp_path / "suite.json"
    suite.main(["--model", "tiny", "--prompts", "3", "--lengths", "512", "1024", "--tasks", "niah_single",
                "kv_retrieval", "--device", "cpu", "--batch-tokens", "2048", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["cells"]) == {f"{t}@{n}" for t in ("niah_single", "kv_retrieval") for n in (512, 1024)}
    assert result["scoring"] == "exact_match" and result["max_new_tokens"] == 16

    loaded = load_model(suite.model_config("tiny"), device="cpu")
    prompts = build_prompts({"source": "synthetic"}, loaded.tokenizer, seed=suite.EVAL_SEED, lengths=[512, 1024],
                            tasks=["niah_single", "kv_retrieval"], num_prompts=3, purpose="evaluation")
    results = answer_prompts(loaded, prompts, 16)
    one_by_one = sorted((p.task, p.length, p.answer, r.prediction, r.correct) for p, r in zip(prompts, results))
    batched = sorted((r["task"], r["length"], r["answer"], r["prediction"], r["correct"]) for r in result["predictions"])
    assert batched == one_by_one
    for key, cell in result["cells"].items():
        task, length = key.split("@")
        hits = [row[4] for row in one_by_one if row[:2] == (task, int(length))]
        assert cell["n"] == 3 and cell["accuracy"] == pytest.approx(sum(hits) / 3)
    assert result["kept"] == [k for k, c in result["cells"].items() if c["accuracy"] >= 0.5]
