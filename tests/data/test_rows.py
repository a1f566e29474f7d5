"""Row readers, the held-out checks and check_data: each bad input is one line naming the row."""

from __future__ import annotations

import pytest

from calib.data import build_prompts, check_data
from calib.data.rows import read_jsonl, source_rows
from calib.errors import UserError
from tests.data.source_files import held_out, write_jsonl

ROWS = [{"prompt": f"What is the value of the key tomi number {i} ?", "answer": f"lima {i}"} for i in range(12)]


def jsonl(path, **kw):
    return {"source": "jsonl", "path": str(path), "eval_path": None, "eval_fraction": 0.5, "task": "jsonl",
            "num_prompts": None, "tasks": None, **kw}


def one_line(fn, *args, match: str, **kw) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("line, match", [
    ('["a list"]', "must be a JSON object"),
    ('{"prompt": "  "}', "non-empty string field \"prompt\""),
    ('{"prompt": "a", "answer": ["x", "y"]}', "\"answer\" must be a string or a number"),
    ('{"prompt": "a", "task": 3}', "\"task\" must be a non-empty string"),
    ('{"prompt": "a", "length": 0}', "\"length\" must be a positive integer"),
    ('{"prompt": "a", "length": "long"}', "\"length\" must be a positive integer"),
])
def test_bad_rows_name_their_line(tmp_path, line, match):
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], "", line])
    message = one_line(read_jsonl, path, match=match)
    assert message.startswith(f"{path}:3: ")


def test_answer_forms(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a", "answer": 4}, {"prompt": "b", "answer": None},
                                                 {"prompt": "c"}, {"text": "d", "answer": " x "}])
    assert [r.answer for r in read_jsonl(path)] == ["4", "", "", "x"]


def test_not_utf8(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    one_line(read_jsonl, path, match="not UTF-8")


def test_hash_split_follows_the_documented_rule(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    held = [r.prompt for r in source_rows(jsonl(path), "evaluation")]
    calib = [r.prompt for r in source_rows(jsonl(path), "calibration")]
    assert held == [r["prompt"] for r in ROWS if held_out(r["prompt"])]
    assert calib == [r["prompt"] for r in ROWS if not held_out(r["prompt"])]
    quarter = [r.prompt for r in source_rows(jsonl(path, eval_fraction=0.25), "evaluation")]
    assert quarter == [r["prompt"] for r in ROWS if held_out(r["prompt"], 0.25)]


@pytest.mark.parametrize("fraction", [0, 1, -0.5, "half"])
def test_eval_fraction_range(tmp_path, fraction):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    one_line(source_rows, jsonl(path, eval_fraction=fraction), "evaluation", match="data.eval_fraction")


def test_one_row_cannot_feed_both_parts(tmp_path):
    row = ROWS[0] if held_out(ROWS[0]["prompt"]) else ROWS[1]
    path = write_jsonl(tmp_path / "one.jsonl", [row])
    one_line(source_rows, jsonl(path), "calibration", match="none of the 1 rows .* is left for calibration")


def test_eval_path_overlap_names_both_rows(tmp_path):
    calib = write_jsonl(tmp_path / "calib.jsonl", ROWS[:4])
    held = write_jsonl(tmp_path / "held.jsonl", [ROWS[5], ROWS[2], ROWS[3]])
    message = one_line(source_rows, jsonl(calib, eval_path=str(held)), "evaluation", match="overlap calibration")
    assert f"{held}:2 has the same prompt as {calib}:3" in message and "(2 of 3 held-out rows shared)" in message
    assert [r.answer for r in source_rows(jsonl(calib, eval_path=str(held)), "calibration")] == \
           [r["answer"] for r in ROWS[:4]]


def test_tasks_select_rows(tmp_path, tiny_tokenizer):
    rows = [{**r, "task": "qa" if i % 2 else "kv"} for i, r in enumerate(ROWS)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = jsonl(path, eval_path=str(path))  # calibration: every row of the file
    assert {p.task for p in build_prompts(cfg, tiny_tokenizer, tasks=["qa"])} == {"qa"}
    assert len(build_prompts(cfg, tiny_tokenizer, tasks=["qa"], num_prompts=2)) == 2
    one_line(build_prompts, cfg, tiny_tokenizer, tasks=["niah_single"], match="no row of task niah_single .*kv, qa")


def test_scoring_rule_per_task(tmp_path, tiny_tokenizer):
    rows = [{**r, "task": "qa" if i % 2 else "kv"} for i, r in enumerate(ROWS)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    prompts = build_prompts(jsonl(path, eval_path=str(path), scoring={"qa": "contains"}), tiny_tokenizer)
    assert {(p.task, p.scoring) for p in prompts} == {("qa", "contains"), ("kv", "exact_match")}
    one_line(build_prompts, jsonl(path, eval_path=str(path), scoring="fuzzy"), tiny_tokenizer,
             match="data.scoring must be exact_match or contains")


def test_synthetic_prompts_carry_the_rule(tiny_tokenizer):
    cfg = {"source": "synthetic", "tasks": ["niah_single"], "lengths": [200], "num_prompts": 1, "seed": 1,
           "scoring": "contains"}
    assert [p.scoring for p in build_prompts(cfg, tiny_tokenizer)] == ["contains"]


# ------------------------------------------------------------------------------------------ check_data
def test_check_data_requires_answers_only_where_needed(tmp_path):
    rows = [dict(r) for r in ROWS]
    del rows[7]["answer"]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = jsonl(path, eval_path=str(write_jsonl(tmp_path / "held.jsonl", [{"prompt": "x", "answer": "1"}])))
    check_data(cfg, {"calibration": None, "evaluation": "scored"})
    message = one_line(check_data, cfg, {"calibration": "the reward scores answers"}, match="the reward scores")
    assert f"{path}:8 has no answer (1 of 12 calibration rows lack one)" in message


def test_check_data_skips_synthetic():
    check_data({"source": "synthetic", "tasks": []}, {"calibration": "needs answers"})


def test_sale_needs_answers_only_for_its_ablation():
    from calib.config import compose
    from calib.sale.recipe import data_needs

    def needs(**method):
        values = {"report": "full", "compare_shared_tau": True, "ablation_prompts": 4, **method}
        return data_needs(compose(["+method=sale", *(f"method.{k}={str(v).lower()}" for k, v in values.items())]))

    assert needs()["evaluation"] and needs()["calibration"] is None
    assert needs(ablation_prompts=0)["evaluation"] is None
    assert needs(compare_shared_tau=False)["evaluation"] is None
    assert needs(report="artifact")["evaluation"] is None  # the default report runs no ablation


# ------------------------------------------------------------------------------------------ HF sources
def hf(name, **kw):
    return {"source": "hf", "name": str(name), "config": None, "data_files": None, "split": "train",
            "eval_split": "test", "eval_fraction": 0.5, "question_field": "question", "answer_field": "answer",
            "answer_regex": None, "prompt_template": "Q: {question}", "answer_prefix": "", "task": "qa",
            "num_prompts": None, **kw}


@pytest.fixture
def saved(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = [{"question": f"q{i}", "answer": str(i)} for i in range(6)]
    test = [{"question": "q9", "answer": "9"}, {"question": "q4", "answer": "4"}, {"question": "q8", "answer": ""}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "lone"))
    return tmp_path


def test_hf_save_to_disk_splits(saved):
    rows = source_rows(hf(saved / "saved", eval_split=None, num_prompts=None), "calibration")
    assert [r.prompt for r in rows] == [f"Q: q{i}" for i in range(6) if not held_out(f"Q: q{i}")]
    assert [r.answer for r in source_rows(hf(saved / "saved"), "calibration", limit=2)] == ["0", "1"]
    one_line(source_rows, hf(saved / "saved", split="validation"), "calibration", match="its splits: train, test")


def test_hf_lone_dataset_is_one_split(saved):
    assert len(source_rows(hf(saved / "lone"), "calibration")) == 6
    one_line(source_rows, hf(saved / "lone"), "evaluation", match="one Dataset .*data.eval_split=null")


def test_hf_held_out_split_sharing_a_row(saved):
    message = one_line(source_rows, hf(saved / "saved"), "evaluation", match="overlap calibration")
    assert "split 'test' row 1 has the same 'question' as split 'train' row 4 (1 calibration rows" in message
    assert [r.prompt for r in source_rows(hf(saved / "saved"), "evaluation", limit=1)] == ["Q: q9"]


def test_hf_rows_without_answer(saved):
    message = one_line(check_data, hf(saved / "saved", answer_field=None), {"calibration": "scored"},
                       match="split 'train' row 0 has no answer")
    assert "(6 of 6 calibration rows lack one); set data.answer_field" in message
    one_line(source_rows, hf(saved / "saved", prompt_template="{context} {question}"), "calibration",
             match="may only use {question}")


def test_santa_budget_follows_the_scoring_rule(tiny_tokenizer):
    from calib.data import Prompt
    from calib.santa.reward import RewardSettings, new_token_budgets

    settings = RewardSettings("sys", "flash", 256, ("decode",), questions=2, max_new_tokens=None, cap_new_tokens=16)
    exact = Prompt("a", "t", 10, "q", "1234567", [0])
    wrapped = Prompt("b", "t", 10, "q", "1234567", [0], scoring="contains")
    # 7 digit tokens (the tiny tokenizer splits numbers into digits) + 2; a contains answer may be wrapped
    assert new_token_budgets([exact, wrapped], tiny_tokenizer, settings) == [9, 16]
