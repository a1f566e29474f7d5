"""Synthetic tasks: determinism, length fitting for several tokenizers, answers recoverable from text."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from calib.data import TASKS, build_prompts, dataset_hash
from calib.data.prompt import PromptFormatter
from calib.data.synthetic import FW_TOP, VT_CHAINS, VT_VARIABLES, fit_to_length, frequent_word_counts
from calib.data.vocab import StableRng, name_pool, seed_from

TOKENIZERS = ["tiny_tokenizer", "bpe_tokenizer", "chat_tokenizer"]


def cfg(**kw):
    base = {"source": "synthetic", "tasks": list(TASKS), "lengths": [400], "num_prompts": 2, "seed": 7}
    base.update(kw)
    return base


def tolerance(length: int) -> int:
    return max(math.ceil(0.02 * length), 64)


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_lengths_within_tolerance(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    lengths = [300, 1000, 2600]
    prompts = build_prompts(cfg(lengths=lengths, num_prompts=2), tok)
    assert len(prompts) == len(TASKS) * len(lengths) * 2
    for p in prompts:
        n = len(p.input_ids)
        assert n <= p.length, (p.prompt_id, n)
        assert p.length - n <= tolerance(p.length), (p.prompt_id, n)
        assert p.input_ids == PromptFormatter(tok).encode(p.text)


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_bos_exactly_once(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    uses_bos = tok_name != "bpe_tokenizer"  # the bare BPE adds no BOS and has no template writing one
    for p in build_prompts(cfg(num_prompts=1), tok):
        assert p.input_ids.count(tok.bos_token_id) == (1 if uses_bos else 0)
        if uses_bos:
            assert p.input_ids[0] == tok.bos_token_id


def test_deterministic_and_seed_dependent(tiny_tokenizer):
    a = build_prompts(cfg(), tiny_tokenizer)
    b = build_prompts(cfg(), tiny_tokenizer)
    assert [(p.prompt_id, p.text, p.answer, p.input_ids) for p in a] == \
           [(p.prompt_id, p.text, p.answer, p.input_ids) for p in b]
    assert dataset_hash(a) == dataset_hash(b)
    c = build_prompts(cfg(), tiny_tokenizer, seed=8)
    assert dataset_hash(c) != dataset_hash(a)
    assert all(x.text != y.text for x, y in zip(a, c))


def test_overrides_replace_config(tiny_tokenizer):
    prompts = build_prompts(cfg(), tiny_tokenizer, tasks=["kv_retrieval"], lengths=[200, 300], num_prompts=3)
    assert [(p.task, p.length) for p in prompts] == [("kv_retrieval", 200)] * 3 + [("kv_retrieval", 300)] * 3
    # prompt i does not depend on how many prompts were asked for
    two = build_prompts(cfg(), tiny_tokenizer, tasks=["kv_retrieval"], lengths=[200], num_prompts=2)
    assert [p.text for p in two] == [p.text for p in prompts[:2]]


def test_stable_rng_is_pinned():
    # Hand-computed from PCG64(SeedSequence(1)).random_raw(): pins the stream that dataset hashes depend on.
    import numpy as np

    raw = np.random.PCG64(1).random_raw(2)
    assert StableRng(1).random(2).tolist() == [float(r >> 11) * 2.0**-53 for r in raw.tolist()]
    assert seed_from("a", 1) != seed_from("a", 2)


def _fitted(task, tok, length=700, seed=3):
    return fit_to_length(task, seed_from("test", task, seed), length, PromptFormatter(tok))


@pytest.mark.parametrize("tok_name", ["tiny_tokenizer", "bpe_tokenizer"])
@pytest.mark.parametrize("task", ["niah_single", "niah_multikey"])
def test_niah_needle_once(task, tok_name, request):
    tok = request.getfixturevalue(tok_name)
    for seed in range(4):
        f = _fitted(task, tok, seed=seed)
        inst, q = f.instance, f.instance.queries[0]
        assert f.text.count(q.evidence[0]) == 1
        assert inst.context.count(q.evidence[0]) == 1
        assert q.evidence[0].endswith(f"is {q.answer}.")
        assert len(q.answer) == 7 and q.answer.isdigit()
        key = q.prefix.split()[-2]
        assert inst.context.split().count(key) == 1  # the key occurs only in its needle
        assert f.text.endswith(q.prefix)
        assert len(inst.queries) == (4 if task == "niah_multikey" else 1)
        assert len({qq.answer for qq in inst.queries}) == len(inst.queries)


@pytest.mark.parametrize("n", [1, 2, 5, 300, 1499, 1500, 2000])
def test_kv_asked_key_unique(n):
    from calib.data.synthetic import kv_retrieval

    inst = kv_retrieval(seed_from("kv", n), n)
    q = inst.queries[0]
    key = q.prefix.split('"')[1]
    assert inst.context.count(f'"{key}"') == 1
    assert inst.context.count(f'"{q.answer}"') == 1
    assert f'"{key}": "{q.answer}"' in inst.context
    assert inst.context.count('": "') == n
    for extra in inst.queries[1:]:
        k = extra.prefix.split('"')[1]
        assert inst.context.count(f'"{k}"') == 1 and extra.evidence[0] in inst.context


def test_variable_tracking_chains(tiny_tokenizer):
    for seed in range(4):
        f = _fitted("variable_tracking", tiny_tokenizer, seed=seed)
        ctx = f.instance.context
        assert len(f.instance.queries) == VT_CHAINS
        seen: set[str] = set()
        for q in f.instance.queries:
            names = q.answer.split()
            assert len(names) == VT_VARIABLES and seen.isdisjoint(names)
            seen |= set(names)
            value = q.evidence[0].split("= ")[1].rstrip(".")
            assert q.evidence[0] == f"VAR {names[0]} = {value}." and value in q.prefix
            positions = [ctx.index(s) for s in q.evidence]
            assert positions == sorted(positions)  # each chain appears in assignment order
            for i in range(1, VT_VARIABLES):
                assert ctx.count(f"VAR {names[i]} = VAR {names[i - 1]}.") == 1
            assert ctx.count(value) == 1
        assert ctx.count("VAR ") == VT_CHAINS * (2 * VT_VARIABLES - 1)


@pytest.mark.parametrize("length", [200, 900, 3000])
def test_frequent_words_counts(length, tiny_tokenizer):
    f = _fitted("frequent_words", tiny_tokenizer, length=length)
    words = f.instance.context.split("\n\n", 1)[1].split()
    counts = Counter(words)
    top = f.instance.queries[0].answer.split()
    assert len(top) == FW_TOP
    assert [counts[w] for w in top] == sorted((counts[w] for w in top), reverse=True)
    assert counts[top[0]] > counts[top[1]] > counts[top[2]]
    others = max(c for w, c in counts.items() if w not in top)
    assert counts[top[2]] > others
    assert frequent_word_counts(len(words), len(name_pool()) - FW_TOP) == tuple(counts[w] for w in top)


def test_tiny_vocabulary_covers_prompts(tiny_tokenizer):
    prompts = build_prompts(cfg(lengths=[600], num_prompts=2), tiny_tokenizer)
    for p in prompts:
        assert tiny_tokenizer.unk_token_id not in p.input_ids
        ans = tiny_tokenizer(p.answer, add_special_tokens=False)["input_ids"]
        assert tiny_tokenizer.decode(ans) == p.answer
        assert len(ans) <= 16


def test_chat_template_path(chat_tokenizer):
    p = build_prompts(cfg(tasks=["niah_single"], num_prompts=1), chat_tokenizer)[0]
    assert p.text.startswith("<|bos|><|start|>user<|sep|>")
    assert "<|start|>assistant<|sep|>The special magic number for " in p.text
    assert p.text.endswith(" is")
    plain = build_prompts(cfg(tasks=["niah_single"], num_prompts=1, chat_template=False), chat_tokenizer)[0]
    assert "<|start|>" not in plain.text and plain.text.endswith(" is")


def test_fitting_to_the_context_limit_warns_nothing(tiny_tokenizer, caplog):
    """A prompt fitted to the tokenizer's full context measures longer drafts on the way; transformers'
    "sequence length is longer than the specified maximum" warning is about running a sequence, which
    fitting never does, so it must not reach the user."""
    import logging

    limit = tiny_tokenizer.model_max_length
    with caplog.at_level(logging.WARNING):
        fitted = fit_to_length("niah_single", seed_from("limit", 1), limit, PromptFormatter(tiny_tokenizer))
    assert limit - tolerance(limit) <= len(fitted.input_ids) <= limit
    assert not [r for r in caplog.records if "longer than the specified maximum" in r.getMessage()]
