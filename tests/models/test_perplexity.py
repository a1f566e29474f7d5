"""Real-text NLL: chunking, prefill + decode scoring against one full forward pass, the report."""

from __future__ import annotations

import math

import pytest
import torch

from calib.perplexity import NllResult, chunk_nll, nll_report, real_text_path, text_chunks
from calib.models import random_model
from tests.models.helpers import LLAMA_ARCH


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_model("llama", LLAMA_ARCH, seed=5)


def _reference_nll(model: torch.nn.Module, ids: list[int]) -> float:
    """Mean cross entropy of every next-token prediction from one plain forward pass (float64)."""
    logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean"))


@pytest.mark.parametrize("decode_tokens", [0, 1, 7])
def test_prefill_plus_decode_equals_one_forward_pass(model, decode_tokens):
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    res = chunk_nll(model, ids, decode_tokens)
    assert res.tokens_prefill + res.tokens_decode == 39 and res.tokens_decode == decode_tokens
    assert res.summary()["nll"] == pytest.approx(_reference_nll(model, ids), rel=1e-5)


def test_uniform_predictions_cost_log_vocab(model):
    flat = random_model("llama", LLAMA_ARCH, seed=5)
    with torch.no_grad():
        flat.lm_head.weight.zero_()  # every logit 0: each prediction has probability 1/V
    res = chunk_nll(flat, list(range(3, 23)), decode_tokens=4).summary()
    v = LLAMA_ARCH["vocab_size"]
    assert res["nll"] == pytest.approx(math.log(v)) and res["ppl"] == pytest.approx(v)
    assert res["nll_prefill"] == pytest.approx(math.log(v)) and res["nll_decode"] == pytest.approx(math.log(v))


class _WordTok:
    """Whitespace tokenizer over "w<i>" words; ``bos`` is added by default when given."""

    def __init__(self, bos: int | None) -> None:
        self.bos_token_id = bos

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict:
        ids = [int(w[1:]) if w.startswith("w") else 99 for w in text.split()]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids}


def test_chunks_are_consecutive_and_drop_the_remainder():
    text = " ".join(f"w{i}" for i in range(10, 33))  # 23 tokens
    assert text_chunks(_WordTok(None), text, 10) == [list(range(10, 20)), list(range(20, 30))]
    assert text_chunks(_WordTok(None), text, 10, max_chunks=1) == [list(range(10, 20))]
    with_bos = text_chunks(_WordTok(1), text, 10)
    assert with_bos == [[1] + list(range(10, 19)), [1] + list(range(19, 28))]


def test_report_gives_the_relative_increase():
    dense = NllResult(nll_sum_prefill=20.0, tokens_prefill=10, nll_sum_decode=6.0, tokens_decode=2, chunks=1)
    sparse = NllResult(nll_sum_prefill=21.0, tokens_prefill=10, nll_sum_decode=6.6, tokens_decode=2, chunks=1)
    r = nll_report(dense, sparse)
    assert r["nll_dense"] == pytest.approx(26 / 12) and r["nll_sparse"] == pytest.approx(27.6 / 12)
    assert r["nll_increase"] == pytest.approx(27.6 / 26 - 1)
    assert r["nll_increase_prefill"] == pytest.approx(0.05) and r["nll_increase_decode"] == pytest.approx(0.1)
    assert r["nll_tokens"] == 12 and "nll_sparse" not in nll_report(dense, None)


def test_the_shipped_text_is_long_plain_english():
    text = real_text_path().read_text(encoding="utf-8")
    assert len(text) > 400_000 and text.isascii()
    assert "Anne Elliot" in text and "Captain Wentworth" in text
