"""SampleAttention's two-stage selection against float64 brute force and hand-worked cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runtime_kernels.blocksparse.mask import BlockMask, causal_block_mask
from runtime_kernels.sampleattention.reference import (
    cumulative_residual_attention,
    sample_scores,
    sampled_query_rows,
    sampleattention_select,
    select_and_report,
    select_columns,
    select_slashes,
    stage1_reductions,
    stage2_select,
)

# (B, Hq, Hkv, Sq, Sk, D, blk, chunk_n)
SHAPES = [
    pytest.param(1, 4, 1, 200, 200, 16, 16, 3, id="B1-Hq4-Hkv1-S200-blk16-c3"),
    pytest.param(2, 4, 2, 128, 128, 8, 32, 1, id="B2-Hq4-Hkv2-S128-blk32-c1"),
    pytest.param(1, 2, 2, 70, 150, 8, 16, 2, id="B1-Hq2-Hkv2-Sq70-Sk150-blk16-c2"),
    pytest.param(1, 2, 1, 97, 97, 8, 16, 6, id="B1-Hq2-Hkv1-S97-blk16-c6-overlap"),
]


def structured_qk(b: int, hq: int, hkv: int, sq: int, sk: int, d: int, seed: int = 0,
                  dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Random q, k with a sink key and a heavy key stripe, so selections are neither trivial nor dense."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
    q[..., 0] += 2.0
    k[:, :, 0, 0] += 4.0  # attention sink
    k[:, :, sk // 3, 0] += 3.0  # a column stripe
    return q.to(dtype), k.to(dtype)


def bruteforce_rows_probs(q: np.ndarray, k: np.ndarray, row: int, b: int, h: int) -> tuple[int, np.ndarray]:
    """Float64 causal softmax of query ``row`` of head ``h``: (absolute position, probs over keys)."""
    hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
    hkv, sk = k.shape[1], k.shape[2]
    p = sk - sq + row
    logits = k[b, h // (hq // hkv), : p + 1] @ q[b, h, row] / math.sqrt(d)
    e = np.exp(logits - logits.max())
    probs = np.zeros(sk)
    probs[: p + 1] = e / e.sum()
    return p, probs


def bruteforce_stage1(q: torch.Tensor, k: torch.Tensor, chunk_n: int, blk: int) -> tuple[np.ndarray, np.ndarray]:
    qn, kn = q.double().numpy(), k.double().numpy()
    b_, hq, sq, _ = qn.shape
    sk = kn.shape[2]
    nk = -(-sk // blk)
    rows = set()
    for i in range(1, chunk_n + 1):
        end = math.floor(i * sq / chunk_n)
        rows.update(range(max(0, end - blk), end))
    col, sl = np.zeros((b_, hq, nk)), np.zeros((b_, hq, nk))
    for b in range(b_):
        for h in range(hq):
            for r in sorted(rows):
                p, probs = bruteforce_rows_probs(qn, kn, r, b, h)
                for key in range(p + 1):
                    col[b, h, key // blk] += probs[key]
                    sl[b, h, (p - key) // blk] += probs[key]
    return col / col.sum(-1, keepdims=True), sl / sl.sum(-1, keepdims=True)


def test_sampled_rows_by_hand() -> None:
    assert sampled_query_rows(256, 2, 64).tolist() == list(range(64, 128)) + list(range(192, 256))
    assert sampled_query_rows(256, 1, 64).tolist() == list(range(192, 256))  # chunk_n=1: last blk queries
    assert sampled_query_rows(50, 1, 64).tolist() == list(range(50))  # shorter than blk: everything
    assert sampled_query_rows(100, 3, 10).tolist() == list(range(23, 33)) + list(range(56, 66)) + list(range(90, 100))
    assert sampled_query_rows(300, 6, 64).tolist() == list(range(300))  # itv=50 < blk: slices overlap, merged


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,blk,chunk_n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_stage1_matches_bruteforce(b, hq, hkv, sq, sk, d, blk, chunk_n, dtype) -> None:
    q, k = structured_qk(b, hq, hkv, sq, sk, d, dtype=dtype)
    col, sl = stage1_reductions(q, k, chunk_n=chunk_n, blk=blk)
    ref_col, ref_sl = bruteforce_stage1(q, k, chunk_n, blk)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    np.testing.assert_allclose(col.double().numpy(), ref_col, atol=tol, rtol=0)
    np.testing.assert_allclose(sl.double().numpy(), ref_sl, atol=tol, rtol=0)


def test_sample_scores_rows_and_gqa() -> None:
    q, k = structured_qk(1, 4, 2, 96, 96, 8)
    rows, probs = sample_scores(q, k, chunk_n=2, blk=16)
    assert rows.tolist() == list(range(32, 48)) + list(range(80, 96))
    qn, kn = q.numpy(), k.numpy()
    for h in range(4):
        for i, r in enumerate(rows.tolist()):
            np.testing.assert_allclose(probs[0, h, i].numpy(), bruteforce_rows_probs(qn, kn, r, 0, h)[1], atol=1e-12)
    # GQA: head h reads KV head h // 2, the same as repeating KV heads explicitly
    col, sl = stage1_reductions(q, k, chunk_n=2, blk=16)
    col_rep, sl_rep = stage1_reductions(q, k.repeat_interleave(2, dim=1), chunk_n=2, blk=16)
    torch.testing.assert_close(col, col_rep)
    torch.testing.assert_close(sl, sl_rep)


def random_masses(b: int, h: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, h, n, generator=g, dtype=torch.float64) ** 4  # skewed, like attention
    return m / m.sum(-1, keepdim=True)


@pytest.mark.parametrize("alpha", [0.3, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_column_selection_is_minimal(alpha: float, seed: int) -> None:
    mass = random_masses(2, 3, 13, seed)
    kept = select_columns(mass, alpha)
    for b in range(2):
        for h in range(3):
            m, sel = mass[b, h], kept[b, h]
            total = m[sel].sum().item()
            assert total >= alpha
            for j in sel.nonzero().flatten().tolist():  # removing any kept block drops below alpha
                assert total - m[j].item() < alpha
            # fewest: no set of one block fewer reaches alpha (the largest such set is the top-(n-1))
            top = m.sort(descending=True).values
            assert top[: int(sel.sum()) - 1].sum().item() < alpha


@pytest.mark.parametrize("alpha", [0.3, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slash_selection_is_minimal_and_keeps_diagonal(alpha: float, seed: int) -> None:
    mass = random_masses(2, 3, 13, seed + 10)
    kept = select_slashes(mass, alpha)
    assert kept[..., 0].all()
    for b in range(2):
        for h in range(3):
            m, sel = mass[b, h], kept[b, h]
            total = m[sel].sum().item()
            assert total >= alpha
            for d in sel.nonzero().flatten().tolist():
                if d != 0:  # the diagonal band is forced; any other kept band is needed
                    assert total - m[d].item() < alpha
            others = m[1:].sort(descending=True).values
            assert m[0].item() + others[: int(sel.sum()) - 2].sum().item() < alpha or sel.sum() == 1


def test_slash_selection_diagonal_alone_suffices() -> None:
    mass = torch.tensor([[[0.95, 0.03, 0.02]]], dtype=torch.float64)
    assert select_slashes(mass, 0.9).tolist() == [[[True, False, False]]]
    assert select_slashes(mass, 0.96).tolist() == [[[True, True, False]]]


def test_stage2_hand_worked_mask() -> None:
    """Aligned prefill, blk=4, S=32: columns {0}, bands {0, 2} -> per query block qb the key blocks
    {0} ∪ {qb, qb-1} (band 0) ∪ {qb-2, qb-3} (band 2), clipped to 0..qb."""
    nk = 8
    col = torch.zeros(1, 1, nk, dtype=torch.float64)
    col[..., 0], col[..., 5] = 0.9, 0.1
    sl = torch.zeros(1, 1, nk, dtype=torch.float64)
    sl[..., 0], sl[..., 2], sl[..., 4] = 0.45, 0.45, 0.1
    mask = stage2_select(col, sl, 0.8, 0.85, seq_len=32, blk=4)
    assert (mask.block_q, mask.block_k) == (4, 4)
    rows = [mask.indices[mask.offsets[qb] : mask.offsets[qb + 1]].tolist() for qb in range(nk)]
    expected = [sorted({0} | {j for j in (qb, qb - 1, qb - 2, qb - 3) if j >= 0}) for qb in range(nk)]
    assert rows == expected


def element_closure(col_kept: torch.Tensor, band_kept: torch.Tensor, sq: int, sk: int, blk: int) -> torch.Tensor:
    """Brute force: block (qb, j) kept iff it holds a causal element of a kept column or kept band."""
    b_, h_, nk = col_kept.shape
    nq = -(-sq // blk)
    out = np.zeros((b_, h_, nq, nk), dtype=bool)
    cols, bands = col_kept.numpy(), band_kept.numpy()
    for i in range(sq):
        p = sk - sq + i
        keys = np.arange(p + 1)
        elem = cols[:, :, keys // blk] | bands[:, :, (p - keys) // blk]  # [B, H, p+1]
        for key in keys[elem.any((0, 1))]:
            out[:, :, i // blk, key // blk] |= elem[:, :, key]
    return torch.from_numpy(out)


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,blk,chunk_n", SHAPES)
def test_mask_is_exact_block_closure_causal_with_diagonal(b, hq, hkv, sq, sk, d, blk, chunk_n) -> None:
    q, k = structured_qk(b, hq, hkv, sq, sk, d, seed=3)
    alpha_c, alpha_s = 0.6, 0.7
    col, sl = stage1_reductions(q, k, chunk_n=chunk_n, blk=blk)
    mask = sampleattention_select(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n, blk=blk)
    keep = mask.to_dense()
    expected = element_closure(select_columns(col, alpha_c), select_slashes(sl, alpha_s), sq, sk, blk)
    assert torch.equal(keep, expected)
    causal = causal_block_mask(sq, sk, blk, blk)
    assert not (keep & ~causal).any()
    tok = mask.token_mask()  # every element of the diagonal band (0 <= p - k < blk) is kept
    pos = torch.arange(sq)[:, None] + (sk - sq)
    diag_band = (pos - torch.arange(sk)[None, :] >= 0) & (pos - torch.arange(sk)[None, :] < blk)
    assert (tok | ~diag_band).all()


def test_selection_is_sparse_on_structured_inputs() -> None:
    q, k = structured_qk(1, 4, 1, 512, 512, 16, seed=4)
    q[..., 0], k = 4.0, 0.1 * k
    k[:, :, 0, 0] = k[:, :, 200, 0] = 12.0  # nearly all attention on a sink and one stripe
    mask = sampleattention_select(q, k, alpha_c=0.8, alpha_s=0.8, chunk_n=2, blk=16)
    assert (mask.density() < 0.8).all()


def test_alpha_one_gives_dense() -> None:
    q, k = structured_qk(1, 2, 1, 100, 100, 8)
    dense = causal_block_mask(100, 100, 16, 16).expand(1, 2, -1, -1)
    for alpha_c, alpha_s in [(1.0, 0.5), (0.5, 1.0), (1.0, 1.0)]:
        mask = sampleattention_select(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=2, blk=16)
        assert torch.equal(mask.to_dense(), dense)
        col, sl = stage1_reductions(q, k, chunk_n=2, blk=16)
        assert torch.equal(stage2_select(col, sl, alpha_c, alpha_s, 100, 16).to_dense(), dense)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_alpha_out_of_range_is_refused(alpha: float) -> None:
    q, k = structured_qk(1, 1, 1, 32, 32, 4)
    with pytest.raises(ValueError, match="outside"):
        sampleattention_select(q, k, alpha_c=alpha, alpha_s=0.9, chunk_n=1, blk=16)


def bruteforce_cra(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, rows: list[int]) -> np.ndarray:
    tok = mask.token_mask().numpy()
    qn, kn = q.double().numpy(), k.double().numpy()
    out = np.full((q.shape[0], q.shape[1]), np.inf)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for r in rows:
                kept = bruteforce_rows_probs(qn, kn, r, b, h)[1][tok[b, h, r]].sum()
                out[b, h] = min(out[b, h], kept)
    return out


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,blk,chunk_n", SHAPES)
def test_cra_matches_bruteforce(b, hq, hkv, sq, sk, d, blk, chunk_n) -> None:
    q, k = structured_qk(b, hq, hkv, sq, sk, d, seed=5)
    nq, nk = -(-sq // blk), -(-sk // blk)
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(b, hq, nq, nk, generator=g) < 0.5
    for qb in range(nq):  # every query keeps its own key block, so no row's kept mass is trivially 0
        first, last = sk - sq + qb * blk, sk - sq + min((qb + 1) * blk, sq) - 1
        keep[:, :, qb, first // blk : last // blk + 1] = True
    mask = BlockMask.from_dense(keep, sq, sk, blk, blk)
    got = cumulative_residual_attention(q, k, mask)
    np.testing.assert_allclose(got.numpy(), bruteforce_cra(q, k, mask, list(range(sq))), atol=1e-12, rtol=0)
    rows = sampled_query_rows(sq, chunk_n, blk)
    got_rows = cumulative_residual_attention(q, k, mask, rows)
    np.testing.assert_allclose(got_rows.numpy(), bruteforce_cra(q, k, mask, rows.tolist()), atol=1e-12, rtol=0)
    got32 = cumulative_residual_attention(q.float(), k.float(), mask, rows)
    np.testing.assert_allclose(got32.double().numpy(), got_rows.numpy(), atol=2e-6, rtol=0)


@pytest.mark.parametrize("alpha_c,alpha_s", [(0.6, 0.7), (0.9, 0.5), (0.5, 0.95)])
def test_selection_keeps_its_alphas_on_sampled_rows(alpha_c: float, alpha_s: float) -> None:
    """The mask covers every element of every kept column and band, so the mean kept mass over the
    sampled rows (what Stage 1 pooled) is at least max(alpha_c, alpha_s)."""
    q, k = structured_qk(1, 4, 2, 160, 160, 8, seed=11)
    report = select_and_report(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=3, blk=16)
    tok = report.mask.token_mask().numpy()
    qn, kn = q.numpy(), k.numpy()
    for h in range(4):
        kept = [bruteforce_rows_probs(qn, kn, r, 0, h)[1][tok[0, h, r]].sum() for r in report.sampled_rows.tolist()]
        assert np.mean(kept) >= max(alpha_c, alpha_s) - 1e-12
        assert report.sampled_cra[0, h].item() == pytest.approx(min(kept), abs=1e-12)
