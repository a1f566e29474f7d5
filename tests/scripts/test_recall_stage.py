"""scripts/recall_stage.py: the recall batches say what they mean, stages parse strictly, a stage learns, and
train_tiny.py runs the stages (alone with --recall-only, skipped after --init-from)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import recall_stage as R  # noqa: E402


@pytest.fixture(scope="module")
def tokens():
    return R.RecallTokens.tiny()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _parse_lines(ids: list[int], fmt: str, tokens, n: int, count: int) -> tuple[list, list]:
    """(context pairs, recall pairs) read back from the ids by the format's layout (K before V in all)."""
    layout, digits = R.parse_format(fmt)
    line, d = R.LAYOUTS[layout], max(digits, 1)
    width = len(line) - 1 + d
    k_at, v_at = line.index("K"), line.index("V")
    punct = [tokens.punct[t] for t in line if t not in ("K", "V")]

    def read(start: int, lines: int) -> list:
        out = []
        for i in range(lines):
            seg = ids[start + i * width: start + (i + 1) * width]
            out.append((seg[k_at], tuple(seg[v_at: v_at + d])))
            assert [x for j, x in enumerate(seg) if j != k_at and not v_at <= j < v_at + d] == punct
        return out

    assert ids[:2] == [tokens.punct["<s>"], tokens.punct["{"]]
    assert ids[2 + n * width] == tokens.punct["}"]
    return read(2, n), read(3 + n * width, count)


@pytest.mark.parametrize("fmt", ["adjacent", "colon", "json", "json7", "colon3"])
def test_batch_targets_are_the_asked_keys_values(tokens, fmt):
    n, queries = 5, 9
    ids, target = R.make_batch(fmt, n, 3, queries, tokens, _gen(), "cpu")
    digits = R.parse_format(fmt)[1]
    names = set(tokens.names.tolist())
    for row, mask in zip(ids.tolist(), target.tolist()):
        context, recall = _parse_lines(row, fmt, tokens, n, queries)
        mapping = dict(context)
        assert len(mapping) == n and all(k in names for k in mapping)              # distinct name keys
        if digits:
            assert all(v[0] in tokens.lead.tolist() and set(v[1:]) <= set(tokens.cont.tolist())
                       for v in mapping.values())
        else:
            assert not set(v[0] for v in mapping.values()) & set(mapping)         # values are other names
        expected = [t for k, v in recall for t in mapping[k]]                    # asked keys come from the context
        supervised = [row[i + 1] for i, m in enumerate(mask) if m]
        assert supervised == expected and len(supervised) == queries * max(digits, 1)


def test_repeat_supervises_the_copy_but_its_first_token(tokens):
    n = 4
    ids, target = R.make_batch("repeat", n, 2, 99, tokens, _gen(), "cpu")
    for row, mask in zip(ids.tolist(), target.tolist()):
        body = row[2: 2 + 2 * n]
        assert row[3 + 2 * n:] == body
        assert [row[i + 1] for i, m in enumerate(mask) if m] == body[1:]


def test_batches_are_deterministic_per_seed(tokens):
    a = R.make_batch("json7", 6, 4, 8, tokens, _gen(3), "cpu")
    b = R.make_batch("json7", 6, 4, 8, tokens, _gen(3), "cpu")
    c = R.make_batch("json7", 6, 4, 8, tokens, _gen(4), "cpu")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_bad_specs_are_rejected_with_the_known_choices(tokens):
    with pytest.raises(ValueError, match="expected one of"):
        R.RecallStage.parse("formats:jsn")
    with pytest.raises(ValueError, match="fields:"):
        R.RecallStage.parse("stepz:3")
    with pytest.raises(ValueError, match="min_pairs"):
        R.RecallStage.parse("min_pairs:5,max_pairs:2")
    with pytest.raises(ValueError, match="distinct names"):
        R.make_batch("json", 5, 1, 2, tokens, _gen(), "cpu", names=8)
    stage = R.RecallStage.parse("formats:json+json7,steps:12,lr:0.002")
    assert stage.formats == ("json", "json7") and stage.steps == 12 and stage.lr == 0.002
    name, variant, stage = R.parse_variant("B=formats:json,tied:false,init:A,max_pairs:32")
    assert (name, variant.tied, variant.init, stage.formats, stage.max_pairs) == ("B", False, "A", ("json",), 32)
    with pytest.raises(ValueError, match="not a preset"):
        R.parse_variant("nonsense")


def test_a_stage_learns_to_copy_the_only_value(tokens):
    """One pair among 8 names: chance is 1/7; a 2-layer model learns the copy in 60 steps on the CPU."""
    from calib.data.tokenizer import tiny_vocabulary

    model = R.build_model(R.Variant(layers=2), len(tiny_vocabulary()), 0, "cpu")
    stage = R.RecallStage(formats=("adjacent",), steps=60, batch=16, queries=4, min_pairs=1, max_pairs=1, names=8,
                          warmup=10)
    before = R.evaluate_stage(model, ["adjacent"], [1], tokens, torch.device("cpu"), 0, batch=16, queries=4,
                              names=8)["adjacent"][1]
    records = R.train_stage(model, stage, tokens, torch.device("cpu"), 0, lambda m: None, log_every=20)
    after = R.evaluate_stage(model, ["adjacent"], [1], tokens, torch.device("cpu"), 0, batch=16, queries=4,
                             names=8)["adjacent"][1]
    assert [r["step"] for r in records] == [20, 40, 60] and records[-1]["loss"] < records[0]["loss"]
    assert before < 0.3 and after >= 0.9


def test_until_stops_the_stage_once_reached_and_keeps_the_rate_flat(tokens):
    """The copy of the only value (as above) reaches 0.9 well before 400 steps: the stage must stop at the
    first check that sees it, with the learning rate flat after warm-up (no cosine to outrun)."""
    from calib.data.tokenizer import tiny_vocabulary

    model = R.build_model(R.Variant(layers=2), len(tiny_vocabulary()), 0, "cpu")
    stage = R.RecallStage(formats=("adjacent",), steps=400, batch=16, queries=4, min_pairs=1, max_pairs=1, names=8,
                          warmup=10, until=0.9, check_every=10)
    records = R.train_stage(model, stage, tokens, torch.device("cpu"), 0, lambda m: None, log_every=1000)
    checks = [r for r in records if "check_acc" in r]
    assert checks and [r["step"] for r in checks] == list(range(10, 10 * len(checks) + 1, 10))
    assert checks[-1]["reached"] and checks[-1]["check_acc"] >= 0.9 and checks[-1]["step"] < 400
    assert not any(r["reached"] for r in checks[:-1])
    assert records[-1] is checks[-1]  # nothing trained after the check that stopped it
    held_out = R.evaluate_stage(model, ["adjacent"], [1], tokens, torch.device("cpu"), 0, batch=64, queries=4, names=8)
    assert held_out["adjacent"][1] >= 0.85
    assert [stage.lr_at(s) for s in (0, 9, 10, 399)] == [stage.lr / 10, stage.lr, stage.lr, stage.lr]
    cosine = R.RecallStage(steps=400, warmup=10)
    assert cosine.lr_at(9) < cosine.lr and abs(cosine.lr_at(399) - 0.1 * cosine.lr) < 1e-4 * cosine.lr
    with pytest.raises(ValueError, match="until"):
        R.RecallStage(until=1.5)


def _train_tiny(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--smoke", "--device", "cpu",
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow  # ~37 s on the 2-core CI machine: two train_tiny.py runs (a maintainer's script)
def test_train_tiny_recall_only_then_init_from(tmp_path):
    first = tmp_path / "recall"
    proc = _train_tiny("--out", str(first), "--recall-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((first / "training_config.json").read_text())
    assert record["log"] == [] and [s["formats"] for s in record["recall"]["stages"]] == [
        ["adjacent"], ["json", "json7", "colon7"]]
    assert {r["phase"] for r in record["recall"]["log"]} == {"recall0", "recall1"}
    assert set(record["recall"]["eval"]) == {"adjacent", "json", "json7", "colon7"}
    assert (first / "model.safetensors").is_file() and not (first / "eval.json").exists()
    assert proc.stderr.count("saved the weights after recall stage") == 2  # a checkpoint per stage

    second = tmp_path / "tasks"
    proc = _train_tiny("--out", str(second), "--init-from", str(first), "--no-eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((second / "training_config.json").read_text())
    assert record["recall"] is None and record["config"]["recall"] == [] and record["log"]
    assert record["init_from"] == str(first)
    assert record["recall_inherited"]["eval"] == json.loads((first / "training_config.json").read_text())[
        "recall"]["eval"]  # the provenance of the weights travels with them
    first_step, second_step = record["lineage"]  # the whole chain, not only the parent's recall record
    assert first_step["out"] == str(first) and first_step["init_from"] is None and first_step["phases"] == []
    assert [st["formats"] for st in first_step["recall"]] == [["adjacent"], ["json", "json7", "colon7"]]
    assert second_step["out"] == str(second) and second_step["init_from"] == str(first)
    assert second_step["recall"] == [] and [p["name"] for p in second_step["phases"]] == ["short", "long"]

    third = tmp_path / "more"
    proc = _train_tiny("--out", str(third), "--init-from", str(second), "--phases", "extra:1:160:256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((third / "training_config.json").read_text())
    assert [e["out"] for e in record["lineage"]] == [str(first), str(second), str(third)]
    card = (third / "MODEL_CARD.md").read_text()
    assert "trained in 3 steps" in card and "## Lineage" in card
    assert f"3. `{third}` from `{second}`: task phases at peak lr" in card and "extra 1 steps" in card
    (third / "MODEL_CARD.md").unlink()  # --card-only writes the same card again from the two records
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--card-only", str(third)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (third / "MODEL_CARD.md").read_text() == card.replace(
        card[card.index(" s on "):card.index(".\n", card.index(" s on "))],
        card[card.index(" s on "):card.index(" (", card.index(" s on "))])  # only the script's wall time is not kept


def test_train_tiny_stops_when_a_recall_stage_misses_its_target(tmp_path):
    out = tmp_path / "r"
    proc = _train_tiny("--out", str(out), "--recall-only", "--recall",
                       "formats:adjacent,steps:2,batch:4,queries:4,max_pairs:4,warmup:1,until:1.0,check_every:1;"
                       "formats:json,steps:2,batch:4,queries:4,max_pairs:4,warmup:1")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: recall stage 0 (adjacent) did not reach 1.0") and "another --seed" in last
    record = json.loads((out / "training_config.json").read_text())  # the checkpoint before the stop
    assert record["recall"]["completed_stages"] == 1 and record["recall"]["stages"][0]["reached"] is False
    assert (out / "model.safetensors").is_file()


def test_train_tiny_bad_recall_spec_is_one_line(tmp_path):
    proc = _train_tiny("--out", str(tmp_path / "x"), "--recall", "formats:jsn", timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --recall: recall format 'jsn'")
