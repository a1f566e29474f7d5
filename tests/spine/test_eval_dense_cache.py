"""``calib eval``'s dense answers are computed once per model, prompt set and decoding settings."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from calib import evaluate
from calib.evaluate import PromptResult, cached_dense_answers, dense_cache_key


def _loaded(model_hash: str | None = "sha256:abc", dry_run: bool = False) -> SimpleNamespace:
    return SimpleNamespace(facts=SimpleNamespace(model_hash=model_hash, dry_run=dry_run),
                           model=SimpleNamespace(dtype=torch.float32), device=torch.device("cpu"), tokenizer=None)


def _prompts(ids: list[list[int]]) -> list[SimpleNamespace]:
    return [SimpleNamespace(task="niah_single", length=len(x), input_ids=x, answer="7", scoring="contains") for x in ids]


def test_key_changes_with_everything_the_answers_depend_on():
    prompts = _prompts([[1, 2, 3], [4, 5, 6]])
    key = dense_cache_key(_loaded(), prompts, 32, 0)
    assert key == dense_cache_key(_loaded(), _prompts([[1, 2, 3], [4, 5, 6]]), 32, 0)
    assert key != dense_cache_key(_loaded("sha256:other"), prompts, 32, 0)
    assert key != dense_cache_key(_loaded(), prompts, 16, 0)
    assert key != dense_cache_key(_loaded(), prompts, 32, 4096)
    assert key != dense_cache_key(_loaded(), prompts, 32, 0, loop="static")
    assert key != dense_cache_key(_loaded(), _prompts([[1, 2, 3], [4, 5, 7]]), 32, 0)
    assert dense_cache_key(_loaded(None), prompts, 32, 0) is None
    assert dense_cache_key(_loaded(dry_run=True), prompts, 32, 0) is None


def test_second_call_reads_the_cache(calib_home, monkeypatch):
    calls = []

    def fake_answer(loaded, prompts, max_new_tokens, runtime=None, desc="dense", batch_tokens=0, loop="eager"):
        calls.append(len(prompts))
        return [PromptResult(p.task, p.length, f"reply {i}", i % 2 == 0, {}) for i, p in enumerate(prompts)]

    monkeypatch.setattr(evaluate, "answer_prompts", fake_answer)
    prompts = _prompts([[1, 2], [3, 4], [5, 6]])
    first = cached_dense_answers(_loaded(), prompts, 8, 0)
    again = cached_dense_answers(_loaded(), prompts, 8, 0)
    assert calls == [3] and again == first
    cached_dense_answers(_loaded(), prompts, 9, 0)  # another budget: answered again
    cached_dense_answers(_loaded(None), prompts, 8, 0)  # no content hash: never cached
    cached_dense_answers(_loaded(None), prompts, 8, 0)
    assert calls == [3, 3, 3, 3]

