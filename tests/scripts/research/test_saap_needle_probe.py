"""scripts/research/saap_needle_probe.py: the needle found in a prompt, and the probe's reads against SAAP's
own invariant (every bucket visited: every needle key read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.research.saap_needle_probe import needle_positions, summarize
from tests.recipe_support import in_calib_home, run_recipe
from tests.saap.test_recipe import ARCH, C, overrides


def test_needle_positions_hand_worked():
    ids = [5, 9, 1, 2, 3, 7, 1, 2, 3, 4]
    assert needle_positions(ids, [1, 2, 3]) == [6, 7, 8]  # the last occurrence
    assert needle_positions(ids, [99, 1, 2, 3]) == [6, 7, 8]  # a leading token the needle lacks is dropped
    assert needle_positions(ids, [42]) == [] and needle_positions(ids, []) == []


def test_summarize_splits_held_and_lost_prompts():
    def rec(lost: bool, read: list[float], mass: list[float]) -> dict:
        return {"lost": lost, "steps": [{"layer": 1, "step": 1, "read": read, "mass": mass}]}

    out = summarize([rec(False, [1.0, 0.5], [0.2, 0.4]), rec(False, [0.0, 0.5], [0.0, 0.2]),
                     rec(True, [0.0, 0.0], [0.6, 0.2])])
    # mass-weighted read, held: (0.2 x 1 + 0.4 x 0.5 + 0 x 0 + 0.2 x 0.5) / (0.2 + 0.4 + 0 + 0.2) = 0.5 / 0.8
    assert out["held"]["1"] == pytest.approx({"read": 0.5, "mass": 0.2, "mass_read": 0.625, "steps": 2})
    assert out["lost"]["1"] == pytest.approx({"read": 0.0, "mass": 0.4, "mass_read": 0.0, "steps": 1})


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from calib.data.tokenizer import build_tiny_backend, save_tiny_tokenizer
    from calib.models import random_model

    model_dir = tmp_path_factory.mktemp("probe_llama")
    vocab = build_tiny_backend().get_vocab_size()
    random_model("llama", {**ARCH, "vocab_size": vocab}, seed=3).save_pretrained(model_dir)
    save_tiny_tokenizer(model_dir)
    home = tmp_path_factory.mktemp("probe_home")
    return model_dir, home, Path(run_recipe(home, overrides(model_dir))["artifact_dir"])


@pytest.mark.parametrize("top_l", [C, 1])
def test_probe_reads_every_needle_key_when_every_bucket_is_visited(artifact, top_l):
    from calib.config import compose
    from scripts.research.saap_needle_probe import probe

    model_dir, home, art = artifact
    cfg = compose(overrides(model_dir, "eval.cells=[niah_single@384]", "eval.num_prompts=2", "eval.max_new_tokens=6",
                            "eval.seed=99", f"eval.top_l={top_l}"))
    result = in_calib_home(home, probe, cfg, str(art))
    rows = [row for rec in result["records"] for row in rec["steps"]]
    assert result["prompts"] == 2 and result["no_needle"] == 0 and rows
    assert all(0.0 <= r <= 1.0 for row in rows for r in row["read"])
    assert all(-1e-6 <= m <= 1.0 + 1e-6 for row in rows for m in row["mass"])
    if top_l == C:
        assert all(r == 1.0 for row in rows for r in row["read"])
    else:  # one bucket of eight: the needle's keys cannot all be read at every step
        assert min(r for row in rows for r in row["read"]) < 1.0


def test_cli_writes_the_records_and_prints_a_row_per_sparse_layer(artifact, tmp_path, capsys):
    import json

    from scripts.research.saap_needle_probe import main

    model_dir, home, art = artifact
    out = tmp_path / "probe.json"
    code = in_calib_home(home, main, ["--artifact", str(art), "--out", str(out), *overrides(
        model_dir, "eval.cells=[niah_single@384]", "eval.num_prompts=1", "eval.max_new_tokens=4", "eval.seed=98")])
    result = json.loads(out.read_text())
    layers = {row["layer"] for rec in result["records"] for row in rec["steps"]}
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert code == 0 and result["prompts"] == 1 and len(table) == len(layers) >= 1
