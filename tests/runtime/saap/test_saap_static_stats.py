"""SAAP's selectivity statistics in the static-cache loop (runtime_kernels.generate.StaticGenerator).

On CPU the loop runs its steps eagerly (``graphs=False``) through the code a CUDA graph captures; the
counts are checked against a float64 recount from the index's key buckets and the classifier's inputs,
written here without the runtime's ranking. The graphed loop is checked against this one on the GPU
(tests/runtime/test_generate_gpu.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from runtime_kernels import hf
from runtime_kernels.generate import StaticGenerator, round_up
from runtime_kernels.rope import derope_at
from runtime_kernels.saap import SaapDecode, SaapLayerParams
from tests.runtime.saap.through_buckets import SaapThroughBuckets
from tests.runtime.test_generate import C, HKV, LAYERS, _model, _prompt, _saap

RECENT, BUCKET = 8, 8


def _counting_saap(top_l: int) -> SaapDecode:
    """Statistics on and SAAP at every static step, as ``calib eval`` sets them, through the buckets even at
    ℓ = C (where the runtime itself runs dense attention and counts 1)."""
    return SaapThroughBuckets(_saap(top_l, recent=RECENT).layers, top_l=top_l, stats=True)


def _probs64(q_de: torch.Tensor, p: SaapLayerParams) -> torch.Tensor:
    """The classifier in float64: ``q_de [B, Hq, D]`` -> bucket probabilities ``[B, Hq, C]``."""
    h = torch.einsum("bhd,hde->bhe", q_de.double(), p.w1.double()) + p.b1.double()
    h = (h - p.bn_mean.double()) / torch.sqrt(p.bn_var.double() + p.bn_eps) * p.bn_weight.double() + p.bn_bias.double()
    logits = torch.einsum("bhe,hec->bhc", h.relu(), p.w2.double()) + p.b2.double()
    return logits.softmax(-1)


def _recount(p: SaapLayerParams, q_de: torch.Tensor, key_bucket: torch.Tensor, hi: int, valid: int,
             top_l: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Selectivity and selectivity with window ``[B * Hkv]`` of one layer's step: the listed keys are
    positions ``[sink, hi)`` of ``key_bucket [B, Hkv, T]``; the rest of the ``valid`` keys are attended
    densely (sink, window, and the keys a lagging index has not listed yet)."""
    listed = torch.nn.functional.one_hot(key_bucket[..., p.sink:hi].long(), p.num_clusters).sum(-2).double()
    b, hq, _ = q_de.shape
    score = _probs64(q_de, p).view(b, HKV, hq // HKV, -1).sum(2)  # [B, Hkv, C]
    visited = listed.gather(-1, score.topk(top_l, -1).indices).sum(-1)  # [B, Hkv]
    n = hi - p.sink
    return (visited / n).flatten(), ((visited + valid - n) / valid).flatten()


def _spy_on_steps(rt: SaapDecode) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """Record each SAAP layer step's ``(layer, q_de, key_bucket, searchable_hi)`` (copies: the index moves on)."""
    records: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []
    advance = rt.advance

    def spy(layer, q, k, ctx):
        out = advance(layer, q, k, ctx)
        if out is not None:
            idx, rotation = out  # the query's de-RoPE coefficients: the classifier's input is derope_at's
            records.append((layer, derope_at(q[:, :, 0], rotation), idx.key_bucket.clone(), idx.searchable_hi))
        return out

    rt.advance = spy
    return records


@pytest.mark.parametrize("top_l", [1, C], ids=["l1", "lC"])
def test_static_loop_selectivity_equals_a_float64_recount(top_l: int):
    """Each step's means (popped after it) equal the recount: ``t`` is the valid length, not the view,
    and a lagging index's unlisted keys count with the window. ℓ = C visits every listed key: 1.0."""
    model, ids = _model(), _prompt(2, 60)
    rt = _counting_saap(top_l)
    hf.attach(model, decode=rt)
    records = _spy_on_steps(rt)
    gen = StaticGenerator(model, batch=2, max_len=90, graphs=False, bucket=BUCKET)
    gen.prefill(ids)
    lagged = padded = 0
    for _ in range(20):
        valid = int(gen.pos[0]) + 1  # keys once this step's key is written (every row: one length)
        records.clear()
        gen.decode(1)
        got = rt.pop_stats()
        assert sorted(r[0] for r in records) == list(range(1, LAYERS))
        sel, with_window = (torch.cat(x) for x in zip(*(_recount(rt.layers[layer], q, kb, hi, valid, top_l)
                                                       for layer, q, kb, hi in records)))
        assert got["selectivity"] == pytest.approx(float(sel.mean()), abs=1e-12)
        assert got["selectivity_with_window"] == pytest.approx(float(with_window.mean()), abs=1e-12)
        if top_l == C:
            assert got == pytest.approx({"selectivity": 1.0, "selectivity_with_window": 1.0}, abs=1e-12)
        lagged += records[0][3] < valid - RECENT
        padded += round_up(valid, BUCKET) > valid
    assert lagged and padded  # the steps exercised a lagging index and views past the valid keys
    hf.remove(model)


def test_pop_stats_zeroes_the_buffer_in_place():
    """A captured graph adds to the buffer it saw: popping must zero it, not replace it; an empty pop is
    ``{}`` (what ``calib eval`` merges per batch), and later steps add to the same buffer."""
    model, ids = _model(), _prompt(1, 40)
    rt = _counting_saap(1)
    assert rt.pop_stats() == {} and rt.stats_checkpoint() is None  # no step yet
    hf.attach(model, decode=rt)
    gen = StaticGenerator(model, batch=1, max_len=60, graphs=False, bucket=BUCKET)
    gen.generate(ids, 4)
    buf, ptr = rt._sums, rt._sums.data_ptr()
    first = rt.pop_stats()
    assert 0.0 < first["selectivity"] < first["selectivity_with_window"] < 1.0
    assert rt._sums is buf and buf.data_ptr() == ptr and not buf.any()
    assert rt.pop_stats() == {}
    gen.decode(2)
    assert rt._sums is buf and set(rt.pop_stats()) == {"selectivity", "selectivity_with_window"}
    hf.remove(model)


def test_stats_restore_puts_the_checkpoint_back_in_place():
    model, ids = _model(), _prompt(1, 40)
    rt = _counting_saap(1)
    hf.attach(model, decode=rt)
    gen = StaticGenerator(model, batch=1, max_len=60, graphs=False, bucket=BUCKET)
    gen.generate(ids, 2)
    buf = rt._sums
    saved = rt.stats_checkpoint()
    assert saved is not buf and torch.equal(saved, buf)
    gen.decode(2)
    assert not torch.equal(rt._sums, saved)
    rt.stats_restore(saved)
    assert rt._sums is buf and torch.equal(buf, saved)
    rt.stats_restore(None)  # the checkpoint of a runtime that had not counted yet
    assert rt._sums is buf and not buf.any() and rt.pop_stats() == {}
    hf.remove(model)


class _FakeStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


def test_capture_warm_up_steps_do_not_count(monkeypatch: pytest.MonkeyPatch):
    """``StaticGenerator._capture`` on CPU with CUDA's streams and graphs stubbed: its two warm-up steps
    leave the sums as they were. The stubbed capture runs its step (a real one only records it), so
    the sums end exactly where one step from the same state takes them."""
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    model, ids = _model(), _prompt(2, 60)
    rt = _counting_saap(1)
    hf.attach(model, decode=rt)
    gen = StaticGenerator(model, batch=2, max_len=90, graphs=False, bucket=BUCKET)
    gen.prefill(ids)
    gen.decode(1)
    before = rt.stats_checkpoint()
    view = round_up(int(gen.pos[0]) + 1, BUCKET)
    with torch.inference_mode():  # as StaticGenerator.decode calls them
        gen._before_view(view)
        gen._capture(view)
        after_capture = rt.stats_checkpoint()
        rt.stats_restore(before)
        with gen._decoding(view):  # the same step alone (the capture restored token and position)
            gen._step()
    one_step = rt.stats_checkpoint()
    assert float(one_step[2] - before[2]) == (LAYERS - 1) * 2 * HKV  # SAAP layers x rows x KV heads
    assert torch.equal(after_capture, one_step)
    hf.remove(model)
