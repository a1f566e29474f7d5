"""SAAP Triton decode kernel vs the PyTorch reference.

Unmarked tests run tiny shapes with the module's tiles shrunk, so that every case walks several window
tiles, key steps, classifier tiles and merge steps with ragged tails: on CPU tensors under
TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA), or compiled on a CUDA machine. ``gpu`` tests
run the production tiles at 8k-32k keys in bf16 / fp16. Every call runs with NaN-poisoned outputs and
partials (``CONFIG.poison``): an element the kernels do not write stays NaN and fails the comparison.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

triton_mod = pytest.importorskip("runtime_kernels.saap.triton")
tconf = pytest.importorskip("runtime_kernels.saap.triton_config")

from runtime_kernels.saap import (  # noqa: E402
    BucketIndex,
    SaapLayerParams,
    classify_queries,
    rank_buckets,
    saap_decode_attention,
    saap_decode_attention_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# tiles small enough that a tiny shape walks several of each, with ragged tails
SMALL_TILES = dict(block_n=16, min_win_steps=2, max_win_tiles=4, linear_block_k=16, linear_block_n=16,
                   merge_block_p=4, merge_block_d=16, gemv1_block_n=16, gemv_block_k=16)


@pytest.fixture(autouse=True)
def _poisoned_small_tiles(monkeypatch, request):
    """NaN-poisoned buffers; for the tiny-shape tests 16-key steps, 32-key window tiles, 4 partials per
    merge step and 16-wide classifier / merge tiles (several of each, ragged tails)."""
    cfg = replace(tconf.CONFIG, poison=True)
    if request.node.get_closest_marker("gpu") is None:
        cfg = replace(cfg, **SMALL_TILES)
    monkeypatch.setattr(tconf, "CONFIG", cfg)


def _params(hq, hkv, d, c, hd, sink, recent, *, seed=0, device="cpu", wdtype=torch.float32) -> SaapLayerParams:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    p = SaapLayerParams(sink=sink, recent=recent, centroids=r(hkv, c, d), w1=r(hq, d, hd) / math.sqrt(d),
                        b1=r(hq, hd) * 0.1, bn_mean=r(hq, hd) * 0.1, bn_var=torch.rand(hq, hd, generator=g) + 0.5,
                        bn_weight=r(hq, hd), bn_bias=r(hq, hd) * 0.1, w2=r(hq, hd, c) * (3 / math.sqrt(hd)),
                        b2=r(hq, c) * 0.1).to(device)
    p.w1, p.w2 = p.w1.to(wdtype), p.w2.to(wdtype)
    return p


def _case(b, hq, hkv, t, d, c, sink, recent, *, structured=False, seed=0, dtype=torch.float32, hd=32,
          device=DEV, wdtype=torch.float32):
    """Inputs of one decode step: (q, q_derope, k, v, params, index). ``structured``: keys are scaled
    centroids plus noise (clustered, peaked attention), the sink key is aligned with every query (an
    attention sink), the queries point at a few centroids, and 1/8 of the buckets are empty and ranked
    high by the classifier bias."""
    p = _params(hq, hkv, d, c, hd, sink, recent, seed=seed, device=device, wdtype=wdtype)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    rn = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    q, qd, k, v = rn(b, hq, d), rn(b, hq, d), rn(b, hkv, t, d), rn(b, hkv, t, d)
    kd = k
    if structured:
        n_empty = max(1, c // 8)
        live = c - n_empty  # buckets live .. c-1 get no key: their centroids are far away
        p.centroids[:, live:] += 1e3
        pick = torch.randint(0, live, (b, hkv, t), generator=g, device=device)
        cent = p.centroids[torch.arange(hkv, device=device)[None, :, None], pick]  # [B, Hkv, T, D]
        kd = cent + 0.3 * rn(b, hkv, t, d)
        k = 2.0 * kd
        hot = p.centroids[torch.arange(hkv, device=device).repeat_interleave(hq // hkv), :3].mean(1)  # [Hq, D]
        q = 1.5 * hot[None] + 0.2 * rn(b, hq, d)
        k[:, :, 0] = q.view(b, hkv, hq // hkv, d).mean(2)  # attention sink
        p.b2[:, live:] += 4.0
    idx = BucketIndex.build(kd, p.centroids, sink=sink, recent=recent)
    return q.to(dtype), qd.to(dtype), k.to(dtype), v.to(dtype), p, idx


def _ref(q, qd, k, v, idx, p, top_l):
    """The reference in float32 (its definition of correct), returned in float64."""
    p32 = replace(p, w1=p.w1.float(), w2=p.w2.float())
    return saap_decode_attention_reference(q.float(), qd.float(), k.float(), v.float(), idx, p32, top_l).double()


def _dense64(q, k, v):
    b, hq, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("bhgd,bhtd->bhgt", q.double().view(b, hkv, hq // hkv, d), k.double()) / math.sqrt(d)
    return (torch.softmax(s, -1) @ v.double()).view(b, hq, d)


def _row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over (b, head) of ||out - ref|| / ||ref|| (NaN anywhere -> inf)."""
    if torch.isnan(out).any():
        return float("inf")
    err = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    return float(err.max())


# -------------------------------------------------------------------------------------------- interpreter
# float32 end to end: the kernel and the reference differ by summation order and exp2 vs exp only
# (~1e-7 relative per op, a few hundred terms), so 2e-5 leaves a wide margin and still catches any
# wrong key, wrong bucket or wrong merge weight (those are O(1e-2) or more).
TOL32 = 2e-5
# classifier probabilities: exact fp32 dots in the interpreter; compiled, float32 weights use tf32x3
# dots (~1e-6 relative on the logits, so up to a few 1e-6 on a probability near 1)
PROB_ATOL = 1e-6 if DEV == "cpu" else 1e-5

SHAPES = [  # b, hq, hkv, t, d, c, sink, recent, top_l
    (1, 4, 4, 301, 64, 8, 1, 37, 3),  # G = 1
    (3, 8, 2, 157, 64, 7, 2, 21, 2),  # G = 4, B = 3, C not a power of two
    (2, 8, 2, 203, 128, 16, 1, 40, 5),  # D = 128
    (1, 6, 2, 99, 64, 5, 0, 13, 5),  # G = 3, no sink, ℓ = C
]
IDS = [f"B{s[0]}-Hq{s[1]}-Hkv{s[2]}-T{s[3]}-D{s[4]}-C{s[5]}-L{s[8]}" for s in SHAPES]


@pytest.mark.parametrize("structured", [False, True], ids=["random", "structured"])
@pytest.mark.parametrize("b,hq,hkv,t,d,c,sink,recent,top_l", SHAPES, ids=IDS)
def test_matches_reference(b, hq, hkv, t, d, c, sink, recent, top_l, structured):
    q, qd, k, v, p, idx = _case(b, hq, hkv, t, d, c, sink, recent, structured=structured)
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=top_l, scale=None)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, top_l)) < TOL32


SCHEDULES = [  # CONFIG settings that change how the work is cut, never the result
    {"bkt_pack": 0},  # one bucket per program (what auto packing picks for large buckets)
    {"bkt_pack": 4},  # four buckets per program as one key list (prefix-summed counts; ragged last group)
    {"bkt_pack": 2, "block_n": 16},  # packed lists longer than one key step
    {"small_batch_max_b": 0},  # the large-batch (tensor-core) classifier at every batch size
    {"rank_filter": 2},  # top-ℓ over the keys above the chunk-maximum threshold (compacted)
    {"rank_filter": 0},  # top-ℓ by sorting every key
    {"win_programs": 4},  # window tiles capped by a program budget (one or two long tiles per KV head)
]


@pytest.mark.parametrize("sched", SCHEDULES, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s in SCHEDULES])
def test_schedules_match_reference(sched, monkeypatch):
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, **sched))
    for shape, structured in ((SHAPES[1], True), (SHAPES[0], False)):
        b, hq, hkv, t, d, c, sink, recent, top_l = shape
        q, qd, k, v, p, idx = _case(b, hq, hkv, t, d, c, sink, recent, structured=structured)
        out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=top_l, scale=None)
        assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, top_l)) < TOL32


def test_auto_packing_rule(monkeypatch):
    """``bkt_pack = -1``: the largest power of two (2..8) of mean-size buckets that fits one key step of
    ``block_n``; Llama shapes (C = 1024, window 2048, block_n 64): 8 at 8k, 2 at 32k, none at 128k."""
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, bkt_pack=-1, block_n=64))
    assert [triton_mod._pack(t - 2048, 1024) for t in (8192, 32768, 131072)] == [8, 2, 0]
    assert triton_mod._pack(100, 1) == 0 and triton_mod._pack(0, 8) == 0 and triton_mod._pack(10, None) == 0
    assert triton_mod._pack(64 * 5, 15) == 2  # 21.3 keys per bucket: 3 fit, the power of two below is 2
    for fixed in (0, 4):
        monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, bkt_pack=fixed))
        assert triton_mod._pack(6144, 1024) == fixed
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, bkt_pack=3))
    with pytest.raises(ValueError, match="power of two"):
        triton_mod._pack(6144, 1024)


def test_empty_buckets_are_visited_and_weigh_nothing(monkeypatch):
    q, qd, k, v, p, idx = _case(2, 8, 2, 180, 64, 16, 1, 20, structured=True)
    logits = triton_mod.saap_classifier_logits_triton(qd, p)
    sel = triton_mod.saap_rank_buckets_triton(logits, 4, 6)
    sizes = idx.bucket_count.gather(-1, sel.long())
    assert (sizes == 0).any() and (sizes > 0).any()  # the case really mixes empty and full buckets
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=6, scale=None)
    assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, 6)) < TOL32
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, bkt_pack=4))  # empty buckets inside packed lists
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=6, scale=None)
    assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, 6)) < TOL32


@pytest.mark.parametrize("small_max_b", [0, 16], ids=["large-batch", "small-batch"])
@pytest.mark.parametrize("b", [1, 3])
def test_classifier_and_ranking_match_reference(b, small_max_b, monkeypatch):
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, small_batch_max_b=small_max_b))
    q, qd, k, v, p, idx = _case(b, 6, 2, 40, 64, 20, 1, 8)
    logits = triton_mod.saap_classifier_logits_triton(qd, p)
    probs = classify_queries(qd, p)
    assert torch.allclose(torch.softmax(logits.double(), -1), probs.double(), atol=PROB_ATOL)
    for top_l in (1, 5, 20, 50):
        ref = rank_buckets(probs, 3, top_l)
        for sel in (triton_mod.saap_rank_buckets_triton(logits, 3, top_l),
                    triton_mod.saap_select_buckets_triton(qd, p, 3, top_l)):  # the decode step's fused path
            assert sel.shape == ref.shape and sel.dtype == torch.int32
            assert torch.equal(sel.long().sort(-1).values, ref.sort(-1).values)


@pytest.mark.parametrize("kind", ["peaked", "random", "flat", "ties"])
@pytest.mark.parametrize("top_l", [2, 5, 8])
def test_rank_filter_matches_full_sort(kind, top_l, monkeypatch):
    """The candidate filter (``rank_filter``) picks the same buckets as sorting all of them, whether few
    keys pass the chunk-maximum threshold (compacted path) or nearly all do (fallback: flat scores, ties,
    a padded last chunk at C = 96)."""
    g = torch.Generator().manual_seed(top_l)
    b, hq = 3, 8
    compacted = 0
    chunks = pytest.importorskip("runtime_kernels.saap.triton_rank").THRESHOLD_CHUNKS
    for c in (96, 256):
        logits = {
            "peaked": 6.0 * torch.randn(b, hq, c, generator=g),
            "random": torch.randn(b, hq, c, generator=g),
            "flat": torch.zeros(b, hq, c),
            "ties": torch.randint(0, 3, (b, hq, c), generator=g).float(),
        }[kind].to(DEV)
        probs = torch.softmax(logits.double(), -1)
        score = probs.view(b, 2, 4, c).sum(2)
        k_pad = max(2, 1 << (top_l - 1).bit_length())
        if c == 256:  # how many rows take the compacted path (the kernel's rule, recomputed)
            maxima = score.view(b, 2, chunks * k_pad, -1).amax(-1)  # tau: the k_pad-th largest maximum
            tau = maxima.topk(k_pad, -1).values[..., -1:]
            compacted += int(((score >= tau).sum(-1) <= 2 * k_pad).sum())
        monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, rank_filter=0))
        full = triton_mod.saap_rank_buckets_triton(logits, 4, top_l)
        monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, rank_filter=2))
        filtered = triton_mod.saap_rank_buckets_triton(logits, 4, top_l)
        assert torch.equal(filtered, full)  # same buckets in the same order
        if kind in ("peaked", "random"):  # no exact ties: the reference's set too
            assert torch.equal(filtered.long().sort(-1).values, rank_buckets(probs, 4, top_l).sort(-1).values)
    if kind == "peaked":
        assert compacted > 0  # the filter's own path really ran


def test_ranking_of_known_scores():
    # group 2: KV head 0 sums to [1.0, 0.2, 1.5, ...]; independent of the classifier
    probs = torch.full((1, 4, 8), 0.01, device=DEV)
    probs[0, 0, [0, 2]] = torch.tensor([0.9, 0.5], device=DEV)
    probs[0, 1, [1, 2]] = torch.tensor([0.2, 1.0], device=DEV)
    probs[0, 2:, 5] = 0.7
    sel = triton_mod.saap_rank_buckets_triton(probs.log(), 2, 3)  # softmax(log p) = p / Σp, same order
    assert sel[0, 0].tolist()[:2] == [2, 0] and sel[0, 1, 0] == 5


def test_bf16_inputs_and_weights():
    # bf16 K/V/q (the kernel rounds p to bf16 before P·V, like a GPU run): within bf16 tolerance of the
    # float32 reference; bf16 classifier weights take the activations as four bf16 terms, so the logits
    # are fp32-exact and the bucket choice equals the reference's (which upcasts the same bf16 weights).
    q, qd, k, v, p, idx = _case(2, 8, 2, 150, 64, 8, 1, 20, dtype=torch.bfloat16, wdtype=torch.bfloat16)
    logits = triton_mod.saap_classifier_logits_triton(qd, p)
    p32 = replace(p, w1=p.w1.float(), w2=p.w2.float())
    assert torch.allclose(torch.softmax(logits, -1), classify_queries(qd, p32), atol=PROB_ATOL)
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=3, scale=0.1)
    ref = saap_decode_attention_reference(q.float(), qd.float(), k.float(), v.float(), idx, p32, 3, 0.1).double()
    assert out.dtype == torch.bfloat16 and _row_rel_err(out, ref) < 2e-2


def test_incremental_index_with_slack():
    """The index after decode appends (slack slots, several relayouts) is read through slot_start/count."""
    q, qd, k, v, p, full = _case(2, 8, 2, 230, 64, 8, 1, 16)
    kd = k  # _case keys are their own de-RoPE'd keys (random case)
    idx = BucketIndex.build(kd[:, :, :150], p.centroids, sink=1, recent=16)
    for t in range(150, 230):
        idx.append(kd[:, :, t:t + 1])
    assert idx.slots.shape[-1] > 230 - 17  # slack present: the slots are not packed
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=3, scale=None)
    assert _row_rel_err(out, _ref(q, qd, k, v, full, p, 3)) < TOL32


def _classifier64(qd, p):
    """Float64 classifier on the same (possibly bf16-valued) weights and query: ``(hidden, logits)``,
    an independent reference for the kernels' float32-exact paths."""
    p64 = replace(p, w1=p.w1.double(), w2=p.w2.double(), b1=p.b1.double(), b2=p.b2.double(),
                  bn_mean=p.bn_mean.double(), bn_var=p.bn_var.double(), bn_weight=p.bn_weight.double(),
                  bn_bias=p.bn_bias.double())
    hid = torch.relu((torch.einsum("bhd,hdn->bhn", qd.double(), p64.w1) + p64.b1 - p64.bn_mean)
                     / torch.sqrt(p64.bn_var + p.bn_eps) * p64.bn_weight + p64.bn_bias)
    return hid, torch.einsum("bhk,hkn->bhn", hid, p64.w2) + p64.b2


@pytest.mark.parametrize("b", [1, 3])
def test_small_batch_classifier_three_terms_keep_float32_precision(b):
    """bf16 weights through the small-batch path: the hidden enters layer 2 as three bf16 terms, so the
    logits equal a float64 evaluation of the same (bf16-valued) weights to float32 rounding; a single bf16
    hidden (what a plain bf16 matmul would take) is ~1e-3 off, far outside that."""
    _, qd, _, _, p, _ = _case(b, 8, 2, 40, 64, 24, 1, 8, hd=96, wdtype=torch.bfloat16)
    logits = triton_mod.saap_classifier_logits_triton(qd, p).double()
    hid, ref = _classifier64(qd, p)
    scale = ref.abs().amax(-1, keepdim=True)
    assert ((logits - ref).abs() / scale).max() < 1e-5
    one_term = torch.einsum("bhk,hkn->bhn", hid.bfloat16().double(), p.w2.double()) + p.b2.double()
    assert ((one_term - ref).abs() / scale).max() > 1e-4  # the split is what buys the precision
    for top_l in (3, 7):
        ref_sel = rank_buckets(torch.softmax(ref, -1), 4, top_l).sort(-1).values
        assert torch.equal(triton_mod.saap_select_buckets_triton(qd, p, 4, top_l).long().sort(-1).values, ref_sel)


class _Spy:
    """Stands in for a Triton kernel and records the grid of every launch."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("b", [1, 5, 17])
def test_tensor_core_layer1_equals_gemv_for_16bit_queries(b, monkeypatch):
    """A bf16 query with bf16 weights takes layer 1 on tensor cores: every product is exact in fp32, so
    its logits equal the GEMV layer 1's (which a float32 query of the same values takes) up to float32
    summation order, and both equal a float64 evaluation of the same bf16 values to float32 rounding;
    the ranking is the same. B = 17 spans two 16-row blocks on tensor cores, and takes the GEMV's
    32-row tile with half the hidden units per program (its [rows, k, units] product stays the same size)."""
    _, qd, _, _, p, _ = _case(b, 8, 2, 40, 64, 24, 1, 8, hd=96, dtype=torch.bfloat16, wdtype=torch.bfloat16)
    assert qd.dtype == p.w1.dtype == torch.bfloat16
    small = pytest.importorskip("runtime_kernels.saap.triton_classifier_small_batch")
    spy, gemv_spy = _Spy(small._layer1_dot_kernel), _Spy(small._layer1_gemv_kernel)
    monkeypatch.setattr(small, "_layer1_dot_kernel", spy)
    monkeypatch.setattr(small, "_layer1_gemv_kernel", gemv_spy)
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, small_batch_max_b=32, l1_dot_block_n=32,
                                                 gemv1_block_n=32))
    dot = triton_mod.saap_classifier_logits_triton(qd, p).double()
    assert spy.grids and spy.grids[0][2] == -(-b // 16)
    gemv = triton_mod.saap_classifier_logits_triton(qd.float(), p).double()
    assert len(spy.grids) == 1  # the float32 query took the GEMV
    assert gemv_spy.grids == [(8, 96 // (16 if b > 16 else 32))]
    _, ref = _classifier64(qd, p)
    scale = ref.abs().amax(-1, keepdim=True)
    assert ((dot - ref).abs() / scale).max() < 1e-5
    assert ((dot - gemv).abs() / scale).max() < 1e-5
    ref_sel = rank_buckets(torch.softmax(ref, -1), 4, 5).sort(-1).values
    assert torch.equal(triton_mod.saap_select_buckets_triton(qd, p, 4, 5).long().sort(-1).values, ref_sel)


@pytest.mark.parametrize("b, l2_rows", [(1, 16), (5, 16), (17, 16), (17, 32), (32, 32)])
def test_triton_layer2_equals_product_of_its_terms(b, l2_rows, monkeypatch):
    """Layer 2 (the three hidden terms in one tile, summed in its epilogue, ``b2`` added) gives the float64
    product of the same three terms with w2 plus b2 to float32 rounding, the float64 classifier's logits
    too, and the same buckets. B = 5 pads the tile's batch rows; B = 17 spans two 16-row blocks, or pads
    one 32-row block (128 tile rows); C = 40 in column blocks of 16 (a ragged last block), hidden 96 in k
    steps of 32."""
    _, qd, _, _, p, _ = _case(b, 8, 2, 40, 64, 40, 1, 8, hd=96, dtype=torch.bfloat16, wdtype=torch.bfloat16)
    small = pytest.importorskip("runtime_kernels.saap.triton_classifier_small_batch")
    spy = _Spy(small._layer2_kernel)
    monkeypatch.setattr(small, "_layer2_kernel", spy)
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, small_batch_max_b=32, l1_dot_block_n=32,
                                                 l2_block_k=32, l2_block_n=16, l2_rows=l2_rows))
    tri = triton_mod.saap_classifier_logits_triton(qd, p).double()
    assert spy.grids and spy.grids[0][1] == 3 and spy.grids[0][2] == -(-b // l2_rows)
    hidden = small.layer1_terms(qd, p)  # [Hq, 3·B, Hd] bf16, rows t·B + i
    assert hidden.shape == (8, 3 * b, 96) and hidden.dtype == torch.bfloat16
    terms = hidden.double().view(8, 3, b, 96).sum(1)  # [Hq, B, Hd]
    product = torch.einsum("hbk,hkn->bhn", terms, p.w2.double()) + p.b2.double()
    _, ref = _classifier64(qd, p)
    scale = ref.abs().amax(-1, keepdim=True)
    assert ((tri - ref).abs() / scale).max() < 1e-5
    assert ((tri - product).abs() / scale).max() < 1e-5
    ref_sel = rank_buckets(torch.softmax(ref, -1), 4, 6).sort(-1).values
    assert torch.equal(triton_mod.saap_select_buckets_triton(qd, p, 4, 6).long().sort(-1).values, ref_sel)


@pytest.mark.parametrize("b", [3, 33], ids=["small-batch", "large-batch"])
@pytest.mark.parametrize("w1_dtype, w2_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["w1-bf16", "w2-bf16"])
def test_mixed_weight_dtypes_keep_float32_precision(b, w1_dtype, w2_dtype):
    """Layers of different dtypes (a bf16 query): each path still gives the float64 classifier's logits of
    the same weight values to float32 rounding, and its buckets."""
    _, qd, _, _, p, _ = _case(b, 8, 2, 40, 64, 24, 1, 8, hd=96, dtype=torch.bfloat16)
    p.w1, p.w2 = p.w1.to(w1_dtype), p.w2.to(w2_dtype)
    logits = triton_mod.saap_classifier_logits_triton(qd, p).double()
    _, ref = _classifier64(qd, p)
    scale = ref.abs().amax(-1, keepdim=True)
    assert ((logits - ref).abs() / scale).max() < 1e-5
    ref_sel = rank_buckets(torch.softmax(ref, -1), 4, 5).sort(-1).values
    assert torch.equal(triton_mod.saap_select_buckets_triton(qd, p, 4, 5).long().sort(-1).values, ref_sel)


def test_all_buckets_dense_layer_and_short_cache_equal_dense_attention():
    q, qd, k, v, p, idx = _case(2, 8, 2, 121, 64, 6, 1, 10)
    dense = _dense64(q, k, v)  # independent float64 softmax attention
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=6, scale=None)
    assert _row_rel_err(out, dense) < TOL32
    out = triton_mod.saap_decode_attention_triton(q, None, k, v, None, SaapLayerParams(sink=1, recent=3, dense=True),
                                                  top_l=2, scale=None)
    assert _row_rel_err(out, dense) < TOL32
    q, qd, k, v, p, idx = _case(1, 4, 2, 9, 64, 4, 1, 20)  # T < window: all dense
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=2, scale=None)
    assert _row_rel_err(out, _dense64(q, k, v)) < TOL32


def test_window_only_and_strided_cache():
    q, qd, k, v, p, idx = _case(2, 4, 2, 90, 64, 4, 2, 11)
    ref0 = _ref(q, qd, k, v, idx, p, 0)
    out0 = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=0, scale=None)
    assert _row_rel_err(out0, ref0) < TOL32
    # a cache with spare capacity (HF-style [B, Hkv, T_cap, D] sliced to T) and a transposed-storage q
    big_k, big_v = torch.randn(2, 2, 130, 64, device=DEV), torch.randn(2, 2, 130, 64, device=DEV)
    big_k[:, :, :90], big_v[:, :, :90] = k, v
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    out = triton_mod.saap_decode_attention_triton(qt, qd, big_k[:, :, :90], big_v[:, :, :90], idx, p, top_l=2,
                                                  scale=None)
    assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, 2)) < TOL32


def test_api_dispatches_to_triton():
    q, qd, k, v, p, idx = _case(1, 4, 2, 70, 64, 4, 1, 9)
    out = saap_decode_attention(q, k, v, idx, p, top_l=2, q_derope=qd, impl="triton")
    assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, 2)) < TOL32
    with pytest.raises(ValueError, match="covers"):
        triton_mod.saap_decode_attention_triton(q, qd, k[:, :, :-1], v[:, :, :-1], idx, p, top_l=2)
    q64, qd64, k64, v64 = (t.double() for t in (q, qd, k, v))  # float64: the reference itself
    out64 = triton_mod.saap_decode_attention_triton(q64, qd64, k64, v64, idx, p, top_l=2)
    assert torch.equal(out64, saap_decode_attention_reference(q64, qd64, k64, v64, idx, p, 2))


# ---------------------------------------------------------------------------------------------------- GPU
# bf16 / fp16 vs the float32 reference: bf16 rounding of the output (2^-9) and of the probabilities
# before P·V give ~4e-3 per row; the bound is 2e-2.
GPU_TOL = 2e-2
GPU_CASES = [  # b, hq, hkv, t, d, c, top_l
    (2, 32, 8, 8193, 128, 256, 16),
    (1, 32, 8, 32768, 128, 1024, 32),
    (3, 8, 8, 12345, 64, 128, 8),  # G = 1, D = 64, B = 3, odd length
]
GPU_IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-T{c[3]}-D{c[4]}-C{c[5]}-L{c[6]}" for c in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("structured", [False, True], ids=["random", "structured"])
@pytest.mark.parametrize("b,hq,hkv,t,d,c,top_l", GPU_CASES, ids=GPU_IDS)
def test_gpu_matches_reference(b, hq, hkv, t, d, c, top_l, structured, dtype):
    q, qd, k, v, p, idx = _case(b, hq, hkv, t, d, c, 1, 2047, structured=structured, dtype=dtype, hd=256,
                                device="cuda")
    ref = _ref(q, qd, k, v, idx, p, top_l)
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=top_l, scale=None)
    assert _row_rel_err(out, ref) < GPU_TOL
    out = saap_decode_attention(q, k, v, idx, p, top_l=top_l, q_derope=qd)  # the public dispatch
    assert _row_rel_err(out, ref) < GPU_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("pack", [4, 16])
@pytest.mark.parametrize("b,hq,hkv,t,d,c,top_l", GPU_CASES, ids=GPU_IDS)
def test_gpu_packed_buckets_match_reference(b, hq, hkv, t, d, c, top_l, pack, monkeypatch):
    """``bkt_pack``: several selected buckets per program as one key list, bf16, structured inputs."""
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, bkt_pack=pack, poison=True))
    q, qd, k, v, p, idx = _case(b, hq, hkv, t, d, c, 1, 2047, structured=True, dtype=torch.bfloat16, hd=256,
                                device="cuda")
    out = triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=top_l, scale=None)
    assert _row_rel_err(out, _ref(q, qd, k, v, idx, p, top_l)) < GPU_TOL


GPU_CLASSIFIERS = {  # named CONFIG overrides: both classifier paths and the unfiltered ranking
    "small-batch": {},
    "large-batch": dict(small_batch_max_b=0),
    "rank-full-sort": dict(rank_filter=0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CLASSIFIERS))
@pytest.mark.parametrize("b", [1, 2, 4, 16, 32])
def test_gpu_bf16_classifier_ranks_like_reference(b, name, monkeypatch):
    """bf16 weights at Llama shapes (hidden 1024, C = 1024): the kernel's top-ℓ is the reference's set,
    except where the ℓ-th and (ℓ+1)-th group scores are within float32 rounding (1e-5 relative)."""
    monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, **GPU_CLASSIFIERS[name]))
    _, qd, _, _, p, _ = _case(b, 32, 8, 64, 128, 1024, 1, 16, hd=1024, wdtype=torch.bfloat16, device="cuda",
                              dtype=torch.bfloat16)
    logits = triton_mod.saap_classifier_logits_triton(qd, p)
    probs = classify_queries(qd, replace(p, w1=p.w1.float(), w2=p.w2.float()))
    assert torch.allclose(torch.softmax(logits, -1), probs, atol=1e-6, rtol=1e-4)
    score = probs.view(b, 8, 4, 1024).sum(2)
    top = score.sort(-1, descending=True).values
    for top_l in (16, 32, 64):
        ref = rank_buckets(probs, 4, top_l).sort(-1).values
        near_tie = (top[..., top_l - 1] - top[..., top_l]) <= 1e-5 * top[..., top_l - 1]
        for sel in (triton_mod.saap_rank_buckets_triton(logits, 4, top_l),
                    triton_mod.saap_select_buckets_triton(qd, p, 4, top_l)):
            same = (sel.long().sort(-1).values == ref).all(-1)
            assert (same | near_tie).all()


@pytest.mark.gpu
def test_gpu_dense_layer_and_graph_capture(monkeypatch):
    """Dense layer = dense attention; the whole step captures in a CUDA graph (no host sync) and replays."""
    q, qd, k, v, p, idx = _case(2, 32, 8, 8191, 128, 256, 1, 2047, dtype=torch.bfloat16, device="cuda")
    out = triton_mod.saap_decode_attention_triton(q, None, k, v, None, SaapLayerParams(sink=1, recent=7, dense=True),
                                                  top_l=1, scale=None)
    assert _row_rel_err(out, _dense64(q.float(), k.float(), v.float())) < GPU_TOL
    step = lambda: triton_mod.saap_decode_attention_triton(q, qd, k, v, idx, p, top_l=16, scale=None)  # noqa: E731
    for cfg in ({}, dict(small_batch_max_b=0)):  # both classifier paths, each replayed twice
        monkeypatch.setattr(tconf, "CONFIG", replace(tconf.CONFIG, **cfg))
        eager = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager)

