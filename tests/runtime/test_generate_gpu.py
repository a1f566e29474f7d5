"""CUDA graphs: the static-cache loop generates the eager path's tokens on the shipped tiny model.

Each method's greedy tokens from :class:`StaticGenerator` (preallocated cache, one graph per step, the
Triton kernels reading the valid length on the device) must equal transformers' eager DynamicCache
path with the same runtime: SAAP with ℓ covering every bucket (both then attend every key), SANTA with a
seed (draws keyed on the position, so both sample alike), the prefill methods (eager in both).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_kernels import hf
from runtime_kernels.generate import StaticGenerator, StepTimes, eager_generate
from runtime_kernels.saap import SaapDecode

pytestmark = pytest.mark.gpu
TINY = Path(__file__).resolve().parents[2] / "artifacts" / "models" / "tiny"


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="sdpa")
    return model.to("cuda").eval().requires_grad_(False)


def _prompt(b: int, t: int, vocab: int) -> torch.Tensor:
    return torch.randint(4, vocab, (b, t), generator=torch.Generator().manual_seed(5)).cuda()


def _saap(model, top_l: int, **options):
    """SAAP through its buckets even at ℓ = C = 16 (the runtime serves such layers densely): its kernel under test."""
    from runtime_kernels.saap import SaapLayerParams
    from tests.runtime.saap.through_buckets import SaapThroughBuckets

    cfg = model.config
    hq, hkv, d, c, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16, 64
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    layers = [SaapLayerParams(sink=1, recent=63, dense=True)] + [
        SaapLayerParams(sink=1, recent=63, centroids=r(hkv, c, d), w1=r(hq, d, hd) / 8, b1=r(hq, hd) * 0.1,
                        bn_mean=r(hq, hd) * 0.1, bn_var=torch.rand(hq, hd, generator=g) + 0.5, bn_weight=r(hq, hd),
                        bn_bias=r(hq, hd) * 0.1, w2=r(hq, hd, c) * 0.3, b2=r(hq, c) * 0.1)
        for _ in range(1, cfg.num_hidden_layers)]
    return SaapThroughBuckets(layers, top_l=top_l, **{"stats": False, **options})


def _runtimes(model, name: str):
    from runtime_kernels.sale.api import SalePrefill
    from runtime_kernels.sampleattention.api import SampleAttentionPrefill
    from runtime_kernels.sampleattention.buckets import BucketRow
    from runtime_kernels.santa.runtime import SantaDecode

    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    if name == "dense":
        return None, None
    if name == "saap":
        return None, _saap(model, top_l=16)
    if name == "santa-after-layer-0":  # layer 0's budget covers every key: each step starts sampling at layer 1
        return None, SantaDecode([4096, 32, 48, 16][:layers], tiling="flash", tile=256, seed=3)
    if name.startswith("santa"):
        return None, SantaDecode([64, 32, 48, 16][:layers], tiling=name.split("-")[1], tile=256, seed=3)
    if name == "sale":
        return SalePrefill(torch.full((layers, heads), 0.008)), None
    return SampleAttentionPrefill(BucketRow(0.95, 0.9, 2), report_cra=False), _saap(model, top_l=16)


@pytest.mark.parametrize("name", ["dense", "saap", "santa-prop", "santa-flash", "santa-after-layer-0", "sale",
                                  "sampleattention+saap"])
@pytest.mark.parametrize("b,t", [(1, 700), (2, 520)], ids=["B1-T700", "B2-T520"])
def test_graphed_static_loop_generates_the_eager_tokens(tiny, name: str, b: int, t: int):
    ids = _prompt(b, t, tiny.config.vocab_size)
    prefill, decode = _runtimes(tiny, name)
    if prefill or decode:
        hf.attach(tiny, prefill=prefill, decode=decode)
    try:
        want = eager_generate(tiny, ids, 40)
        prefill, decode = _runtimes(tiny, name)  # fresh state (SAAP's index)
        if prefill or decode:
            hf.attach(tiny, prefill=prefill, decode=decode)
        times = StepTimes()
        got = StaticGenerator(tiny, batch=b, max_len=t + 48, bucket=16).generate(ids, 40, times)
    finally:
        hf.remove(tiny)
    assert times.captures >= 2 and len(times.step_ms) >= 30  # several views: the hooks and recaptures ran
    assert torch.equal(got, want)


def test_graphed_saap_statistics_equal_the_loop_without_graphs(tiny):
    """SAAP's selectivity sums, added on the device inside the graphs (every replay into the buffer of
    the capture, warm-up steps dropped, several views), equal the same loop run without graphs: the same
    tokens, the same sums and step count."""
    ids = _prompt(2, 520, tiny.config.vocab_size)
    runs = {}
    for graphs in (False, True):
        rt = _saap(tiny, top_l=2, stats=True)  # calib eval's options
        hf.attach(tiny, decode=rt)
        try:
            times = StepTimes()
            tokens = StaticGenerator(tiny, batch=2, max_len=520 + 48, bucket=16, graphs=graphs).generate(ids, 40, times)
            runs[graphs] = tokens, rt.stats_checkpoint(), rt.pop_stats(), times.captures
        finally:
            hf.remove(tiny)
    (want, want_sums, want_means, _), (got, got_sums, got_means, captures) = runs[False], runs[True]
    assert captures >= 2 and torch.equal(got, want)
    assert float(got_sums[2]) == float(want_sums[2]) == 40 * (tiny.config.num_hidden_layers - 1) * 2 * \
        tiny.config.num_key_value_heads  # steps x SAAP layers x rows x KV heads
    torch.testing.assert_close(got_sums, want_sums, atol=1e-9, rtol=0)
    assert got_means == pytest.approx(want_means, abs=1e-9, rel=0) and 0 < got_means["selectivity"] < 1


@pytest.mark.parametrize("name", ["dense", "saap", "santa-prop"])
@pytest.mark.parametrize("b,t", [(1, 700), (2, 520)], ids=["B1-T700", "B2-T520"])
def test_compiled_graphed_static_loop_generates_the_eager_tokens(tiny, name: str, b: int, t: int):
    """torch.compile'd decode steps inside the CUDA graphs: the eager tokens. Compilation happens in the
    warm-ups before capture (a capture that compiled would fail) at the first two view lengths, none
    after (earlier cases of this module compiled most frames already: the count is only checked later)."""
    ids = _prompt(b, t, tiny.config.vocab_size)
    _, decode = _runtimes(tiny, name)
    if decode:
        hf.attach(tiny, decode=decode)
    try:
        want = eager_generate(tiny, ids, 40)
        _, decode = _runtimes(tiny, name)  # fresh state (SAAP's index)
        if decode:
            hf.attach(tiny, decode=decode)
        first, later = StepTimes(), StepTimes()
        gen = StaticGenerator(tiny, batch=b, max_len=t + 48, bucket=16, compile=True)
        got = torch.cat([gen.generate(ids, 24, first), gen.decode(16, later)], 1)  # 24 steps cross 2+ views
    finally:
        hf.remove(tiny)
    assert first.captures >= 2 and later.captures >= 1 and later.compiles == 0
    assert torch.equal(got, want)


def test_later_requests_replay_the_kept_dense_graphs_and_generate_the_eager_tokens(tiny):
    """Dense decoding keeps each view's step graph across requests: a second prompt of the same length
    captures nothing, a longer one only its new views, and every request gets its eager tokens. SANTA
    (draws keyed on seed and position, read from kept buffers) keeps its graphs; so does SAAP that runs in
    no layer (ℓ = C), and sparse SAAP (its indexes in kept storage)."""
    vocab = tiny.config.vocab_size
    prompts = [_prompt(2, 520, vocab), _prompt(2, 520, vocab).flip(1), _prompt(2, 540, vocab)]
    try:
        want = [eager_generate(tiny, ids, 40) for ids in prompts]
        gen = StaticGenerator(tiny, batch=2, max_len=640, bucket=16)
        times = [StepTimes() for _ in prompts]
        got = [gen.generate(ids, 40, t) for ids, t in zip(prompts, times)]
        # views (valid length rounded up to 16) 528, 544, 560 for 520 + 40; 544 … 592 for 540 + 40: 576, 592 new
        assert [t.captures for t in times] == [3, 0, 2]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        hf.attach(tiny, decode=_runtimes(tiny, "santa-prop")[1])
        sampled = [StepTimes() for _ in prompts[:2]]
        got = [gen.generate(ids, 40, t) for ids, t in zip(prompts[:2], sampled)]
        assert [t.captures for t in sampled] == [3, 0]
        assert all(torch.equal(g, eager_generate(tiny, ids, 40)) for g, ids in zip(got, prompts[:2]))
        # SAAP at ℓ = C runs dense attention in every layer: nothing of a request in its step, graphs kept
        hf.attach(tiny, decode=SaapDecode(_saap(tiny, top_l=16).layers, top_l=16, stats=False))
        kept = [StepTimes() for _ in prompts[:2]]
        got = [gen.generate(ids, 40, t) for ids, t in zip(prompts[:2], kept)]
        assert [t.captures for t in kept] == [3, 0]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        # sparse SAAP (ℓ = 2): its indexes end where the view puts them, in storage the runtime keeps, so
        # the graphs are kept too; a replay for a later request generates what that request's own eager
        # static steps (same indexes, no graph) generate
        sparse = SaapDecode(_saap(tiny, top_l=2).layers, top_l=2, stats=False)
        hf.attach(tiny, decode=sparse)
        own = [StaticGenerator(tiny, batch=2, max_len=640, bucket=16, graphs=False).generate(ids, 40)
               for ids in prompts]
        later = [StepTimes() for _ in prompts]
        got = [gen.generate(ids, 40, t) for ids, t in zip(prompts, later)]
        assert tiny.calib_attention.static_method_layers and not sparse.reads_request_state
        assert [t.captures for t in later] == [3, 0, 2]
        assert all(torch.equal(g, w) for g, w in zip(got, own))
    finally:
        hf.remove(tiny)


def test_the_prefill_guard_keeps_the_path_it_measured_faster(tiny, tmp_path, monkeypatch):
    """Under serve="fastest" the first prefill of a shape is timed with the prefill method on and off; the
    tokens are those of the path recorded as faster (the last run stands in the cache), and a second
    request reuses the decision without timing."""
    from runtime_kernels import serving_policy

    monkeypatch.setenv("CALIB_RUNTIME_CACHE", str(tmp_path))
    serving_policy.forget_all()
    # every layer runs the method when it is on (the layers' own choice is another test's): the guard alone
    monkeypatch.setattr(serving_policy.PrefillChooser, "run",
                        lambda self, sig, q, k, method, dense: self._served(method()))
    ids = _prompt(2, 520, tiny.config.vocab_size)
    paths = {}
    for serve, on in (("method", True), (None, False)):
        if on:
            hf.attach(tiny, prefill=_runtimes(tiny, "sale")[0], serve=serve)
        try:
            paths[on] = StaticGenerator(tiny, batch=2, max_len=600, bucket=16).generate(ids, 16)
        finally:
            hf.remove(tiny)
    hf.attach(tiny, prefill=_runtimes(tiny, "sale")[0], serve="fastest", prefill_identity="test-sale")
    try:
        gen = StaticGenerator(tiny, batch=2, max_len=600, bucket=16)
        got = gen.generate(ids, 16)
        key = next(k for k in serving_policy._MEMORY if k.startswith("prefill-model|") and "test-sale" in k)
        method_ms, dense_ms = serving_policy.measured(key)
        monkeypatch.setattr(serving_policy, "_wall_ms", lambda fn: pytest.fail("decided: nothing to time"))
        again = gen.generate(ids, 16)
    finally:
        hf.remove(tiny)
    assert torch.equal(got, paths[method_ms <= dense_ms]) and torch.equal(again, got)


@pytest.mark.parametrize("tiling", ["prop", "flash"])
def test_ragged_batch_under_graphs_equals_each_prompt_alone(tiny, tiling):
    """A batch of three prompt lengths far enough apart that each row prefills alone (one graph capture,
    each row at its own position, crossing a view change): each row's tokens equal its eager tokens alone,
    dense and with S²ANTA under per-row seeds in prefill and decode (the SANTA reward's batches). Close
    lengths prefill in one padded call: equal up to batched products' rounding, exact in float64 on the CPU."""
    from runtime_kernels.santa.runtime import SantaDecode

    vocab, layers = tiny.config.vocab_size, tiny.config.num_hidden_layers
    rows = [_prompt(1, n, vocab)[0].tolist() for n in (230, 251, 205)]
    seeds = [21, 22, 23]

    def santa(seed):
        return SantaDecode([8, 4, 6, 2][:layers], tiling=tiling, tile=256, seed=seed, phases=("prefill", "decode"))
    for rt in (None, santa(seeds)):
        if rt is not None:
            hf.attach(tiny, prefill=rt, decode=rt)
        got = StaticGenerator(tiny, batch=3, max_len=251 + 24 + 1).generate(rows, 24)  # views 256 and 512
        for b, row in enumerate(rows):
            if rt is not None:
                alone = santa(seeds[b])
                hf.attach(tiny, prefill=alone, decode=alone)
            want = eager_generate(tiny, torch.tensor([row], device="cuda"), 24)[0]
            assert torch.equal(got[b], want), (b, got[b].tolist(), want.tolist())
        hf.remove(tiny)


def test_santa_stats_under_graphs_equal_the_uncaptured_loop(tiny):
    """The replayed graphs add S²ANTA's sample counts on the device; the warm-up steps before each capture
    do not count: the same sums as the same loop without graphs."""
    from runtime_kernels.santa.runtime import SantaDecode

    vocab, layers = tiny.config.vocab_size, tiny.config.num_hidden_layers
    rows = [_prompt(1, n, vocab)[0].tolist() for n in (230, 251)]
    stats = {}
    for graphs in (False, True):
        rt = SantaDecode([8, 4, 6, 2][:layers], tiling="flash", tile=256, seed=[5, 6])
        hf.attach(tiny, decode=rt)
        StaticGenerator(tiny, batch=2, max_len=251 + 24 + 1, graphs=graphs).generate(rows, 24)
        stats[graphs] = rt.pop_stats()
    hf.remove(tiny)
    assert stats[True]["sampled_calls"] == 24 * layers
    assert stats[True] == pytest.approx(stats[False], rel=1e-12)


def test_saap_ragged_batch_under_graphs_equals_the_reference_loop(tiny):
    """A ragged batch through SAAP's Triton step under CUDA graphs (one index length, the shortest row's;
    longer rows attend the rest with the window) gives the tokens of the PyTorch reference loop without
    graphs (the CPU test checks the shortest row against its run alone, exactly, in float64)."""
    vocab = tiny.config.vocab_size
    rows = [_prompt(1, n, vocab)[0].tolist() for n in (230, 251, 244)]
    out = {}
    for impl, graphs in (("auto", True), ("reference", False)):
        hf.attach(tiny, decode=_saap(tiny, top_l=4, impl=impl))
        out[impl] = StaticGenerator(tiny, batch=3, max_len=251 + 24 + 1, graphs=graphs).generate(rows, 24)
    hf.remove(tiny)
    assert torch.equal(out["auto"], out["reference"]), (out["auto"].tolist(), out["reference"].tolist())


def test_a_request_replaying_kept_graphs_decodes_without_a_host_sync(tiny):
    """A second request of the same length replays the kept dense graphs: its decode waits on the GPU
    nowhere (the rows' positions are kept on the host), so the host can run ahead of the device."""
    ids = _prompt(2, 300, tiny.config.vocab_size)
    try:
        gen = StaticGenerator(tiny, batch=2, max_len=400, bucket=16)
        want = gen.generate(ids, 24)
        gen.prefill(ids)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = gen.decode(24)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want)
    finally:
        hf.remove(tiny)
