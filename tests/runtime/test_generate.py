"""The static-cache decode loop (runtime_kernels.generate) against transformers' eager DynamicCache path.

CPU: the loop runs its steps eagerly (no graphs) through the same code, the methods through their
PyTorch references; the GPU file (tests/runtime/test_generate_gpu.py) replays CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import hf
from runtime_kernels.generate import StaticGenerator, eager_generate, round_up
from runtime_kernels.static_cache import StaticKVCache
from runtime_kernels.saap import SaapDecode, SaapLayerParams
from runtime_kernels.santa.runtime import SantaDecode
from runtime_kernels.santa.draws import keyed_uniforms
from tests.runtime.saap.test_saap_reference import _params
from tests.runtime.saap.through_buckets import SaapThroughBuckets

transformers = pytest.importorskip("transformers")

HQ, HKV, D, C, LAYERS = 4, 2, 16, 4, 3


def _model(seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
                                   max_position_embeddings=1024, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _prompt(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(96, (b, t), generator=torch.Generator().manual_seed(seed))


def _saap(top_l: int, recent: int = 8, **options) -> SaapDecode:
    layers = [SaapLayerParams(sink=1, recent=recent, dense=True)] + [
        _params(HQ, HKV, D, C, 8, 1, recent, seed=i) for i in range(1, LAYERS)]
    return SaapDecode(layers, top_l=top_l, **{"stats": False, **options})


def test_cache_keyword_and_output_follow_the_transformers_release():
    """The cache goes in and comes out by the name the installed transformers uses: ``cache`` where
    ``forward`` takes it (``past_key_values`` a deprecated alias there), ``past_key_values`` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from runtime_kernels.generate import cache_argument, output_cache

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=False, **kwargs):
            return input_ids

    assert (cache_argument(Old()), cache_argument(New())) == ("past_key_values", "cache")
    marker = object()
    fields = {f for f in CausalLMOutputWithPast.__dataclass_fields__}
    name = "cache" if "cache" in fields else "past_key_values"
    assert output_cache(CausalLMOutputWithPast(logits=torch.zeros(1), **{name: marker})) is marker

    class Legacy:  # an output object of a release before the rename
        past_key_values = marker

    assert output_cache(Legacy()) is marker


def test_round_up_and_cache_views():
    assert round_up(1, 256) == 256 and round_up(256, 256) == 256 and round_up(257, 256) == 512
    cache = StaticKVCache(2, batch=1, num_kv_heads=1, head_dim=2, max_len=8, device="cpu", dtype=torch.float32)
    cache.view, cache.write_pos = 3, torch.tensor([1, 2])
    k, v = cache.update(torch.ones(1, 1, 2, 2), 2 * torch.ones(1, 1, 2, 2), 1)
    assert k.shape == (1, 1, 3, 2) and k[0, 0, :, 0].tolist() == [0.0, 1.0, 1.0]
    assert v[0, 0, :, 1].tolist() == [0.0, 2.0, 2.0] and float(cache.keys[0].abs().sum()) == 0.0  # layer 0 untouched


@pytest.mark.parametrize("b,t,bucket", [(1, 37, 16), (2, 40, 8)], ids=["B1-T37-bucket16", "B2-T40-bucket8"])
def test_dense_static_loop_equals_eager(b: int, t: int, bucket: int):
    """Several view lengths (the bucket is small): masks and views hide the unwritten tail."""
    model, ids = _model(), _prompt(b, t)
    want = eager_generate(model, ids, 20)
    gen = StaticGenerator(model, batch=b, max_len=t + 20, graphs=False, bucket=bucket)
    assert torch.equal(gen.generate(ids, 20), want)


def test_static_loop_refuses_a_prompt_that_does_not_fit():
    model = _model()
    gen = StaticGenerator(model, batch=1, max_len=16, graphs=False, bucket=16)
    with pytest.raises(ValueError, match="leaves no room"):
        gen.prefill(_prompt(1, 16))
    with pytest.raises(ValueError, match="built for batch 1"):
        gen.prefill(_prompt(2, 4))


def test_saap_static_loop_equals_eager_with_every_bucket():
    """ℓ = C through the buckets: SAAP attends every key, whether the index is kept up to date each step
    (eager) or only at each new view length with the keys in between attended with the window (static)."""
    model, ids = _model(), _prompt(2, 60)
    dense = eager_generate(model, ids, 24)
    layers = _saap(top_l=C).layers
    hf.attach(model, decode=SaapThroughBuckets(layers, top_l=C, stats=False))
    eager = eager_generate(model, ids, 24)
    rt = SaapThroughBuckets(layers, top_l=C, stats=False)
    hf.attach(model, decode=rt)
    static = StaticGenerator(model, batch=2, max_len=90, graphs=False, bucket=8).generate(ids, 24)
    assert torch.equal(eager, dense) and torch.equal(static, dense)
    assert rt.index[1].length >= 60 + 16  # the index absorbed decoded keys at view changes


@pytest.mark.parametrize("loop", ["eager", "static"])
def test_a_layer_at_every_bucket_runs_dense_attention_and_counts_every_key(loop):
    """ℓ >= C in a layer: dense attention there (no index built), whatever the loop, with the tokens and
    statistics of SAAP's own path through every bucket (float64): its steps count as reading every key."""
    model, ids = _model().double(), _prompt(2, 60)
    rt = _saap(top_l=1, top_l_layers={2: C}, stats=True)
    through = SaapThroughBuckets(rt.layers, top_l=1, top_l_layers={2: C}, stats=True)
    got = {}
    for name, runtime in (("dense at C", rt), ("buckets", through)):
        hf.attach(model, decode=runtime)
        got[name] = (eager_generate(model, ids, 12) if loop == "eager" else
                     StaticGenerator(model, batch=2, max_len=90, graphs=False, bucket=8).generate(ids, 12))
    hf.remove(model)
    assert torch.equal(got["dense at C"], got["buckets"])
    assert 2 not in rt.index and 1 in rt.index and rt.cost_signature(2) is None
    assert rt.reads_every_key(2) and not rt.reads_every_key(1) and not rt.reads_every_key(0)  # 0: dense layer
    # layer 2 counts 1 per (row, KV head, step), as SAAP's own path visiting every bucket counts it
    mixed, buckets = rt.pop_stats(), through.pop_stats()
    assert mixed == pytest.approx(buckets, rel=1e-12)
    assert 0.5 < mixed["selectivity"] < 1.0  # half the entries at 1, layer 1's at ℓ = 1 of C = 4 below it


def test_saap_static_step_matches_eager_step_with_one_bucket():
    """ℓ = 1: the static step's lagging index (keys past it attended densely) is a superset of the
    eager step's keys; where the hook brings it up to date both visit the same keys. The hook ends a
    request's index where its view puts it (view - bucket): a 64-token prompt is indexed completely."""
    model, ids = _model(), _prompt(1, 64)
    hf.attach(model, decode=_saap(top_l=1))
    eager = eager_generate(model, ids, 9)
    hf.attach(model, decode=_saap(top_l=1))
    gen = StaticGenerator(model, batch=1, max_len=80, graphs=False, bucket=8)
    static = gen.generate(ids, 9)
    # the first token comes from prefill, step 1 at position 64 (view 72: index of 72 - 8 = 64 keys, complete)
    assert torch.equal(static[:, :2], eager[:, :2])


def test_saap_static_steps_before_the_views_first_full_bucket_are_dense():
    """A prompt inside the first view: no key is common to every request at that view (view - bucket = 0),
    so the static index is empty and the steps attend every key, as dense does; the next view indexes
    view - bucket keys."""
    model, ids = _model(), _prompt(2, 5)
    dense = StaticGenerator(model, batch=2, max_len=40, graphs=False, bucket=16).generate(ids, 8)  # views 16
    rt = _saap(top_l=1, recent=2)
    hf.attach(model, decode=rt)
    try:
        gen = StaticGenerator(model, batch=2, max_len=40, graphs=False, bucket=16)
        assert torch.equal(gen.generate(ids, 8), dense)
        assert all(idx.length == 0 and idx.searchable_hi == 0 for idx in rt.index.values()) and rt.index
        gen.decode(6)  # positions 13 .. 18: the view becomes 32, its index 16 keys
        assert all(idx.length == 16 for idx in rt.index.values())
    finally:
        hf.remove(model)


def test_santa_static_loop_equals_eager_for_a_seed():
    model, ids = _model(), _prompt(2, 50)
    hf.attach(model, decode=SantaDecode([3, 2, 5], tiling="flash", tile=16, seed=7, backend="reference"))
    eager = eager_generate(model, ids, 20)
    hf.attach(model, decode=SantaDecode([3, 2, 5], tiling="flash", tile=16, seed=7, backend="reference"))
    static = StaticGenerator(model, batch=2, max_len=80, graphs=False, bucket=16).generate(ids, 20)
    assert torch.equal(static, eager)
    hf.attach(model, decode=SantaDecode([3, 2, 5], tiling="flash", tile=16, seed=8, backend="reference"))
    assert not torch.equal(eager_generate(model, ids, 20), eager)  # the seed matters: SANTA really sampled


def test_santa_serving_samples_the_same_keys_without_statistics():
    """hf.apply serves SANTA with stats off: a static step then adds no statistic kernels, and samples
    exactly what the counted run samples."""
    model, ids = _model(), _prompt(2, 50)

    def run(stats: bool) -> tuple[torch.Tensor, SantaDecode]:
        rt = SantaDecode([3, 2, 5], tiling="flash", tile=16, seed=7, backend="reference", stats=stats)
        hf.attach(model, decode=rt)
        return StaticGenerator(model, batch=2, max_len=80, graphs=False, bucket=16).generate(ids, 12), rt

    counted, with_stats = run(True)
    served, without = run(False)
    assert with_stats.pop_stats()["sampled_calls"] > 0
    assert without._sums is None and without.pop_stats() == {}  # no device buffer, nothing counted
    assert torch.equal(served, counted)


def _ragged_rows(lengths: list[int]) -> list[list[int]]:
    return [_prompt(1, n, seed=i)[0].tolist() for i, n in enumerate(lengths)]


def _prefill_calls(model) -> list[tuple[int, int]]:
    """``(rows, tokens)`` of every multi-token forward call of ``model`` from now on (a hook)."""
    calls: list[tuple[int, int]] = []
    model.register_forward_pre_hook(lambda m, args, kw: calls.append(tuple(kw["input_ids"].shape))
                                    if kw["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    return calls


@pytest.mark.parametrize("lengths, calls", [([37, 45, 40], [(1, 37), (1, 40), (1, 45)]),
                                            ([160, 150, 157], [(3, 160)]),
                                            ([100, 60, 98], [(1, 60), (2, 100)])])  # rows 2 and 0 together
def test_dense_ragged_batch_equals_each_prompt_alone(lengths, calls):
    """Prompts of three lengths in one batch, several view lengths: far apart each row prefills alone into its
    cache row, close ones (adjacent or not) in one call padded after their last token; decoded each at its own position, a
    row gives the tokens it gets alone (float64: exact)."""
    model = _model().double()
    rows = _ragged_rows(lengths)
    seen = _prefill_calls(model)
    gen = StaticGenerator(model, batch=3, max_len=max(lengths) + 20 + 1, graphs=False, bucket=8)
    got = gen.generate(rows, 20)
    assert seen == calls
    for b, row in enumerate(rows):
        assert torch.equal(got[b], eager_generate(model, torch.tensor([row]), 20)[0])
    assert gen.pos.tolist() == [n + 20 for n in lengths]  # each row's next position


@pytest.mark.parametrize("lengths", [[50, 41, 47], [50, 48, 47]])
def test_santa_ragged_batch_with_per_row_seeds_equals_each_prompt_alone(lengths):
    """S²ANTA in prefill and decode, one seed per row: a row of a ragged batch samples what it samples as
    the only row under its seed (its prefill generator and its decode offsets are its own); a prefill method
    sees whole sequences, so even close lengths prefill one row at a time."""
    model = _model().double()
    rows, seeds = _ragged_rows(lengths), [11, 12, 13]
    seen = _prefill_calls(model)

    def santa(seed):
        return SantaDecode([3, 2, 5], tiling="flash", tile=16, seed=seed, phases=("prefill", "decode"),
                           backend="reference")
    rt = santa(seeds)
    hf.attach(model, prefill=rt, decode=rt)
    got = StaticGenerator(model, batch=3, max_len=80, graphs=False, bucket=16).generate(rows, 16)
    for b, row in enumerate(rows):
        alone = santa(seeds[b])
        hf.attach(model, prefill=alone, decode=alone)
        assert torch.equal(got[b], eager_generate(model, torch.tensor([row]), 16)[0])
    swapped = santa([12, 11, 13])  # the seeds decide: rows 0 and 1 now draw other samples
    hf.attach(model, prefill=swapped, decode=swapped)
    other = StaticGenerator(model, batch=3, max_len=80, graphs=False, bucket=16).generate(rows, 16)
    hf.remove(model)
    assert torch.equal(other[2], got[2]) and not torch.equal(other[:2], got[:2])
    assert {rows for rows, _ in seen} == {1}


@pytest.mark.parametrize("lengths", [[40, 47, 43], [160, 170, 165]])
def test_saap_ragged_batch_indexes_the_shortest_row_and_attends_every_key_once(lengths):
    """One bucket index length serves a ragged batch (prefilled row by row, or in one padded call): the
    shortest row decodes as it would alone, and with every bucket visited (ℓ = C) each row attends each of
    its keys exactly once, index or window, so the tokens are dense attention's (float64)."""
    model = _model().double()
    rows = _ragged_rows(lengths)
    hf.attach(model, decode=_saap(top_l=2))
    got = StaticGenerator(model, batch=3, max_len=200, graphs=False, bucket=8).generate(rows, 16)
    hf.attach(model, decode=_saap(top_l=2))
    alone = StaticGenerator(model, batch=1, max_len=200, graphs=False, bucket=8).generate([rows[0]], 16)
    assert torch.equal(got[0], alone[0])
    hf.attach(model, decode=_saap(top_l=C))
    every_bucket = StaticGenerator(model, batch=3, max_len=200, graphs=False, bucket=8).generate(rows, 16)
    hf.remove(model)
    for b, row in enumerate(rows):
        assert torch.equal(every_bucket[b], eager_generate(model, torch.tensor([row]), 16)[0])
    assert not torch.equal(got, every_bucket)  # ℓ = 2 of 4 buckets does change some tokens


def test_prompts_that_leave_no_room_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="prompts of 0-3 tokens: an empty prompt has no next token"):
        StaticGenerator(model, batch=2, max_len=80, graphs=False).prefill([[], [1, 2, 3]])


def test_keyed_uniforms_are_uniform_and_independent():
    u = keyed_uniforms(3, torch.arange(8), torch.arange(400, 404), 16, 128)  # [8, 4, 16, 128]
    x = u.flatten()
    assert 0.0 < float(x.min()) and float(x.max()) < 1.0
    # mean and variance of U(0,1) within ~5 sigma for n = 65536
    assert abs(float(x.mean()) - 0.5) < 5 * (1 / 12) ** 0.5 / len(x) ** 0.5
    assert abs(float(x.var()) - 1 / 12) < 0.003
    hist = torch.histc(x.float(), bins=16, min=0, max=1)
    assert float(((hist - len(x) / 16) ** 2 / (len(x) / 16)).sum()) < 50  # chi-square, 15 dof (p ~ 1e-5)
    # neighbouring coordinates are uncorrelated: layers, positions, heads, slots
    for a, b in ((u[0], u[1]), (u[:, 0], u[:, 1]), (u[:, :, 0], u[:, :, 1]), (u[..., 0], u[..., 1])):
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(r)) < 5 / a.numel() ** 0.5
    assert torch.equal(keyed_uniforms(3, 5, torch.arange(400, 404), 16, 128)[0], u[5])  # a pure function
    assert not torch.equal(keyed_uniforms(4, 5, torch.arange(400, 404), 16, 128)[0], u[5])  # the seed


def test_santa_offsets_follow_position_layer_and_seed():
    rt = SantaDecode([4, 4], tiling="prop", tile=64, seed=11)
    pos = torch.tensor([299])
    first = rt.offsets(0, pos, 4, 300, 4, host_position=299)
    assert first.shape == (1, 4, 5)
    assert torch.equal(rt.offsets(0, pos, 4, 300, 4, host_position=299), first)
    assert not torch.equal(rt.offsets(0, pos + 1, 4, 301, 4, host_position=300)[..., :5], first)
    assert not torch.equal(rt.offsets(1, pos, 4, 300, 4, host_position=299), first)
    # a longer view only adds tiles: the shared ones draw the same offsets (static = eager)
    assert torch.equal(rt.offsets(0, pos, 4, 512, 4)[..., :5], first)


def test_saap_serves_dense_in_the_layers_the_measured_policy_chose(tmp_path, monkeypatch):
    """``serve="fastest"``: a layer group whose recorded cost is no faster than dense runs flash-decoding /
    the model's attention, so with every SAAP layer recorded as slower the static loop generates the dense
    model's tokens even with one bucket; recorded faster (or unmeasurable: no graphs), SAAP runs."""
    from runtime_kernels import serving_policy

    monkeypatch.setenv("CALIB_RUNTIME_CACHE", str(tmp_path))
    serving_policy.forget_all()
    model, ids = _model(), _prompt(1, 60)
    dense = eager_generate(model, ids, 8)
    rt = _saap(top_l=1)
    state = hf.attach(model, decode=rt, serve="fastest")
    assert not torch.equal(StaticGenerator(model, batch=1, max_len=80, graphs=False, bucket=8).generate(ids, 8), dense)
    assert state.serve_dense == frozenset({0})  # layer 0 is dense; nothing timed without graphs
    shape = f"B1|T64|Hq{HQ}|Hkv{HKV}|D{D}|{torch.float32}"
    for layer in range(1, LAYERS):  # record every SAAP group as slower than dense at the first view
        serving_policy.record(f"decode|{serving_policy.device_key(torch.device('cpu'))}|{rt.cost_signature(layer)}|{shape}",
                              2.0, 1.0)
    gen = StaticGenerator(model, batch=1, max_len=80, graphs=False, bucket=64)
    assert torch.equal(gen.generate(ids, 4), dense[:, :4])  # 61-64 keys: one view, every layer dense
    assert state.serve_dense == frozenset(range(LAYERS)) and not rt.index  # no index built for dense layers


def _santa_stats_by_hand(schedule: list[int], tile: int, tiling: str, keys_per_call: list[list[int]]) -> dict:
    """mean S and mean sample fraction over decode calls written out: each call is (layer, the rows' valid
    keys); flash draws round(S / tiles) (>= 1) per tile, prop draws S; a call's fraction is its rows' mean."""
    import math

    total_s = total_f = calls = 0.0
    for keys in keys_per_call:
        for s in schedule:
            fr = []
            for n in keys:
                tiles = math.ceil(n / tile)
                drawn = tiles * max(1, math.floor(s / tiles + 0.5)) if tiling == "flash" else s
                fr.append(min(1.0, drawn / n))
            total_s, total_f, calls = total_s + s, total_f + sum(fr) / len(fr), calls + 1
    return {"mean_samples": total_s / calls, "sample_fraction": total_f / calls, "sampled_calls": calls}


@pytest.mark.parametrize("tiling", ["flash", "prop"])
def test_santa_stats_count_in_the_static_loop(tiling):
    """Static-cache steps count S²ANTA's samples on the device (what CUDA graphs replay): a ragged batch
    of 40 and 53 tokens, 6 steps of 3 layers; the eager loop's equal-length count agrees with its own."""
    model = _model()
    schedule = [3, 40, 5]
    rt = SantaDecode(schedule, tiling=tiling, tile=16, seed=[1, 2], backend="reference")
    hf.attach(model, decode=rt)
    StaticGenerator(model, batch=2, max_len=70, graphs=False, bucket=16).generate(_ragged_rows([40, 53]), 6)
    want = _santa_stats_by_hand(schedule, 16, tiling, [[40 + j + 1, 53 + j + 1] for j in range(6)])
    assert rt.pop_stats() == pytest.approx(want, rel=1e-12) and rt.pop_stats() == {}
    eager = SantaDecode(schedule, tiling=tiling, tile=16, seed=3, backend="reference")
    hf.attach(model, decode=eager)
    eager_generate(model, _prompt(2, 40), 6)  # 5 decode steps after prefill
    assert eager.pop_stats() == pytest.approx(
        _santa_stats_by_hand(schedule, 16, tiling, [[40 + j + 1] * 2 for j in range(5)]), rel=1e-12)
    hf.remove(model)


def _sampleattention():
    from runtime_kernels.sampleattention.api import SampleAttentionPrefill
    from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable

    table = BucketTable([164], [BucketRow(1.0, 1.0, 1), BucketRow(0.4, 0.4, 2)], blk=16)  # the 160 row: dense
    return SampleAttentionPrefill(table, blk=16)


def _sale():
    from runtime_kernels.sale.api import SalePrefill
    from runtime_kernels.sale.reference import SaleSelectionConfig

    tau = torch.tensor([[0.0] * HQ, [0.9, 0.0, 0.5, 0.3], [0.3, 0.9, 0.9, 0.0]])  # layer 0 dense
    return SalePrefill(tau, SaleSelectionConfig(block_q=16, block_k=16, sink=16, local=32, bits=4))


@pytest.mark.parametrize("method", [_sampleattention, _sale])
def test_a_ragged_prefill_method_takes_a_padded_batch_and_answers_each_row_as_alone(method):
    """SampleAttention and SALE declare ``ragged_prefill``: close lengths prefill in one padded call, their
    attention runs each row on the row's own positions (its bucket, its blocks and its statistics), so every
    row's tokens and the mean block density are those of the rows run alone (float64)."""
    model = _model().double()
    rows = _ragged_rows([170, 160, 166, 160])
    seen = _prefill_calls(model)
    rt = method()
    hf.attach(model, prefill=rt)
    got = StaticGenerator(model, batch=4, max_len=200, graphs=False, bucket=16).generate(rows, 12)
    batched = rt.pop_stats()
    alone_density = []
    for b, row in enumerate(rows):
        hf.attach(model, prefill=rt)
        want = StaticGenerator(model, batch=1, max_len=200, graphs=False, bucket=16).generate([row], 12)
        alone_density.append(rt.pop_stats()["density"])
        assert torch.equal(got[b], want[0]), b
    hf.remove(model)
    assert seen[0] == (4, 170) and all(r == 1 for r, _ in seen[1:])
    assert batched["density"] == pytest.approx(sum(alone_density) / 4, rel=1e-12)
    assert min(alone_density) < 1.0  # the method did skip blocks


def test_the_prefill_guards_dense_run_switches_the_method_off_and_back_on(monkeypatch):
    """The whole-prefill guard's run with the method off (``forward(False)``): the prefill method sees no
    call (its statistics stay empty), the tokens are the dense model's, and the method is attached again
    afterwards. (On CUDA the guard decides which run stands: tests/runtime/test_generate_gpu.py.)"""
    model = _model().double()
    ids = _prompt(2, 150)
    want = StaticGenerator(model, batch=2, max_len=200, graphs=False, bucket=16).generate(ids, 8)
    rt = _sale()
    hf.attach(model, prefill=rt)
    gen = StaticGenerator(model, batch=2, max_len=200, graphs=False, bucket=16)
    seen = []

    def method_off(state, b, t, forward):
        seen.append(state.prefill)
        out = forward(False)
        seen.append(state.prefill)
        return out

    monkeypatch.setattr(gen, "_guarded_prefill", method_off)
    got = gen.generate(ids, 8)
    hf.remove(model)
    assert torch.equal(got, want) and seen == [rt, rt] and rt.pop_stats() == {}


def _scripted_policy(monkeypatch, tmp_path, layer_ms: tuple[float, float], prefill_ms: tuple[float, float]) -> dict:
    """The serving policy on the CPU with scripted costs: every layer timing reads ``layer_ms`` (method,
    dense), every whole-prefill timing ``prefill_ms`` (the guard alternates method on / off); returns the
    count of timings taken."""
    from runtime_kernels import generate, serving_policy as sp

    monkeypatch.setenv("CALIB_RUNTIME_CACHE", str(tmp_path))
    sp.forget_all()
    for module in (sp, generate):
        monkeypatch.setattr(module, "can_time", lambda device: True)
    taken = {"layer": 0, "prefill": 0}

    def median_ms(fn, repeats=sp.PREFILL_REPEATS):  # the chooser times the method, then dense
        taken["layer"] += 1
        return layer_ms[(taken["layer"] - 1) % 2], fn()

    def wall_ms(fn):  # the guard times method on, off, on, off
        taken["prefill"] += 1
        return prefill_ms[(taken["prefill"] - 1) % 2], fn()

    monkeypatch.setattr(sp, "_median_ms", median_ms)
    monkeypatch.setattr(sp, "_wall_ms", wall_ms)
    return taken


@pytest.mark.parametrize("method_wins", [False, True])
def test_a_warm_ragged_generation_times_nothing_and_runs_the_path_that_won(method_wins, tmp_path, monkeypatch):
    """A ragged batch (lengths 150 and 152 in one padded call, 90 and 120 alone: three prefill shapes) under
    ``serve="fastest"`` with SALE attached, the policy's timings scripted. The first generation decides each
    shape; the second times nothing and runs what won: with dense faster in every layer, no layer call
    reaches the method (it is switched off for the whole prefill) and the tokens are the dense model's; with
    the method faster in its layers and in the whole prefill, it runs in every layer it covers (layers 1 and
    2; layer 0's thresholds are all 0, dense) in each of the three calls, and the tokens are those of
    ``serve="method"``."""
    model = _model()
    rows = [_prompt(1, n, seed=n)[0].tolist() for n in (150, 152, 90, 120)]
    want = StaticGenerator(model, batch=4, max_len=200, graphs=False, bucket=16).generate(rows, 6)
    if method_wins:
        hf.attach(model, prefill=_sale(), serve="method")
        want = StaticGenerator(model, batch=4, max_len=200, graphs=False, bucket=16).generate(rows, 6)
    taken = _scripted_policy(monkeypatch, tmp_path, (1.0, 2.0) if method_wins else (2.0, 1.0), (5.0, 9.0))
    state = hf.attach(model, prefill=_sale(), serve="fastest", prefill_identity="sale-test")
    gen = StaticGenerator(model, batch=4, max_len=200, graphs=False, bucket=16)
    gen.generate(rows, 6)
    assert taken["layer"] > 0 and taken["prefill"] == (12 if method_wins else 0)  # 3 shapes x 4 guard runs
    taken.update(layer=0, prefill=0)
    state.prefill_chooser.reset_counts()
    got = gen.generate(rows, 6)
    hf.remove(model)
    assert taken == {"layer": 0, "prefill": 0}
    chooser = state.prefill_chooser
    assert (chooser.method_calls, chooser.dense_calls) == ((2 * 3, 1 * 3) if method_wins else (0, 0))
    assert torch.equal(got, want)


def test_step_times_count_the_host_time_of_bringing_the_method_to_each_view(monkeypatch):
    """``StepTimes.view_ms`` holds the runtime's view hook (a SAAP request's index build, then its upkeep
    at each new view): a hook slowed by 20 ms, run at the two views that 12 steps from a 40-token prompt
    reach with a bucket of 8 (cache lengths 41-48 and 49-52), shows at least 40 ms, and no more than
    the whole decode took."""
    import time as _time

    from runtime_kernels.generate import StepTimes

    model = _model()
    rt = _saap(top_l=1)
    hook = rt.before_graph
    monkeypatch.setattr(rt, "before_graph", lambda *a, **k: (_time.sleep(0.02), hook(*a, **k)))
    hf.attach(model, decode=rt)
    try:
        gen = StaticGenerator(model, batch=2, max_len=64, graphs=False, bucket=8)
        gen.prefill(_prompt(2, 40))
        times = StepTimes()
        t0 = _time.perf_counter()
        gen.decode(12, times)
        total_ms = (_time.perf_counter() - t0) * 1e3
    finally:
        hf.remove(model)
    assert 2 * 20 <= times.view_ms <= total_ms


class _ViewHook:
    """A decode runtime that runs nowhere (the model's attention) and records its view hook's arguments."""

    method, phase = "recorder", "decode"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def observe_prefill(self, layer, q, k, v, ctx) -> None:
        pass

    def decode(self, layer, q, k, v, scale, ctx) -> None:
        return None

    def before_graph(self, cache, shortest: int, view: int, layers, stable: int = 0) -> None:
        self.calls.append((shortest, view))


def test_the_loop_keeps_positions_on_the_host_and_reads_none_back(monkeypatch):
    """Rows of 20, 13 and 30 prompt tokens, 12 steps, views of 8 keys: the view hook gets the keys the
    shortest row holds at each new view (14, 16 and 24 at views 32, 40 and 48) and the loop itself reads
    no tensor back from the device (each read would be a GPU sync per request and view)."""
    from tests.runtime.saap.test_saap_bucket_index import _HostReads

    model, hook = _model(), _ViewHook()
    hf.attach(model, decode=hook)
    try:
        gen = StaticGenerator(model, batch=3, max_len=64, graphs=False, bucket=8)
        gen.prefill([[5] * 20, [6] * 13, [7] * 30])
        monkeypatch.setattr(gen, "_step", lambda: gen.pos.add_(1))  # the step's own kernels aside
        reads = _HostReads(monkeypatch)
        gen.decode(12)
        assert hook.calls == [(14, 32), (16, 40), (24, 48)]
        assert reads.count == 0
    finally:
        hf.remove(model)
