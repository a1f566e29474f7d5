"""build_prompts' sources and its one-line errors: synthetic, JSONL, HF datasets."""

from __future__ import annotations

import json

import pytest

from calib.data import build_prompts
from calib.errors import UserError


def synthetic(**kw):
    base = {"source": "synthetic", "tasks": ["niah_single"], "lengths": [300], "num_prompts": 1, "seed": 1}
    base.update(kw)
    return base


def _one_line_error(fn, *args, match: str, **kw) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_unknown_task(tiny_tokenizer):
    msg = _one_line_error(build_prompts, synthetic(tasks=["niah_single", "needle"]), tiny_tokenizer,
                          match="unknown task 'needle'")
    assert "kv_retrieval" in msg  # names the choices


@pytest.mark.parametrize("override", [{"num_prompts": 0}, {"tasks": []}, {"lengths": []}])
def test_empty_dataset(override, tiny_tokenizer):
    _one_line_error(build_prompts, synthetic(**override), tiny_tokenizer, match="empty dataset")


def test_length_too_short_and_too_long(tiny_tokenizer):
    _one_line_error(build_prompts, synthetic(lengths=[20]), tiny_tokenizer, match="too short")
    _one_line_error(build_prompts, synthetic(lengths=[20000]), tiny_tokenizer, match="context is 10240")


def test_unknown_source(tiny_tokenizer):
    _one_line_error(build_prompts, synthetic(source="s3"), tiny_tokenizer, match="unknown data.source")


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl(path, **kw):
    base = {"source": "jsonl", "path": str(path), "eval_path": None, "eval_fraction": 0.5, "task": "jsonl",
            "chat_template": None, "num_prompts": None, "tasks": None, "lengths": [1024], "seed": 1}
    base.update(kw)
    return base


def test_jsonl_round_trip(tmp_path, tiny_tokenizer):
    rows = [{"prompt": f"What is the value of the key tomi number {i} ?", "answer": f"lima {i}", "task": "qa"}
            for i in range(40)]
    rows[3] = {"text": "Question : Answer :", "answer": " 12 ", "length": 99, "id": "custom"}
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    calib = build_prompts(jsonl(path), tiny_tokenizer)
    held = build_prompts(jsonl(path), tiny_tokenizer, purpose="evaluation")
    assert calib and held
    assert {p.text for p in calib}.isdisjoint({p.text for p in held})
    assert len(calib) + len(held) == len(rows)
    everything = {p.prompt_id: p for p in calib + held}
    assert everything["custom"].answer == "12" and everything["custom"].length == 99
    assert everything["custom"].task == "jsonl"
    p = everything["rows-1"]
    assert p.text == rows[0]["prompt"] and p.answer == "lima 0" and p.task == "qa"
    assert p.input_ids[0] == tiny_tokenizer.bos_token_id and p.length == len(p.input_ids)
    capped = build_prompts(jsonl(path), tiny_tokenizer, num_prompts=2)
    assert len([p for p in capped if p.task == "qa"]) == 2


def test_jsonl_eval_path(tmp_path, tiny_tokenizer):
    a = _write_rows(tmp_path / "a.jsonl", [{"prompt": "Question :", "answer": "1"}])
    b = _write_rows(tmp_path / "b.jsonl", [{"prompt": "Answer :", "answer": "2"}])
    cfg = jsonl(a, eval_path=str(b))
    assert [p.answer for p in build_prompts(cfg, tiny_tokenizer)] == ["1"]
    assert [p.answer for p in build_prompts(cfg, tiny_tokenizer, purpose="evaluation")] == ["2"]


def test_jsonl_chat_template(tmp_path, chat_tokenizer):
    path = _write_rows(tmp_path / "rows.jsonl", [{"prompt": "hello", "answer": "x"}])
    p = build_prompts(jsonl(path, eval_path=str(path)), chat_tokenizer)[0]
    assert p.text == "<|bos|><|start|>user<|sep|>hello<|end|><|start|>assistant<|sep|>"
    assert p.input_ids.count(chat_tokenizer.bos_token_id) == 1


def test_jsonl_errors(tmp_path, tiny_tokenizer):
    _one_line_error(build_prompts, jsonl(tmp_path / "missing.jsonl"), tiny_tokenizer, match="not found")
    _one_line_error(build_prompts, jsonl(None), tiny_tokenizer, match="data.path")
    empty = _write_rows(tmp_path / "empty.jsonl", [])
    _one_line_error(build_prompts, jsonl(empty), tiny_tokenizer, match="empty dataset")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\nnot json\n')
    _one_line_error(build_prompts, jsonl(bad), tiny_tokenizer, match="bad.jsonl:2")
    nofield = _write_rows(tmp_path / "nofield.jsonl", [{"question": "a"}])
    _one_line_error(build_prompts, jsonl(nofield), tiny_tokenizer, match="prompt")


def test_jsonl_missing_mandatory_omegaconf(tiny_tokenizer):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"source": "jsonl", "path": "???", "num_prompts": None})
    _one_line_error(build_prompts, cfg, tiny_tokenizer, match="data.path")


def hf(path, **kw):
    base = {"source": "hf", "name": "json", "config": None, "data_files": str(path), "split": "train",
            "eval_split": None, "eval_fraction": 0.5, "question_field": "question", "answer_field": "answer",
            "answer_regex": r"####\s*([-0-9.,]+)", "prompt_template": "Q: {question}", "answer_prefix": "",
            "task": "gsm8k", "truncate_to_lengths": False, "chat_template": None, "num_prompts": None}
    base.update(kw)
    return base


def test_hf_local_json(tmp_path, tiny_tokenizer, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    rows = [{"question": f"q{i}", "answer": f"steps\n#### {1000 + i:,}"} for i in range(12)]
    path = _write_rows(tmp_path / "gsm.jsonl", rows)
    calib = build_prompts(hf(path), tiny_tokenizer)
    held = build_prompts(hf(path), tiny_tokenizer, purpose="evaluation")
    assert len(calib) + len(held) == 12 and {p.text for p in calib}.isdisjoint({p.text for p in held})
    by_text = {p.text: p.answer for p in calib + held}
    assert by_text["Q: q3"] == "1003"
    bad = _write_rows(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no number"}])
    _one_line_error(build_prompts, hf(bad), tiny_tokenizer, match="answer_regex")
    _one_line_error(build_prompts, hf(path, question_field="problem"), tiny_tokenizer, match="no field 'problem'")


def test_hf_offline_cache_miss(tmp_path, tiny_tokenizer, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # the libraries read these flags when first imported; an earlier test may have imported them online,
    # and then the load retries the network for ~20 s before it fails
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = hf(None, name="calib-test/does-not-exist", data_files=None)
    _one_line_error(build_prompts, cfg, tiny_tokenizer, match="could not load HF dataset")


def test_hf_without_datasets(tmp_path, tiny_tokenizer, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kw):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    _one_line_error(build_prompts, hf(tmp_path / "x.jsonl"), tiny_tokenizer, match="pip install")


def test_hf_truncate_to_lengths(tmp_path, tiny_tokenizer, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    doc = " ".join(["The old fox saw the river ."] * 40)  # 281 tokens with BOS
    path = _write_rows(tmp_path / "books.jsonl", [{"text": doc}, {"text": "The fox ."}])
    cfg = hf(path, question_field="text", answer_field=None, answer_regex=None, prompt_template="{question}",
             eval_split="train", truncate_to_lengths=True)
    prompts = build_prompts(cfg, tiny_tokenizer, lengths=[64, 128])
    assert [(p.length, len(p.input_ids)) for p in prompts] == [(64, 64), (128, 128)]
    assert prompts[0].input_ids == prompts[1].input_ids[:64] and prompts[0].answer == ""
    assert prompts[0].text.startswith("The old fox")


def _eval_cfg(cells):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "data": {"source": "synthetic", "lengths": [256, 512], "tasks": ["niah_single", "kv_retrieval"],
                 "num_prompts": 2, "seed": 1},
        "eval": {"seed": 7, "lengths": [256, 512], "tasks": ["niah_single", "kv_retrieval"], "num_prompts": 2,
                 "cells": cells},
    })


def test_eval_cells_keep_only_those_cells_of_the_grid(tiny_tokenizer):
    """A model's kept cells need not form a grid: niah_single at both lengths, kv_retrieval at 256 only;
    the kept prompts are the grid's own (same ids and text), so figures compare with a full-grid eval."""
    from calib.data.sources import evaluation_prompts

    grid = evaluation_prompts(_eval_cfg(None), tiny_tokenizer)
    kept = evaluation_prompts(_eval_cfg(["niah_single@256", "niah_single@512", "kv_retrieval@256"]),
                              tiny_tokenizer)
    assert {(p.task, p.length) for p in grid} == {(t, n) for t in ("niah_single", "kv_retrieval") for n in (256, 512)}
    assert sorted((p.task, p.length) for p in kept) == sorted(
        [("niah_single", 256)] * 2 + [("niah_single", 512)] * 2 + [("kv_retrieval", 256)] * 2)
    by_id = {p.prompt_id: (p.text, p.input_ids) for p in grid}
    assert all(by_id[p.prompt_id] == (p.text, p.input_ids) for p in kept)


def test_eval_cells_fit_only_the_kept_cells(tiny_tokenizer, monkeypatch):
    """Prompts outside ``eval.cells`` are never fitted (building a 5 x 4 grid to keep 3 cells cost more than
    answering them); the ones built are the grid's own."""
    import calib.data.sources as sources

    fitted = []
    real_fit = sources.fit_to_length

    def counting_fit(task, seed, length, fmt):
        fitted.append((task, length))
        return real_fit(task, seed, length, fmt)

    monkeypatch.setattr(sources, "fit_to_length", counting_fit)
    kept = sources.evaluation_prompts(_eval_cfg(["kv_retrieval@512"]), tiny_tokenizer)
    assert fitted == [("kv_retrieval", 512)] * 2
    monkeypatch.setattr(sources, "fit_to_length", real_fit)
    grid = {p.prompt_id: p.input_ids for p in sources.evaluation_prompts(_eval_cfg(None), tiny_tokenizer)}
    assert [grid[p.prompt_id] for p in kept] == [p.input_ids for p in kept]


@pytest.mark.parametrize("cells, message", [(["niah_single-256"], "task@length"), (["niah_single@long"], "task@length"),
                                            (["frequent_words@256"], "match none")])
def test_eval_cells_errors(tiny_tokenizer, cells, message):
    from calib.data.sources import evaluation_prompts

    with pytest.raises(UserError, match=message):
        evaluation_prompts(_eval_cfg(cells), tiny_tokenizer)


def test_take_in_turn_alternates_length_task_groups():
    from types import SimpleNamespace

    from calib.data import take_in_turn

    ps = [SimpleNamespace(length=n, task=t, i=i) for i, (n, t) in
          enumerate([(1, "a"), (1, "a"), (1, "b"), (2, "a"), (1, "a"), (2, "a")])]
    assert [p.i for p in take_in_turn(ps, 10)] == [0, 2, 3, 1, 5, 4]
    assert [p.i for p in take_in_turn(ps, 3)] == [0, 2, 3] and take_in_turn([], 4) == []
