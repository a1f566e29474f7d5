"""SALE calibration tables: the one-pass ladder errors equal block-sparse attention, the table halving
equals a live halving, the shared-tau counts equal select_blocks, and the shared-tau match by hand."""

from __future__ import annotations

import math

import pytest
import torch

from calib.sale.halving import halve_thresholds, head_errors, sale_errors_fn
from calib.sale.tables import (evaluate_ladder, halve_from_table, kept_counts, ladder_errors_partials,
                               match_shared_tau, shared_tau_grid, tau_ladder)
from runtime_kernels.blocksparse.mask import causal_block_mask
from runtime_kernels.blocksparse.reference import block_sparse_attention, dense_causal_attention
from runtime_kernels.sale.api import sale_block_scores
from runtime_kernels.sale.reference import SaleSelectionConfig, select_blocks, sink_local_block_mask

CFG = SaleSelectionConfig(block_q=32, block_k=16, sink=16, local=48, bits=4)
LADDER = [0.008, 0.004, 0.002, 0.001, 0.0005, 0.00025, 0.000125, 0.0]


def _local_heads(hq: int, hkv: int, n: int, d: int, seed: int, dtype=torch.float32):
    """q, k, v of heads that are local with per-head sharpness plus a few far 'retrieval' keys."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.float64)
    freqs = torch.linspace(0.02, 0.3, d // 2, dtype=torch.float64)
    ang = pos[:, None] * freqs  # [N, D/2]
    k = torch.cat([ang.cos(), ang.sin()], -1)[None].repeat(hkv, 1, 1)  # position code
    k = k + 0.3 * torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    sharp = torch.linspace(1.0, 6.0, hq, dtype=torch.float64)[:, None, None]
    q = sharp * k.repeat_interleave(hq // hkv, 0) + 0.3 * torch.randn(hq, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(hkv, n, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("hq, hkv, n, chunk", [(4, 2, 256, 1 << 24), (2, 1, 257, 700), (3, 3, 64, 50)],
                         ids=["H4-KV2-T256", "H2-KV1-T257-chunked", "H3-KV3-T64-tiny-chunks"])
def test_partials_equal_block_sparse_attention_on_arbitrary_masks(hq, hkv, n, chunk):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(hq, n, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(hkv, n, 16, generator=g, dtype=torch.float64) for _ in range(2))
    o_dense = dense_causal_attention(q[None], k[None], v[None])[0]
    nq, nk = -(-n // CFG.block_q), -(-n // CFG.block_k)
    scores = torch.rand(hq, nq, nk, generator=g, dtype=torch.float64) * math.log(1e-5)  # ln P~ in [ln 1e-5, 0]
    scores = scores.masked_fill(sink_local_block_mask(n, n, CFG), math.inf)  # what the Selection-Pass always keeps
    got = ladder_errors_partials(q, k, v, o_dense, scores, LADDER, CFG, chunk_elems=chunk)  # [K, H]
    for i, t in enumerate(LADDER):
        mask = select_blocks(scores[None], torch.full((hq,), t), seq_q=n, seq_k=n, block_q=CFG.block_q,
                             block_k=CFG.block_k)
        want = head_errors(o_dense[None], block_sparse_attention(q[None], k[None], v[None], mask))[0]
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-9)
    assert got[-1].abs().max() < 1e-9  # tau = 0 is dense
    if n > 4 * CFG.local:
        assert got[0].min() > 1e-3  # tau0 drops blocks outside sink/local (at T64 all blocks are local)


def test_partials_stay_exact_when_a_dropped_block_holds_a_far_larger_logit():
    """Rows whose kept mass underflows in float32 against the row max (one dropped key ~150 logits above
    everything kept) still get the exact kept-block softmax: the float64 block-sparse definition."""
    n, d = 256, 16
    g = torch.Generator().manual_seed(11)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g, dtype=torch.float64), dim=0)
    q = torch.randn(2, n, d, generator=g, dtype=torch.float64) + 3.0 * u
    k, v = (torch.randn(1, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    k[0, 100] = 200.0 * u  # key block 6: logit ~150 for every later row
    q, k, v = q.float(), k.float(), v.float()
    nq, nk = n // CFG.block_q, n // CFG.block_k
    scores = torch.full((2, nq, nk), -20.0)  # ln P~ below ln(min ladder tau): dropped at every tau > 0
    scores = scores.masked_fill(sink_local_block_mask(n, n, CFG), math.inf)
    assert bool((scores[:, 4:, 6] == -20.0).all())  # query blocks 4.. can drop the block of key 100
    o_dense = dense_causal_attention(q[None].double(), k[None].double(), v[None].double())[0]
    got = ladder_errors_partials(q, k, v, o_dense.float(), scores, LADDER, CFG)
    for i, t in enumerate(LADDER):
        mask = select_blocks(scores[None], torch.full((2,), t), seq_q=n, seq_k=n, block_q=CFG.block_q,
                             block_k=CFG.block_k)
        sparse = block_sparse_attention(q[None].double(), k[None].double(), v[None].double(), mask)
        torch.testing.assert_close(got[i], head_errors(o_dense[None], sparse)[0], rtol=1e-4, atol=1e-5)
    assert float(got[0].min()) > 1.0  # dropping the dominant key changes those rows' outputs completely


def test_evaluate_ladder_implementations_agree_and_density_matches_masks():
    q, k, v = _local_heads(4, 2, 320, 16, seed=1)
    o = dense_causal_attention(q[None], k[None], v[None])[0]
    fast = evaluate_ladder(q, k, v, o, LADDER, CFG, grid=shared_tau_grid(201))
    slow = evaluate_ladder(q, k, v, o, LADDER, CFG, impl="blocksparse")
    torch.testing.assert_close(fast.err, slow.err, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fast.density, slow.density)
    assert fast.causal == int(causal_block_mask(320, 320, CFG.block_q, CFG.block_k).sum())
    assert bool((fast.density[:-1] <= fast.density[1:] + 1e-7).all())  # masks nested in tau
    assert float(fast.density[0].min()) < 0.9 and bool((fast.density[-1] == 1).all())
    with pytest.raises(ValueError, match="impl"):
        evaluate_ladder(q, k, v, o, LADDER, CFG, impl="nope")


def test_kept_counts_match_select_blocks_density():
    q, k, _ = _local_heads(4, 2, 300, 16, seed=2)
    scores = sale_block_scores(q[None], k[None], config=CFG)[0]  # [H, NQ, NK]
    grid = shared_tau_grid(401)
    kept = kept_counts(scores, grid, 300, CFG.block_q, CFG.block_k)  # [H, G]
    causal = int(causal_block_mask(300, 300, CFG.block_q, CFG.block_k).sum())
    for j in (0, 100, 250, 330, 400):
        mask = select_blocks(scores[None], float(grid[j]), seq_q=300, seq_k=300, block_q=32, block_k=16)
        torch.testing.assert_close(kept[:, j].double() / causal, mask.density()[0].double())
    assert bool((kept[:, :-1] >= kept[:, 1:]).all())  # fewer blocks as tau grows


@pytest.mark.parametrize("tau0, tau_min", [(0.008, 1e-4), (0.01, 1e-3), (1e-4, 1e-4), (0.5, 0.0625)])
def test_tau_ladder_is_exactly_what_halving_visits(tau0, tau_min):
    ladder = tau_ladder(tau0, tau_min)
    res = halve_thresholds(lambda t: torch.full((1, t.numel()), 9.0), theta=1.0, tau0=tau0, num_heads=2,
                           tau_min=tau_min)
    assert [float(s.tau[0]) for s in res.trace] == ladder
    if (tau0, tau_min) == (0.008, 1e-4):
        assert ladder == pytest.approx(LADDER, rel=1e-6)


def test_table_halving_equals_live_halving():
    samples = [tuple(x[None] for x in _local_heads(4, 1, n, 16, seed=s)) for s, n in ((3, 256), (4, 224), (5, 288))]
    o_dense = [dense_causal_attention(*smp) for smp in samples]
    errors_fn, density_fn = sale_errors_fn(samples, config=CFG, o_dense=o_dense)
    table = torch.stack([evaluate_ladder(q[0], k[0], v[0], o[0], LADDER, CFG).err for (q, k, v), o in
                         zip(samples, o_dense)], dim=1)  # [K, S, H]
    for theta in (0.001, 0.005, 0.02):
        live = halve_thresholds(errors_fn, theta=theta, num_heads=4)
        tab = halve_from_table(table, tau_ladder(0.008, 1e-4), theta=theta, tau0=0.008, tau_min=1e-4)
        torch.testing.assert_close(tab.tau, live.tau)
        torch.testing.assert_close(tab.err, live.err, rtol=1e-4, atol=1e-6)
        assert len(tab.trace) == len(live.trace)
    assert len({float(t) for t in halve_thresholds(errors_fn, theta=0.005, num_heads=4).tau}) > 2


def test_match_shared_tau_by_hand():
    grid = torch.tensor([0.001, 0.01, 0.1])
    kept = torch.tensor([[10, 6, 2], [8, 4, 0]])[None, None]  # [L=1, S=1, H=2, G=3]; mean density .9 .5 .1
    causal = torch.tensor([10])
    assert match_shared_tau(kept, causal, grid, 0.52) == (pytest.approx(0.01), pytest.approx(0.5))
    assert match_shared_tau(kept, causal, grid, 0.95) == (pytest.approx(0.001), pytest.approx(0.9))  # tie: larger tau
    assert match_shared_tau(kept, causal, grid, 0.30) == (pytest.approx(0.1), pytest.approx(0.1))  # tie: larger tau
    assert match_shared_tau(kept, causal, grid, 1.0) == (0.0, 1.0)  # only dense matches
