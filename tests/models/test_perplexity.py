"""Real-text NLL: chunking, batched prefill + decode scoring against one full forward pass per chunk and
against each chunk scored alone, the token budget, the progress bar, the report."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from calib import perplexity
from calib.perplexity import NllResult, batch_nll, chunk_nll, mean_nll, nll_report, real_text_path, text_chunks
from calib.models import random_model
from tests.models.helpers import LLAMA_ARCH


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_model("llama", LLAMA_ARCH, seed=5, dtype=torch.float64)


def _rows(count: int, length: int = 40, seed: int = 1) -> list[list[int]]:
    return torch.randint(3, 128, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference_sums(model: torch.nn.Module, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    """Summed cross entropy of the prefill part's and the decode part's next-token predictions, both from
    one plain forward pass over the whole chunk (float64): teacher forcing needs no cache."""
    logits = model(torch.tensor([ids])).logits[0, :-1].double()  # [T - 1, V]: position i predicts ids[i + 1]
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    split = len(ids) - decode_tokens - 1  # predictions made inside the prefill
    return float(ce[:split].sum()), float(ce[split:].sum())


@pytest.mark.parametrize("rows", [1, 3], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("decode_tokens", [0, 1, 7], ids=lambda d: f"decode{d}")
def test_prefill_plus_decode_equals_one_forward_pass(model, rows, decode_tokens):
    chunks = _rows(rows)
    res = batch_nll(model, chunks, decode_tokens)
    sums = [_reference_sums(model, ids, decode_tokens) for ids in chunks]
    assert res.chunks == rows and res.tokens_decode == rows * decode_tokens
    assert res.tokens_prefill == rows * (39 - decode_tokens)
    assert res.nll_sum_prefill == pytest.approx(sum(s[0] for s in sums), rel=1e-10)
    assert res.nll_sum_decode == pytest.approx(sum(s[1] for s in sums), rel=1e-10, abs=1e-12)


def test_a_batch_scores_each_row_as_it_would_alone(model):
    chunks = _rows(3, seed=2)
    batched = batch_nll(model, chunks, decode_tokens=5)
    alone = NllResult()
    for ids in chunks:
        alone.add(chunk_nll(model, ids, decode_tokens=5))
    assert (batched.tokens_prefill, batched.tokens_decode, batched.chunks) == (alone.tokens_prefill,
                                                                               alone.tokens_decode, 3)
    assert batched.nll_sum_prefill == pytest.approx(alone.nll_sum_prefill, rel=1e-12)
    assert batched.nll_sum_decode == pytest.approx(alone.nll_sum_decode, rel=1e-12)


def test_chunks_of_different_lengths_are_not_batched(model):
    with pytest.raises(ValueError, match="different lengths"):
        batch_nll(model, [list(range(3, 13)), list(range(3, 14))], decode_tokens=2)


class _Recorder:
    """Stand-in for a method runtime: records the decoder calls (rows x tokens) between ``pop_stats`` calls."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.calls: list[tuple[int, int]] = []
        self.drained: list[list[tuple[int, int]]] = []
        self.prefill, self.decode = self, None
        decoder.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.calls.append(tuple(kwargs["input_ids"].shape))

    def pop_stats(self) -> dict[str, float]:
        self.drained.append(self.calls)
        self.calls = []
        return {}


def test_a_token_budget_splits_the_chunks_and_stats_drain_per_batch(model):
    counted = random_model("llama", LLAMA_ARCH, seed=5, dtype=torch.float64)  # its own hook, not the fixture's
    rec = _Recorder(counted.get_decoder())
    chunks = _rows(5, seed=3)
    total = mean_nll(counted, chunks, decode_tokens=4, runtime=rec, batch_tokens=2 * 40 + 39)  # 2 rows fit
    # each batch: one prefill [rows, 36], then 3 decode steps [rows, 1] (the last token needs no call)
    assert rec.drained == [[(r, 36)] + [(r, 1)] * 3 for r in (2, 2, 1)] and rec.calls == []
    alone = NllResult()
    for ids in chunks:
        alone.add(chunk_nll(model, ids, decode_tokens=4))
    assert (total.chunks, total.tokens_prefill, total.tokens_decode) == (5, 5 * 35, 5 * 4)
    assert total.nll_sum_prefill == pytest.approx(alone.nll_sum_prefill, rel=1e-12)
    assert total.nll_sum_decode == pytest.approx(alone.nll_sum_decode, rel=1e-12)


@pytest.mark.parametrize("budget", [0, 39], ids=["off", "below-one-chunk"])
def test_a_budget_below_one_chunk_scores_one_chunk_at_a_time(budget):
    counted = random_model("llama", LLAMA_ARCH, seed=5, dtype=torch.float64)
    rec = _Recorder(counted.get_decoder())
    mean_nll(counted, _rows(2), decode_tokens=1, runtime=rec, batch_tokens=budget)
    assert rec.drained == [[(1, 39)], [(1, 39)]]


def test_the_progress_bar_counts_every_model_call(model, monkeypatch):
    bars = []

    class _Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.disable = total, 0, kwargs.get("disable")
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.n += n

    monkeypatch.setattr(perplexity, "tqdm", _Bar)
    mean_nll(model, _rows(3, length=80), decode_tokens=40, batch_tokens=160)  # batches of 2 and 1: 40 calls each
    mean_nll(model, _rows(1), decode_tokens=3)
    assert [(b.total, b.n) for b in bars] == [(80, 80), (3, 3)]
    assert bars[0].disable is None and bars[1].disable is True  # a few calls: no bar


def test_uniform_predictions_cost_log_vocab():
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


def test_dense_nll_is_computed_once_per_model_chunks_and_settings(calib_home, monkeypatch):
    calls = []

    def fake_mean_nll(model, chunks, decode_tokens, runtime=None, batch_tokens=0):
        calls.append(len(chunks))
        return NllResult(nll_sum_prefill=1.5 * len(chunks), tokens_prefill=10 * len(chunks), nll_sum_decode=0.25,
                         tokens_decode=decode_tokens * len(chunks), chunks=len(chunks))

    def loaded(model_hash="sha256:abc"):
        return SimpleNamespace(facts=SimpleNamespace(model_hash=model_hash, dry_run=False),
                               model=SimpleNamespace(dtype=torch.float32), device=torch.device("cpu"))

    monkeypatch.setattr(perplexity, "mean_nll", fake_mean_nll)
    chunks = [[1, 2, 3, 4], [5, 6, 7, 8]]
    first = perplexity.cached_dense_nll(loaded(), chunks, 2, 64)
    assert perplexity.cached_dense_nll(loaded(), chunks, 2, 64) == first and calls == [2]
    perplexity.cached_dense_nll(loaded(), chunks, 1, 64)  # another decode split: scored again
    perplexity.cached_dense_nll(loaded(), chunks, 2, 8)  # another batching: scored again
    perplexity.cached_dense_nll(loaded(), [[1, 2, 3, 4], [5, 6, 7, 9]], 2, 64)  # another text
    perplexity.cached_dense_nll(loaded("sha256:other"), chunks, 2, 64)  # other weights
    perplexity.cached_dense_nll(loaded(None), chunks, 2, 64)  # no content hash: never cached
    perplexity.cached_dense_nll(loaded(None), chunks, 2, 64)
    assert calls == [2] * 7
