"""SALE Selection-Pass: quantization, estimate error, sink/local statistics, Relative Attention Score,
block selection — each checked against an independent float64 computation written here."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.blocksparse.mask import BlockMask, causal_block_mask
from runtime_kernels.sale import api
from runtime_kernels.sale.reference import (
    SaleSelectionConfig,
    approximate_scores,
    dequantize_blockwise,
    quantize_blockwise,
    relative_attention_scores,
    sale_block_scores,
    sale_select,
    select_blocks,
    sink_local_block_mask,
    sink_local_stats,
)


def _random_qk(b, hq, hkv, tq, tk, d, seed=0, dtype=torch.float64, key_offset=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    k = k + key_offset * torch.randn(b, hkv, 1, d, generator=g, dtype=torch.float64)  # shared key mean
    return q.to(dtype), k.to(dtype)


def structured_qk(t=1024, hq=4, hkv=2, d=64, amp=8.0, seed=0):
    """Attention with real block sparsity: a positional kernel (local/slash), a sink, heavy-hitter keys."""
    g = torch.Generator().manual_seed(seed)
    w = torch.logspace(-3.2, 0, 16)  # rad/token
    pos = torch.arange(t, dtype=torch.float32)[:, None] * w
    feat = torch.cat([pos.cos(), pos.sin()], -1)  # [T, 32]: q_i . k_j ~ sum_f cos(w_f (i - j))
    k = torch.cat([feat.expand(1, hkv, t, 32), torch.randn(1, hkv, t, d - 32, generator=g)], -1)
    q = torch.cat([feat.expand(1, hq, t, 32) * amp / 16 * math.sqrt(d),
                   0.7 * torch.randn(1, hq, t, d - 32, generator=g)], -1)
    k[:, :, :4, 40] += 8  # sink
    q[..., 40] += 1.0
    k[:, :, torch.randint(64, t, (12,), generator=g), 41] += 8  # heavy hitters
    q[..., 41] += 1.5 * torch.rand(1, hq, t, generator=g)
    k = k + 1.5 * torch.randn(1, hkv, 1, d, generator=g)  # common key offset: smoothing matters
    return q, k


# ------------------------------------------------------------------------------------------ quantization
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_blockwise_round_trip_within_half_step(bits):
    x = torch.randn(2, 3, 100, 16, dtype=torch.float64)
    x[0, 0, 32:64] = 0  # an all-zero block
    x_int, scales = quantize_blockwise(x, 32, bits)
    qmax = 2 ** (bits - 1) - 1
    assert x_int.dtype == torch.int8 and scales.shape == (2, 3, 4)
    assert int(x_int.abs().max()) == qmax
    step = scales.repeat_interleave(32, -1)[..., :100, None]
    assert torch.all((dequantize_blockwise(x_int, scales, 32) - x).abs() <= step / 2 + 1e-12)
    torch.testing.assert_close(scales[..., 0], x[..., :32, :].abs().amax((-1, -2)) / qmax)
    assert torch.all(x_int[0, 0, 32:64] == 0)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_scores_error_within_analytic_bound(bits):
    """|S~ - S| <= scale * (sq/2 |k_s|_1 + sk/2 |q|_1 + D sq sk / 4), from the per-block scales."""
    b, hq, hkv, t, d, bq, bk = 1, 4, 2, 200, 32, 64, 32
    q, k = _random_qk(b, hq, hkv, t, t, d)
    exact = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(d)
    approx = approximate_scores(q, k, bits=bits, block_q=bq, block_k=bk)
    k_s = (k - k.mean(-2, keepdim=True)).repeat_interleave(2, 1)
    sq = quantize_blockwise(q, bq, bits)[1].repeat_interleave(bq, -1)[..., :t, None]  # [B, H, T, 1]
    sk = quantize_blockwise(k - k.mean(-2, keepdim=True), bk, bits)[1]
    sk = sk.repeat_interleave(2, 1).repeat_interleave(bk, -1)[..., None, :t]  # [B, H, 1, T]
    bound = (sq / 2 * k_s.abs().sum(-1)[..., None, :] + sk / 2 * q.abs().sum(-1)[..., :, None]
             + d * sq * sk / 4) / math.sqrt(d)
    assert torch.all((approx - exact).abs() <= bound + 1e-9)


def test_int8_estimate_beats_int4_and_smoothing_helps():
    q, k = _random_qk(1, 4, 2, 256, 256, 64, key_offset=3.0)
    exact = approximate_scores(q, k, bits=None)
    err = {(bits, sm): (approximate_scores(q, k, bits=bits, smooth_k=sm) - exact).abs().mean() / exact.std()
           for bits in (4, 8) for sm in (True, False)}
    assert err[(8, True)] < err[(4, True)] / 4
    assert err[(4, True)] < err[(4, False)] and err[(8, True)] < err[(8, False)]
    assert err[(4, True)] < 0.15  # "bounded": a few percent of the score spread


def test_float_estimate_is_exact():
    q, k = _random_qk(1, 2, 1, 50, 90, 8)
    exact = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
    torch.testing.assert_close(approximate_scores(q, k, bits=None), exact, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ sink/local, m~ and l~
def _sink_local_keys(i: int, tq: int, tk: int, cfg: SaleSelectionConfig) -> list[int]:
    """Key positions in the sink/local set of query row i, from the docstring's words, by loops."""
    bq, bk = cfg.block_q, cfg.block_k
    qb = i // bq
    first, last = tk - tq + qb * bq, tk - tq + min((qb + 1) * bq, tq) - 1
    row = tk - tq + i
    blocks = set()
    for j in range(-(-tk // bk)):
        start, end = j * bk, min((j + 1) * bk, tk) - 1
        if start > last:
            continue
        sink = j < -(-cfg.sink // bk)
        window = last + 1 - cfg.local <= start <= last
        diagonal = start <= last and end >= first
        if sink or window or diagonal:
            blocks.add(j)
    return [c for j in sorted(blocks) for c in range(j * bk, min((j + 1) * bk, tk)) if c <= row]


CASES = [  # (Tq, Tk, block_q, block_k, sink, local)
    (300, 300, 64, 32, 32, 256),
    (100, 400, 64, 32, 32, 256),  # decode-like tail
    (130, 130, 16, 16, 20, 40),  # sink not a block multiple, local < block_q + block_k
    (200, 200, 32, 64, 0, 64),  # no sink, key blocks larger than query blocks
    (1, 257, 64, 32, 32, 256),
]


@pytest.mark.parametrize("case", CASES, ids=[f"Tq{a}-Tk{b}-bq{c}-bk{d}-s{e}-l{f}" for a, b, c, d, e, f in CASES])
def test_sink_local_stats_match_float64_hand_computation(case):
    tq, tk, bq, bk, sink, local = case
    cfg = SaleSelectionConfig(block_q=bq, block_k=bk, sink=sink, local=local)
    q, k = _random_qk(1, 4, 2, tq, tk, 16)
    m, l = sink_local_stats(q, k, block_q=bq, block_k=bk, sink=sink, local=local, chunk_q_blocks=2)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0  # [1, 4, Tq, Tk]
    for i in range(tq):
        keys = torch.tensor(_sink_local_keys(i, tq, tk, cfg))
        row = s[0, :, i, keys]  # [4, |I_SL|]
        m_ref = row.amax(-1)
        torch.testing.assert_close(m[0, :, i], m_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(l[0, :, i], torch.exp(row - m_ref[:, None]).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=[f"Tq{a}-Tk{b}-bq{c}-bk{d}-s{e}-l{f}" for a, b, c, d, e, f in CASES])
def test_sink_local_and_diagonal_blocks_always_kept(case):
    tq, tk, bq, bk, sink, local = case
    cfg = SaleSelectionConfig(block_q=bq, block_k=bk, sink=sink, local=local, bits=4)
    q, k = _random_qk(1, 4, 2, tq, tk, 16, seed=1)
    mask = sale_select(q, k, torch.ones(4), block_q=bq, block_k=bk, sink=sink, local=local)  # tau = 1
    keep = mask.to_dense()[0]  # [4, NQ, NK]
    nq, nk = keep.shape[1:]
    for qb in range(nq):
        rows = range(qb * bq, min((qb + 1) * bq, tq))
        expected = {c // bk for i in rows for c in _sink_local_keys(i, tq, tk, cfg)}
        first, last = tk - tq + qb * bq, tk - tq + rows[-1]
        assert set(range(first // bk, last // bk + 1)) <= expected  # diagonal blocks
        assert sink == 0 or 0 in expected
        for h in range(4):
            assert expected <= set(torch.nonzero(keep[h, qb])[:, 0].tolist())
    assert torch.equal(sink_local_block_mask(tq, tk, cfg) & ~keep[0], torch.zeros(nq, nk, dtype=torch.bool))


def test_local_window_is_at_most_local_tokens_with_paper_blocks():
    cfg = SaleSelectionConfig()  # 64 x 32 blocks, sink 32, local 256
    table = sink_local_block_mask(1024, 1024, cfg)
    for qb in range(4, 16):  # away from the sink: 1 sink block + 8 local blocks ending at the diagonal
        kept = torch.nonzero(table[qb])[:, 0].tolist()
        assert kept == [0] + list(range(2 * qb - 6, 2 * qb + 2))


# ----------------------------------------------------------------------- Relative Attention Score, mask
@pytest.mark.parametrize("bits", [4, 8, None])
def test_relative_attention_score_and_block_scores_match_float64_hand_computation(bits):
    tq, tk, d, bq, bk = 150, 230, 16, 32, 16
    cfg = SaleSelectionConfig(block_q=bq, block_k=bk, sink=16, local=48, bits=bits)
    q, k = _random_qk(1, 4, 2, tq, tk, d, seed=2)
    k_g = k.repeat_interleave(2, 1)
    if bits is None:
        s_approx = q @ k_g.transpose(-1, -2) / math.sqrt(d)
    else:  # S~ by hand: dequantized Q . dequantized smoothed K + exact q . k_bar
        k_bar = k.mean(-2, keepdim=True)
        dq = dequantize_blockwise(*quantize_blockwise(q, bq, bits), bq)
        dk = dequantize_blockwise(*quantize_blockwise(k - k_bar, bk, bits), bk).repeat_interleave(2, 1)
        s_approx = (dq @ dk.transpose(-1, -2) + q @ k_bar.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(d)
    s_exact = q @ k_g.transpose(-1, -2) / math.sqrt(d)
    causal = torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq))[:, None]
    p_hand = torch.zeros_like(s_approx)
    for i in range(tq):
        row = s_exact[0, :, i, _sink_local_keys(i, tq, tk, cfg)]
        m = row.amax(-1, keepdim=True)
        l = torch.exp(row - m).sum(-1, keepdim=True)
        p_hand[0, :, i] = torch.exp(s_approx[0, :, i] - m) / l
    p_hand = p_hand.masked_fill(~causal, 0)
    torch.testing.assert_close(relative_attention_scores(q, k, config=cfg), p_hand, rtol=1e-9, atol=1e-12)

    scores = sale_block_scores(q, k, config=cfg)  # [1, 4, NQ, NK]
    nq, nk = scores.shape[2:]
    padded = torch.nn.functional.pad(p_hand, (0, nk * bk - tk, 0, nq * bq - tq))
    block_max = padded.view(1, 4, nq, bq, nk, bk).amax((3, 5))
    always = sink_local_block_mask(tq, tk, cfg)
    mid = causal_block_mask(tq, tk, bq, bk) & ~always
    torch.testing.assert_close(scores.exp()[..., mid], block_max[..., mid], rtol=1e-9, atol=1e-300)
    assert torch.all(scores[..., always] == math.inf)
    assert torch.all(scores[..., ~causal_block_mask(tq, tk, bq, bk)] == -math.inf)

    for tau in (0.3, 0.05, 0.01):  # kept iff some element has P~ >= tau (ties excluded)
        tau_h = torch.tensor([tau, tau / 2, tau * 2, tau])
        keep = sale_select(q, k, tau_h, block_q=bq, block_k=bk, sink=16, local=48, bits=bits).to_dense()
        hand = (block_max >= tau_h[None, :, None, None]) & mid | always
        near_tie = ((block_max / tau_h[None, :, None, None]).log().abs() < 1e-9) & mid
        assert torch.equal(keep & ~near_tie, hand & causal_block_mask(tq, tk, bq, bk) & ~near_tie)


def test_single_compare_form_agrees_with_division_form():
    """S~ >= m~ + ln(tau * l~) (the corrected Eq. 3) <=> exp(S~ - m~) / l~ >= tau, on every element."""
    q, k = _random_qk(1, 2, 2, 128, 128, 16, seed=5)
    cfg = SaleSelectionConfig(block_q=32, block_k=32, sink=32, local=64)
    s = approximate_scores(q, k, bits=4, block_q=32, block_k=32)
    m, l = sink_local_stats(q, k, block_q=32, block_k=32, sink=32, local=64)
    p = relative_attention_scores(q, k, config=cfg)
    causal = torch.ones(128, 128).tril().bool()
    for tau in (0.1, 0.01, 0.001):
        single = (s >= (m + torch.log(tau * l))[..., None]) & causal
        division = (p >= tau) & causal
        tie = (p / tau).log().abs() < 1e-9
        assert torch.equal(single & ~tie, division & ~tie)


@pytest.mark.parametrize("bits", [4, 8])
def test_tau_zero_keeps_every_causal_block_and_gives_dense_attention(bits):
    q, k = _random_qk(1, 4, 2, 100, 260, 16, seed=3)
    v = torch.randn(1, 2, 260, 16, dtype=torch.float64)
    cfg = SaleSelectionConfig(bits=bits)
    mask = api.sale_select(q, k, torch.zeros(4), config=cfg)
    assert torch.equal(mask.to_dense(), BlockMask.full(1, 4, 100, 260, 64, 32).to_dense())
    out = api.sale_prefill_attention(q, k, v, 0.0, config=cfg)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0
    causal = torch.arange(260)[None, :] <= (160 + torch.arange(100))[:, None]
    ref = torch.softmax(s.masked_fill(~causal, -math.inf), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_masks_are_nested_in_tau():
    q, k = structured_qk(t=512)
    scores = sale_block_scores(q, k)
    prev = None
    for tau in (1.0, 0.05, 0.008, 0.002, 1e-4, 0.0):
        keep = select_blocks(scores, tau, seq_q=512, seq_k=512, block_q=64, block_k=32).to_dense()
        assert prev is None or torch.all(keep | ~prev)  # smaller tau keeps a superset
        prev = keep


def test_chunked_block_scores_equal_one_chunk():
    q, k = _random_qk(2, 4, 2, 333, 333, 16, seed=4, dtype=torch.float32)
    whole = sale_block_scores(q, k, chunk_elems=1 << 40)
    for chunk in (1, 3 * 4 * 2 * 64 * 333):  # one query block per chunk; three per chunk
        torch.testing.assert_close(sale_block_scores(q, k, chunk_elems=chunk), whole, rtol=1e-5, atol=1e-5)


def test_gqa_heads_of_a_group_differ_only_through_their_queries():
    q, k = _random_qk(1, 4, 2, 200, 200, 16, seed=6)
    q[:, 1] = q[:, 0]  # heads 0 and 1 share KV head 0 and now also their queries
    scores = sale_block_scores(q, k)
    torch.testing.assert_close(scores[:, 0], scores[:, 1])
    mha = sale_block_scores(q[:, :2], k[:, :1].expand(1, 2, 200, 16).contiguous())
    torch.testing.assert_close(scores[:, :2], mha)


@pytest.mark.parametrize("bits,min_recall", [(4, 0.9), (8, 0.98)])
def test_recall_against_float_selection_on_structured_inputs(bits, min_recall):
    """App. H recall: blocks kept by both / blocks kept with exact scores (sink/local excluded)."""
    q, k = structured_qk(t=1024)
    exact = sale_block_scores(q, k, config=SaleSelectionConfig(bits=None))
    approx = sale_block_scores(q, k, config=SaleSelectionConfig(bits=bits))
    mid = torch.isfinite(exact)
    for tau in (0.008, 0.002):
        ref = (exact >= math.log(tau)) & mid
        got = (approx >= math.log(tau)) & mid
        assert 0.05 < ref.sum() / mid.sum() < 0.95  # the input really is sparse at this tau
        assert (ref & got).sum() / ref.sum() >= min_recall


def test_config_records_precision_and_validates():
    assert SaleSelectionConfig().precision == "int4"
    assert SaleSelectionConfig(bits=8).to_dict()["precision"] == "int8"
    assert SaleSelectionConfig(bits=None).to_dict() == {
        "block_q": 64, "block_k": 32, "sink": 32, "local": 256, "bits": None, "smooth_k": True, "precision": "float"}
    with pytest.raises(ValueError, match="bits"):
        SaleSelectionConfig(bits=2)
    q, k = _random_qk(1, 2, 1, 64, 64, 8)
    with pytest.raises(ValueError, match="tau"):
        sale_select(q, k, torch.tensor([0.1, -0.1]))
    with pytest.raises(ValueError, match="Hq % Hkv"):
        sale_block_scores(q[:, :1], k.expand(1, 2, 64, 8))


def test_decode_like_single_query_and_low_precision_inputs():
    q, k = _random_qk(1, 4, 2, 1, 500, 16, seed=7, dtype=torch.bfloat16)
    mask = sale_select(q, k, torch.full((4,), 0.01))
    assert mask.seq_q == 1 and mask.num_q_blocks == 1 and mask.heads == 4
    keep = mask.to_dense()[0, :, 0]
    assert torch.all(keep[:, 0]) and torch.all(keep[:, -8:])  # sink + the 8 local blocks ending at 499


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_selection_matches_cpu_and_stays_chunked():
    q, k = structured_qk(t=2048)
    cpu = sale_block_scores(q, k)
    gpu = sale_block_scores(q.cuda(), k.cuda())
    fin = torch.isfinite(cpu)
    assert torch.equal(torch.isfinite(gpu.cpu()), fin)
    torch.testing.assert_close(gpu.cpu()[fin], cpu[fin], rtol=1e-3, atol=1e-3)

    t, h, d = 32768, 8, 128  # long input: peak memory far below one [Tq, Tk] float32 table
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, h, t, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, 2, t, d, device="cuda", generator=g, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mask = sale_select(q, k, torch.full((h,), 0.008, device="cuda"), bits=8)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 0.25 * h * t * t * 4
    assert mask.heads == h and mask.offsets.is_cuda


@pytest.mark.parametrize("bits, tq, tk, zero_q_block", [(4, 200, 200, False), (8, 96, 160, True), (None, 130, 130, True)])
def test_block_scores_equal_the_elementwise_definition_bitwise(bits, tq, tk, zero_q_block):
    """``sale_block_scores`` takes each key block's max before the per-row terms; the same float32 scores
    as ``ln P~ = S~ - m~ - ln l~`` per element, causally masked, then the block max (ragged edges, a query
    block of zeros whose scale is 0, ``Tq < Tk``)."""
    q, k = (x.float() for x in _random_qk(1, 4, 2, tq, tk, 16, seed=7))
    if zero_q_block:
        q[:, :, 32:64] = 0.0
    cfg = SaleSelectionConfig(block_q=32, block_k=16, sink=16, local=48, bits=bits)
    s = approximate_scores(q, k, bits=bits, block_q=32, block_k=16)  # [1, Hq, Tq, Tk] S~
    m, l = sink_local_stats(q, k, block_q=32, block_k=16, sink=16, local=48)
    s = s - (m + torch.log(l))[..., None]
    causal = torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq))[:, None]
    s = s.masked_fill(~causal, -math.inf)
    nq, nk = -(-tq // 32), -(-tk // 16)
    s = torch.nn.functional.pad(s, (0, nk * 16 - tk, 0, nq * 32 - tq), value=-math.inf)
    want = s.view(1, 4, nq, 32, nk, 16).amax(dim=(3, 5))
    want = want.masked_fill(sink_local_block_mask(tq, tk, cfg), math.inf)
    got = sale_block_scores(q, k, config=cfg, chunk_elems=1 << 12)  # several chunks
    assert torch.equal(got, want)
