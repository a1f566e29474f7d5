"""Which decode-step graphs the static loop keeps across requests (runtime_kernels.generate).

A request's first decode step either replays a graph kept from an earlier request or warms up and
captures one; the capture is the first-to-second-token latency of a small model. On the CPU a capture
is stood in for by tracing the step eagerly once (what a capture would run through the attention hooks)
and a replay by running the step eagerly: the keeping rule and the tokens are under test here, the real
graphs in tests/runtime/test_generate_gpu.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from runtime_kernels import hf
from runtime_kernels.generate import FlashDecode, StaticGenerator, eager_generate
from runtime_kernels.santa.runtime import SantaDecode
from tests.runtime.saap.test_saap_reference import _params
from tests.runtime.test_generate import C, D, HKV, HQ, _model, _prompt, _saap

pytest.importorskip("transformers")


def _baked(gen: StaticGenerator) -> tuple:
    """What a real capture bakes into a SAAP step besides the loop's own buffers: each index's storage
    addresses and shapes and where its lists end (host values of the kernel launches)."""
    runtime = getattr(gen._state(), "decode", None)
    index = getattr(runtime, "index", {})
    return tuple((layer, idx.length, idx.searchable_hi, idx.slot_start.data_ptr(), idx.bucket_count.data_ptr(),
                  idx.slots.data_ptr(), tuple(idx.slots.shape)) for layer, idx in sorted(index.items()))


class _EagerGraph:
    """A captured step stood in for: replaying runs the step at the captured view, after checking that
    what the capture baked in still holds (a real replay would read stale addresses or lengths)."""

    def __init__(self, gen: StaticGenerator, view: int) -> None:
        self.gen, self.view, self.baked = gen, view, _baked(gen)

    def replay(self) -> None:
        assert _baked(self.gen) == self.baked, "a graph replayed over an index it was not captured with"
        with self.gen._decoding(self.view):
            self.gen._step()


@pytest.fixture
def captures(monkeypatch) -> list[int]:
    """The views captured, in order, by generators made with :func:`_generator`."""
    seen: list[int] = []

    def capture(gen: StaticGenerator, view: int) -> None:
        token, pos = gen.token.clone(), gen.pos.clone()
        with gen._decoding(view):  # what a capture traces: the hooks record the layers the method ran in
            gen._step()
        gen.token.copy_(token)
        gen.pos.copy_(pos)
        gen._graph, gen._graph_view = _EagerGraph(gen, view), view
        seen.append(view)

    monkeypatch.setattr(StaticGenerator, "_warm_up", lambda gen, view: None)
    monkeypatch.setattr(StaticGenerator, "_capture", capture)
    return seen


def _generator(model, batch: int, max_len: int) -> StaticGenerator:
    gen = StaticGenerator(model, batch=batch, max_len=max_len, graphs=False, bucket=8)
    gen.graphs = True  # through _graph_at and _replay, with the stand-ins of ``captures``
    return gen


def _two_requests(model, captures: list[int], new_tokens: int = 12) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """Two prompts of 40 tokens, then one of 50, on one generator: the views each captured, and the tokens."""
    prompts = [_prompt(2, 40, seed=1), _prompt(2, 40, seed=2), _prompt(2, 50, seed=3)]
    gen, per_request, tokens = _generator(model, 2, 64), [], []
    for ids in prompts:
        before = len(captures)
        tokens.append(gen.generate(ids, new_tokens))
        per_request.append(captures[before:])
    return per_request, prompts, tokens


def test_dense_steps_are_captured_once_per_view_and_replayed_by_later_requests(captures):
    """Views 48 and 56 for 40 + 12 tokens; the second prompt replays them; the longer one
    (views 56, 64) captures only 64."""
    model = _model()
    per_request, prompts, tokens = _two_requests(model, captures)
    assert per_request == [[48, 56], [], [64]]
    assert all(torch.equal(t, eager_generate(model, ids, 12)) for t, ids in zip(tokens, prompts))


@pytest.mark.parametrize("runtime", ["saap at every bucket", "flash-decoding", "santa covering every key"])
def test_a_step_that_reads_no_request_state_serves_later_requests(captures, runtime):
    """SAAP whose every layer reads every key and S²ANTA drawing at least a row's keys run dense attention in
    every layer; flash-decoding reads the cache and weights only. Their graphs are kept like dense ones,
    and the tokens stay dense's."""
    model = _model()
    decode = {"saap at every bucket": lambda: _saap(top_l=C, stats=True),
              "flash-decoding": FlashDecode,
              "santa covering every key": lambda: SantaDecode([64, 64, 64], tile=16, seed=7, backend="reference")}
    rt = decode[runtime]()
    hf.attach(model, decode=rt)
    try:
        per_request, prompts, tokens = _two_requests(model, captures)
    finally:
        hf.remove(model)
    assert per_request == [[48, 56], [], [64]]
    assert all(torch.equal(t, eager_generate(model, ids, 12)) for t, ids in zip(tokens, prompts))
    if runtime == "saap at every bucket":
        assert not rt.index  # nothing built for any request
        assert rt.pop_stats() == {"selectivity": 1.0, "selectivity_with_window": 1.0}


def test_santa_sampling_steps_serve_later_requests_under_the_same_seeds(captures):
    """S²ANTA's draws are a function of (seed, layer, position, row, head, slot): a step reads the loop's
    positions, the seed and the runtime's kept buffers, nothing of one request, so later requests replay
    its graphs and still get their eager tokens. A reseed changes what a graph bakes in (the seed): the
    next request captures anew; reseeding back replays the first seed's graphs."""
    model = _model()
    rt = SantaDecode([3, 2, 5], tile=16, seed=7, backend="reference")
    hf.attach(model, decode=rt)
    try:
        per_request, prompts, tokens = _two_requests(model, captures)
        assert model.calib_attention.static_method_layers  # the method ran in the step
        assert all(torch.equal(t, eager_generate(model, ids, 12)) for t, ids in zip(tokens, prompts))
        gen, ids = _generator(model, 2, 64), prompts[0]
        runs = {}
        for seed in (7, 8, 7):
            rt.reseed(seed)
            before = len(captures)
            runs.setdefault(seed, []).append((gen.generate(ids, 12), captures[before:]))
            assert torch.equal(runs[seed][-1][0], eager_generate(model, ids, 12))
    finally:
        hf.remove(model)
    assert per_request == [[48, 56], [], [64]]
    assert [c for _, c in runs[7]] == [[48, 56], []] and runs[8][0][1] == [48, 56]
    assert not torch.equal(runs[7][0][0], runs[8][0][0])  # the seed matters: the replay is not the other seed's


def test_santa_per_row_seeds_keep_graphs_until_a_reseed(captures):
    """Per-row seeds are read by a step graph from a device tensor, by address: later requests under the
    same seeds replay the graphs; after a reseed (even back to the same values, a new tensor) the next
    request captures anew, and the graph kept for the old seeds still holds their tensor alive."""
    model, ids = _model(), _prompt(2, 40)
    rt = SantaDecode([3, 2, 5], tile=16, seed=[5, 6], backend="reference")
    hf.attach(model, decode=rt)
    try:
        gen, per_request = _generator(model, 2, 64), []
        for seeds in ([5, 6], None, [5, 6]):
            if seeds is not None:
                rt.reseed(seeds)
            before = len(captures)
            got = gen.generate(ids, 12)
            per_request.append(captures[before:])
            assert torch.equal(got, eager_generate(model, ids, 12))
        first = rt._seeds
        rt.reseed([9, 10])
        assert any(first in key[2] for key in gen._kept_graphs(model.calib_attention))
    finally:
        hf.remove(model)
    assert per_request == [[48, 56], [], [48, 56]]


def test_saap_indexes_ending_where_the_view_puts_them_serve_later_requests(captures):
    """SAAP's lists live in storage the runtime keeps and end at view - bucket whatever the prompt: a
    step graph reads nothing of one request, so later requests replay it (the stand-in replay checks
    that the storage and the lists' end are what the capture saw). Keys between the index's end and
    the step are attended exactly, with the window."""
    model = _model()
    rt = _saap(top_l=1)
    hf.attach(model, decode=rt)
    try:
        per_request, prompts, tokens = _two_requests(model, captures)
        assert model.calib_attention.static_method_layers  # SAAP ran in the step
        assert not rt.reads_request_state
        assert rt.index and all(idx.length == 64 - 8 for idx in rt.index.values())  # view 64, bucket 8
        # a fresh generator (its own captures) gives the same tokens as the replays of kept graphs
        for ids, got in zip(prompts, tokens):
            assert torch.equal(_generator(model, 2, 64).generate(ids, 12), got)
    finally:
        hf.remove(model)
    assert per_request[:3] == [[48, 56], [], [64]]


def test_saap_index_storage_lives_as_long_as_its_generators_cache(captures):
    """One storage per (cache, layer): a generator's requests share it, another generator gets its own, and
    a generator gone takes its storage with it (evaluation makes a generator per batch)."""
    import gc

    model = _model()
    rt = _saap(top_l=1)
    hf.attach(model, decode=rt)
    try:
        first, second = _generator(model, 2, 64), _generator(model, 2, 64)
        first.generate(_prompt(2, 40, seed=1), 4)
        held = {layer: idx.slots.data_ptr() for layer, idx in rt.index.items()}
        first.generate(_prompt(2, 40, seed=2), 4)
        assert {layer: idx.slots.data_ptr() for layer, idx in rt.index.items()} == held
        second.generate(_prompt(2, 40, seed=1), 4)
        assert len(rt._storage) == 2 and all(rt.index[l].slots.data_ptr() != p for l, p in held.items())
        del first
        gc.collect()
        assert len(rt._storage) == 1
    finally:
        hf.remove(model)


def test_saap_of_a_ragged_batch_short_of_the_view_captures_for_each_request(captures):
    """A ragged batch's short row holds fewer keys than the view's index would list: the index ends at
    that row's keys, which belong to this request, so the step is captured for each request."""
    model = _model()
    rt = _saap(top_l=1)
    hf.attach(model, decode=rt)
    ids = _prompt(2, 40, seed=4)
    rows = [ids[0].tolist(), ids[1, :20].tolist()]  # views from the long row, index from the short one
    try:
        gen = _generator(model, 2, 64)
        per_request = []
        for _ in range(2):
            before = len(captures)
            gen.generate(rows, 6)
            per_request.append(captures[before:])
        assert rt.reads_request_state
    finally:
        hf.remove(model)
    assert per_request == [[48], [48]]


def test_a_new_attachment_drops_the_kept_graphs(captures):
    """Graphs kept under one attachment are never replayed under another (its layers may differ)."""
    model = _model()
    gen, ids = _generator(model, 2, 64), _prompt(2, 40)
    gen.generate(ids, 4)
    hf.attach(model, decode=FlashDecode())
    try:
        before = len(captures)
        gen.generate(ids, 4)
        again = len(captures)
        gen.generate(ids, 4)
    finally:
        hf.remove(model)
    assert (again - before, len(captures) - again) == (1, 0)


def test_a_runtime_switched_off_and_on_never_replays_the_other_paths_graphs(captures):
    """A benchmark's in-process dense switches the decode runtime off on the same attachment: the dense
    graphs kept meanwhile must not stand in for S²ANTA's steps (which sample) when it is switched back on."""
    model, ids = _model(), _prompt(2, 40)
    dense = eager_generate(model, ids, 12)
    hf.attach(model, decode=SantaDecode([3, 2, 5], tile=16, seed=7, backend="reference"))
    try:
        sampled = _generator(model, 2, 64).generate(ids, 12)
        state, gen = model.calib_attention, _generator(model, 2, 64)
        runtime, state.decode = state.decode, None
        off = gen.generate(ids, 12)
        state.decode = runtime
        before = len(captures)
        on = gen.generate(ids, 12)
        on_captures = captures[before:]
        state.decode = None
        before = len(captures)
        off_again = gen.generate(ids, 12)
    finally:
        hf.remove(model)
    assert not torch.equal(sampled, dense)  # S²ANTA's draws change the tokens here
    assert torch.equal(off, dense) and torch.equal(off_again, dense) and torch.equal(on, sampled)
    assert on_captures == [48, 56] and len(captures) == before  # dense replays its kept graphs


def test_an_index_built_outside_the_loop_is_rebuilt_in_the_caches_storage(captures):
    """An index a caller built itself (a benchmark's) is not in storage a later request keeps: the hook
    builds it again into the cache's storage before the step is captured, so the graph may be kept."""
    model, ids = _model(), _prompt(2, 40)
    rt = _saap(top_l=1)
    hf.attach(model, decode=rt)
    try:
        gen = _generator(model, 2, 64)
        gen.prefill(ids)
        for layer in range(1, len(rt.layers)):
            rt.build_index(layer, gen.cache.keys[layer][:, :, :40], rt._prefill_ctx)
        assert not any(idx.fixed for idx in rt.index.values())
        gen.decode(4)
        assert rt.index and all(idx.fixed and idx.length == 40 for idx in rt.index.values())
        assert not rt.reads_request_state
    finally:
        hf.remove(model)


@contextlib.contextmanager
def _prefilled_saap() -> Iterator[tuple[Any, StaticGenerator]]:
    """SAAP (ℓ = 1) attached and a 40-token prompt prefilled in a static loop of bucket 8: its hook not yet run."""
    model = _model()
    rt = _saap(top_l=1)
    hf.attach(model, decode=rt)
    try:
        gen = StaticGenerator(model, batch=2, max_len=64, graphs=False, bucket=8)
        gen.prefill(_prompt(2, 40))
        yield rt, gen
    finally:
        hf.remove(model)


def test_a_requests_saap_indexes_build_without_reading_the_device(monkeypatch):
    """The hook builds every layer's index for a new request with no host read (no GPU sync between the
    layers' kernels), and brings them to a new view with one read per layer."""
    from tests.runtime.saap.test_saap_bucket_index import _HostReads

    with _prefilled_saap() as (rt, gen):
        reads = _HostReads(monkeypatch)
        rt.before_graph(gen.cache, 41, 48, stable=40)
        built = reads.count
        rt.before_graph(gen.cache, 49, 56, stable=48)
        assert (built, reads.count - built) == (0, len(rt.index)) and len(rt.index) == len(rt.layers) - 1


def test_the_layers_of_one_hook_call_share_the_rotary_cos_sin(monkeypatch):
    """Every layer's index covers the same positions: the hook asks the rotary module once per chunk of
    positions, not once per layer, and the indexes equal those built layer by layer."""
    with _prefilled_saap() as (rt, gen):
        rotary, calls = rt._prefill_ctx.rotary_emb, []
        monkeypatch.setattr(rt._prefill_ctx, "rotary_emb", lambda *a: calls.append(1) or rotary(*a))
        rt.before_graph(gen.cache, 41, 48, stable=40)
        assert len(calls) == 1 and len(rt.index) == len(rt.layers) - 1
        for layer, idx in rt.index.items():
            alone = _saap(top_l=1)
            alone.build_index(layer, gen.cache.keys[layer][:, :, :40], rt._prefill_ctx)
            assert torch.equal(idx.key_bucket, alone.index[layer].key_bucket)
            assert all(torch.equal(x, y) for x, y in zip(idx.csr(), alone.index[layer].csr()))


class _Cache:
    """A static cache's keys, one ``[B, Hkv, T, D]`` buffer per layer (weakly referenceable, as the loop's)."""

    def __init__(self, layers: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = [torch.randn(2, HKV, 64, D, generator=g) for _ in range(layers)]


def _launches_of_a_request_build(layers: int, one_by_one: bool) -> int:
    """Kernel-running ops (views excluded) of the hook's index build for a second request, ``layers``
    SAAP layers after a dense one (the first request allocated the kept storage)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from runtime_kernels.saap import SaapDecode, SaapLayerParams
    from runtime_kernels.saap.api import AttentionPositions

    class Launches(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 0 if func.is_view else 1
            return func(*args, **(kwargs or {}))

    rt = SaapDecode([SaapLayerParams(sink=1, recent=8, dense=True)]
                    + [_params(HQ, HKV, D, C, 8, 1, 8, seed=i) for i in range(1, layers + 1)], top_l=1, stats=False)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D)
    rt._prefill_ctx = AttentionPositions(LlamaRotaryEmbedding(cfg))
    cache, sparse = _Cache(layers + 1), list(range(1, layers + 1))

    def build() -> None:
        rt._trig = {}
        if one_by_one:
            for layer in sparse:
                rt.build_index(layer, cache.keys[layer][:, :, :40], rt._prefill_ctx, cache=cache)
        else:
            rt._build_indexes(sparse, cache, 40)

    build()
    with Launches() as seen:
        build()
    return seen.count


def test_a_requests_indexes_cost_three_launches_per_layer_beyond_a_fixed_few():
    """The hook indexes a new request's layers together: every extra layer adds only its lists' three
    writes into its kept storage (slots, starts, counts), where layer by layer each costs a few dozen
    launches (de-RoPE, assignment, layout), each a host launch on a GPU before the second token."""
    four, eight = (_launches_of_a_request_build(n, one_by_one=False) for n in (4, 8))
    assert eight - four == 4 * 3
    assert eight < _launches_of_a_request_build(8, one_by_one=True) / 4


def test_an_index_build_moves_the_centroids_alone():
    """Building a request's indexes moves each layer's centroids to the device once and nothing else of
    its classifier: no float32 copy of the (here bf16) MLP weights beside the one the steps use."""
    with _prefilled_saap() as (rt, gen):
        for layer in range(1, len(rt.layers)):
            rt.layers[layer].w1, rt.layers[layer].w2 = (w.bfloat16() for w in (rt.layers[layer].w1,
                                                                                 rt.layers[layer].w2))
        rt._params_on.clear()
        rt._centroids_on.clear()
        rt.before_graph(gen.cache, 41, 48, stable=40)
        assert len(rt.index) == len(rt.layers) - 1
        assert not rt._params_on  # no layer's classifier moved
        moved = list(rt._centroids_on.values())
        assert moved and all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in moved)
        assert sum(x.numel() for x in moved) == sum(rt.layers[layer].centroids.numel() for layer in rt.index)


def test_a_step_with_every_layer_dense_drops_the_indexes_and_keeps_its_graph():
    """The policy chose dense in every layer: the hook drops the request's indexes at once, and the
    step then reads nothing of the request (its graph may serve later requests)."""
    with _prefilled_saap() as (rt, gen):
        rt.before_graph(gen.cache, 41, 48, stable=40)
        assert rt.index and rt.reads_request_state is False
        rt.before_graph(gen.cache, 44, 48, layers=set(), stable=40)
        assert rt.index == {} and rt.reads_request_state is False
