"""The book source: a disjoint split by book and by phrasing, fitted lengths, needles, determinism,
the synthetic mixture, the shipped files' hashes and one-line errors."""

from __future__ import annotations

import gzip
import hashlib
import re
import shutil

import pytest

from calib.data import EVAL_NEEDS, build_prompts, check_data, dataset_hash, evaluation_prompts
from calib.data import corpus
from calib.data.books import PHRASE_NOUNS, PHRASING, SURNAMES, TITLES, WORDS
from calib.data.prompt import PromptFormatter
from calib.data.synthetic import TASK_FUNCTIONS, TASKS
from calib.errors import UserError

NEEDLE_TASKS = ["book_needle", "book_needle_word", "book_needle_phrase", "book_multineedle"]
SURNAME = re.compile(r"\b(" + "|".join(SURNAMES) + r")\b")


def books(**kw):
    base = {"source": "books", "tasks": NEEDLE_TASKS, "lengths": [512], "num_prompts": 4, "seed": 11,
            "synthetic_share": 0.0, "synthetic_tasks": ["niah_single", "niah_multikey"]}
    base.update(kw)
    return base


NEEDLE = re.compile("|".join(
    re.escape(t).replace(r"\{key\}", "(?:" + "|".join(map(re.escape, TITLES)) + ") " + SURNAME.pattern)
    .replace(r"\{value\}", "[^.]+?")
    for pool in PHRASING.values() for ph in pool.values() for t in ph.needles))


def needle_spans(context: str) -> list[tuple[int, int]]:
    return [m.span() for m in NEEDLE.finditer(context)]


def flat(text: str) -> str:
    return " ".join(text.split())


def context_of(p) -> str:
    """The passage with its needles: what precedes the question (tiny tokenizer: no chat template)."""
    return p.text.rsplit("\n\nQuestion: ", 1)[0] if p.answer else p.text


@pytest.fixture(scope="module")
def raw_books() -> dict[str, str]:
    """Each book's text straight from its gzip file, whitespace collapsed (independent of the parser)."""
    return {name: flat(gzip.decompress((corpus.texts_dir() / f"{name}.txt.gz").read_bytes()).decode())
            for name in corpus.BOOKS}


@pytest.fixture(scope="module")
def prompt_sets(tiny_tokenizer):
    cfg = books(tasks=[*NEEDLE_TASKS, "book_text"], lengths=[512, 1024], num_prompts=4)
    return {purpose: build_prompts(cfg, tiny_tokenizer, purpose=purpose) for purpose in corpus.SPLIT}


def _one_line_error(fn, *args, match: str, **kw) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_split_names_every_book_once():
    calibration, evaluation = corpus.SPLIT["calibration"], corpus.SPLIT["evaluation"]
    assert set(calibration).isdisjoint(evaluation)
    assert sorted(calibration + evaluation) == sorted(corpus.BOOKS)
    assert {corpus.BOOKS[b].title for b in calibration} == {"Sense and Sensibility", "Mansfield Park", "Emma"}


@pytest.mark.parametrize("purpose", ["calibration", "evaluation"])
def test_passages_come_only_from_their_own_books(purpose, prompt_sets, raw_books):
    other = "evaluation" if purpose == "calibration" else "calibration"
    found = 0
    for p in prompt_sets[purpose]:
        context = flat(context_of(p))
        for start in range(0, len(context) - 200, 100):
            window = context[start:start + 200]
            assert not any(window in raw_books[b] for b in corpus.SPLIT[other]), (p.prompt_id, window)
            if not any(a < start + 200 and start < b for a, b in needle_spans(context)):  # the book's own text
                assert any(window in raw_books[b] for b in corpus.SPLIT[purpose]), (p.prompt_id, window)
                found += 1
    assert found > 10 * len(prompt_sets[purpose])


def _phrases(purpose: str) -> list[str]:
    return [t for ph in PHRASING[purpose].values() for t in [*ph.needles, *(x for q in ph.questions for x in q)]]


def _grams(text: str, n: int = 4) -> set[tuple[str, ...]]:
    words = re.findall(r"\{\w+\}|[a-z]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _synthetic_phrasing() -> list[str]:
    out = []
    for task in TASKS:
        inst = TASK_FUNCTIONS[task](5, 30)
        for q in inst.queries[:1]:
            out += [q.question, q.prefix, *q.evidence]
    return out


def test_phrasing_pools_share_no_four_words():
    calibration, evaluation = _phrases("calibration"), _phrases("evaluation")
    assert len(calibration) >= 18 and len(evaluation) >= 18  # 3 kinds x (3 needles + 3 questions + 3 prefixes)
    calib_grams = set().union(*map(_grams, calibration))
    assert not calib_grams & set().union(*map(_grams, evaluation))
    synthetic = set().union(*map(_grams, _synthetic_phrasing()))
    assert synthetic and not synthetic & (calib_grams | set().union(*map(_grams, evaluation)))
    assert not any("magic" in t for t in calibration + evaluation)


@pytest.mark.parametrize("purpose", ["calibration", "evaluation"])
def test_prompts_use_their_own_phrasing(purpose, prompt_sets):
    other = "evaluation" if purpose == "calibration" else "calibration"
    ours = [re.escape(q).replace(r"\{key\}", ".+") for ph in PHRASING[purpose].values() for q, _ in ph.questions]
    theirs = [re.escape(q).replace(r"\{key\}", ".+") for ph in PHRASING[other].values() for q, _ in ph.questions]
    for p in prompt_sets[purpose]:
        if p.answer:
            question = p.text.rsplit("\nQuestion: ", 1)[1].split("\n")[0]
            assert any(re.fullmatch(q, question) for q in ours) and not any(re.fullmatch(q, question) for q in theirs)


def test_lengths_fit_and_stay_close(prompt_sets, tiny_tokenizer):
    fmt = PromptFormatter(tiny_tokenizer)
    gaps = []
    for p in prompt_sets["calibration"] + prompt_sets["evaluation"]:
        assert len(p.input_ids) <= p.length and p.input_ids == fmt.encode(p.text), p.prompt_id
        assert p.length - len(p.input_ids) < 0.3 * p.length, p.prompt_id
        gaps.append((p.length - len(p.input_ids)) / p.length)
    assert sorted(gaps)[len(gaps) // 2] < 0.05


def test_one_more_sentence_would_not_fit(prompt_sets, tiny_tokenizer):
    fmt = PromptFormatter(tiny_tokenizer)
    for p in (q for q in prompt_sets["evaluation"] if q.task == "book_text"):
        book = next(b for b in corpus.books_for("evaluation") if p.text in b.text)
        end = book.text.index(p.text) + len(p.text)
        j = int((book.ends == end).nonzero()[0][0])  # the passage ends at sentence j's end
        longer = book.text[book.text.index(p.text):int(book.ends[j + 1])]
        assert len(fmt.encode(longer)) > p.length, p.prompt_id


@pytest.mark.parametrize("tok_name", ["bpe_tokenizer", "chat_tokenizer"])
def test_other_tokenizers_fit(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    prompts = build_prompts(books(lengths=[700], num_prompts=2), tok, purpose="evaluation")
    for p in prompts:
        assert len(p.input_ids) <= 700 and len(p.input_ids) > 0.7 * 700
        assert p.input_ids == PromptFormatter(tok).encode(p.text)
        if tok_name == "chat_tokenizer":
            assert p.text.startswith("<|bos|><|start|>user<|sep|>") and "<|start|>assistant<|sep|>" in p.text
            assert p.input_ids.count(tok.bos_token_id) == 1


def _keys_in(context: str) -> list[str]:
    return SURNAME.findall(context)


@pytest.mark.parametrize("purpose", ["calibration", "evaluation"])
def test_single_needle_answer_occurs_once(purpose, prompt_sets):
    needles = [p for p in prompt_sets[purpose] if p.task.startswith("book_needle")]
    assert needles
    for p in needles:
        context = context_of(p)
        assert len(re.findall(rf"(?<!\w){re.escape(p.answer)}(?!\w)", context)) == 1, p.prompt_id
        assert context.count(p.answer) == 1
        (key,) = _keys_in(context)
        assert key in p.text.rsplit("Question: ", 1)[1]  # the question asks about the needle's person
        sentence = next(s for s in re.split(r"(?<=[.!?\"])\s+", context) if key in s)
        assert p.answer in sentence


def test_multineedle_asks_one_of_four(prompt_sets):
    multi = [p for ps in prompt_sets.values() for p in ps if p.task == "book_multineedle"]
    assert multi
    for p in multi:
        context, question = context_of(p), p.text.rsplit("Question: ", 1)[1]
        keys = _keys_in(context)
        assert len(keys) == 4 and len(set(keys)) == 4, p.prompt_id
        assert len(needle_spans(context)) == 4
        asked = [k for k in keys if k in question]
        assert len(asked) == 1
        assert context.count(p.answer) == 1
        sentence = next(s for s in re.split(r"(?<=[.!?\"])\s+", context) if asked[0] in s)
        assert p.answer in sentence


def test_needle_depths_spread(tiny_tokenizer):
    prompts = build_prompts(books(tasks=["book_needle"], lengths=[1024], num_prompts=40), tiny_tokenizer)
    depths = []
    for p in prompts:
        context = context_of(p)
        depths.append(context.index(p.answer) / len(context))
    assert min(depths) < 0.2 and max(depths) > 0.8
    assert sum(0.35 < d < 0.65 for d in depths) >= 5
    assert all(0.0 < d < 1.0 for d in depths)


def test_words_and_keys_absent_from_every_book(raw_books):
    """What makes the answer unique: no book has a pool word, an invented surname, or 5 digits in a row."""
    for name, text in raw_books.items():
        words = set(re.findall(r"[a-z]+", text.lower()))
        assert not words & {w.lower() for w in (*SURNAMES, *WORDS, *PHRASE_NOUNS)}, name
        assert not re.search(r"\d{5}", text), name


def test_deterministic_and_seed_dependent(tiny_tokenizer):
    a = build_prompts(books(num_prompts=2), tiny_tokenizer)
    b = build_prompts(books(num_prompts=2), tiny_tokenizer)
    assert [(p.prompt_id, p.text, p.answer, p.input_ids) for p in a] == [(p.prompt_id, p.text, p.answer, p.input_ids)
                                                                          for p in b]
    assert [p.prompt_id for p in a] == [f"{t}-512-s11-{i}" for t in NEEDLE_TASKS for i in range(2)]
    c = build_prompts(books(num_prompts=2, seed=12), tiny_tokenizer)
    assert dataset_hash(c) != dataset_hash(a) and all(x.text != y.text for x, y in zip(a, c))
    one = build_prompts(books(num_prompts=1), tiny_tokenizer)  # prompt i does not depend on the count asked
    assert [p.text for p in one] == [a[2 * i].text for i in range(len(NEEDLE_TASKS))]


def test_synthetic_share_mixes_calibration_only(tiny_tokenizer):
    cfg = books(tasks=["book_needle", "book_multineedle"], synthetic_share=0.25, num_prompts=4)  # 2 x 4: 2 replaced
    mixed = build_prompts(cfg, tiny_tokenizer)
    tasks = [p.task for p in mixed]
    assert len(mixed) == 8 and tasks.count("niah_single") == 1 and tasks.count("niah_multikey") == 1
    assert tasks.count("book_needle") == 3 and tasks.count("book_multineedle") == 3
    held = build_prompts(cfg, tiny_tokenizer, purpose="evaluation")
    assert sorted(p.task for p in held) == sorted(["book_needle", "book_multineedle"] * 4)
    everything = build_prompts(books(tasks=["book_needle", "book_multineedle"], synthetic_share=1.0, num_prompts=2),
                               tiny_tokenizer)
    plain = build_prompts({"source": "synthetic", "tasks": ["niah_single", "niah_multikey"], "lengths": [512],
                           "num_prompts": 2, "seed": 11}, tiny_tokenizer)
    assert [(p.prompt_id, p.text) for p in everything] == [(p.prompt_id, p.text) for p in plain]


def test_shipped_files_verify():
    for name, book in corpus.BOOKS.items():
        data = gzip.decompress((corpus.texts_dir() / f"{name}.txt.gz").read_bytes())
        assert hashlib.sha256(data).hexdigest() == book.sha256
        assert corpus.read_book(name) == data.decode("utf-8")
    # the shipped Persuasion is the text calib.perplexity reads
    persuasion = corpus.texts_dir().parent / "persuasion.txt"
    assert corpus.read_book("persuasion") == persuasion.read_text(encoding="utf-8")


@pytest.fixture
def texts_copy(tmp_path, monkeypatch):
    copy = tmp_path / "austen"
    shutil.copytree(corpus.texts_dir(), copy)
    monkeypatch.setattr(corpus, "texts_dir", lambda: copy)
    return copy


def test_corrupt_missing_or_altered_file_refused(texts_copy, tiny_tokenizer):
    path = texts_copy / "persuasion.txt.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    _one_line_error(corpus.read_book, "persuasion", match="persuasion.txt.gz is corrupt")
    _one_line_error(build_prompts, books(), tiny_tokenizer, purpose="evaluation", match="is corrupt")
    _one_line_error(check_data, books(), EVAL_NEEDS, match="is corrupt")
    build_prompts(books(num_prompts=1), tiny_tokenizer)  # calibration does not read Persuasion

    altered = corpus.read_book("emma").replace("Emma", "Emmy", 1)
    (texts_copy / "emma.txt.gz").write_bytes(gzip.compress(altered.encode("utf-8")))
    _one_line_error(corpus.read_book, "emma", match="not the shipped Emma")

    (texts_copy / "northangerabbey.txt.gz").unlink()
    _one_line_error(corpus.read_book, "northangerabbey", match="northangerabbey.txt.gz is missing")


@pytest.mark.parametrize("override,match", [
    ({"tasks": ["book_needle", "niah_single"]}, "unknown task 'niah_single'"),
    ({"tasks": []}, "empty dataset"),
    ({"lengths": []}, "empty dataset"),
    ({"lengths": [0]}, "positive integers"),
    ({"num_prompts": 0}, "empty dataset"),
    ({"synthetic_share": 1.5}, r"synthetic_share must lie in \[0, 1\]"),
    ({"synthetic_share": -0.1}, r"synthetic_share must lie in \[0, 1\]"),
    ({"synthetic_share": "half"}, r"synthetic_share must lie in \[0, 1\]"),
    ({"synthetic_share": 0.5, "synthetic_tasks": ["book_needle"]}, "synthetic_tasks must name synthetic tasks"),
])
def test_bad_settings_refused(override, match, tiny_tokenizer):
    _one_line_error(check_data, books(**override), EVAL_NEEDS, match=match)
    _one_line_error(build_prompts, books(**override), tiny_tokenizer, match=match)


def test_book_text_has_no_answer_and_is_never_scored(tiny_tokenizer):
    check_data(books(), EVAL_NEEDS)
    check_data(books(tasks=["book_text"]), {"calibration": None, "evaluation": None})  # SAAP-style: no answers
    _one_line_error(check_data, books(tasks=["book_text"]), EVAL_NEEDS, match="scores every held-out answer.*book_text")
    plain = build_prompts(books(tasks=["book_text"], num_prompts=1), tiny_tokenizer)
    assert plain[0].answer == "" and "Question:" not in plain[0].text
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"data": books(), "eval": {"seed": 5, "lengths": [512], "num_prompts": 1,
                                                      "tasks": ["book_text"], "cells": None}})
    _one_line_error(evaluation_prompts, cfg, tiny_tokenizer, match="eval.tasks has book_text")


def test_eval_ignores_cells_of_synthetic_tasks(tiny_tokenizer):
    from omegaconf import OmegaConf

    ev = {"seed": 5, "lengths": [512], "num_prompts": 1, "tasks": NEEDLE_TASKS, "cells": ["niah_single@512"]}
    prompts = evaluation_prompts(OmegaConf.create({"data": books(), "eval": ev}), tiny_tokenizer)
    assert sorted(p.task for p in prompts) == sorted(NEEDLE_TASKS)
    ev["cells"] = ["book_needle@512"]
    prompts = evaluation_prompts(OmegaConf.create({"data": books(), "eval": ev}), tiny_tokenizer)
    assert [p.task for p in prompts] == ["book_needle"]


def test_lengths_beyond_the_books_or_too_short(tiny_tokenizer, monkeypatch):
    _one_line_error(build_prompts, books(lengths=[16]), tiny_tokenizer, match="too short for task 'book_needle'")
    monkeypatch.setattr(tiny_tokenizer, "model_max_length", 10**7)
    _one_line_error(build_prompts, books(lengths=[1_000_000]), tiny_tokenizer, purpose="evaluation",
                    match="longer than every evaluation book")


def test_config_composes(tiny_tokenizer):
    from calib.config import compose

    cfg = compose(["data=books", "data.lengths=[512]", "data.num_prompts=1"])
    assert cfg.data.source == "books" and list(cfg.data.tasks) == NEEDLE_TASKS and cfg.data.synthetic_share == 0.0
    check_data(cfg.data, EVAL_NEEDS)
    assert [p.task for p in build_prompts(cfg.data, tiny_tokenizer)] == NEEDLE_TASKS
