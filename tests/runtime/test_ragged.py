"""``runtime_kernels.ragged.rows_alone``: a padded ragged batch's attention row by row, rows of one length
in one call, against each row's own causal attention computed independently (float64)."""

from __future__ import annotations

import math

import torch

from runtime_kernels.ragged import batch_rows, padded_rows, ragged_runs, rows_alone


def _qkv(b: int = 5, hq: int = 4, hkv: int = 2, t: int = 12, d: int = 8):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of one row written out (GQA by repeating each key head)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return s.softmax(-1) @ v


def test_rows_of_one_length_share_a_call_and_each_row_gets_its_own_attention():
    q, k, v = _qkv()
    lengths = [12, 9, 12, 7, 9]
    calls = []

    def prefill(layer, qb, kb, vb, scale):
        calls.append((layer, qb.shape[0], qb.shape[2]))
        return _causal(qb, kb, vb, scale) if qb.shape[2] != 7 else None  # length 7: "dense", SDPA runs

    out = rows_alone(prefill, 3, q, k, v, 0.3, lengths)
    assert sorted(calls) == [(3, 1, 7), (3, 2, 9), (3, 2, 12)]
    for b, n in enumerate(lengths):
        want = _causal(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n], 0.3)
        torch.testing.assert_close(out[b:b + 1, :, :n], want, rtol=1e-12, atol=1e-12)
        assert bool((out[b, :, n:] == 0).all())  # the padding: zeros, overwritten by decoding


def test_padded_rows_only_when_some_row_is_shorter_than_the_call():
    q = torch.zeros(2, 1, 10, 4)

    class Ctx:
        lengths = [10, 10]

    assert padded_rows(Ctx(), q) is None
    Ctx.lengths = [10, 8]
    assert padded_rows(Ctx(), q) == [10, 8]
    assert padded_rows(object(), q) is None


def test_ragged_runs_group_rows_by_length_padding_by_at_most_a_sixteenth_of_the_longest():
    # shortest first: 500, 510 (rows 4, 5): 10 <= 510 // 16 = 31; 990 is far from 500; 990, 1000, 1010
    # (rows 3, 0, 1): 20 <= 1010 // 16 = 63; 1063 - 990 = 73 > 1063 // 16 = 66 starts a run of its own
    assert ragged_runs([1000, 1010, 1063, 990, 500, 510]) == [[4, 5], [3, 0, 1], [2]]
    assert ragged_runs([100, 300, 101, 301]) == [[0, 2], [1, 3]]  # close lengths need not be adjacent rows
    assert ragged_runs([7, 7, 7], alone=True) == [[0], [1], [2]]
    assert ragged_runs([5]) == [[0]]


def test_a_run_is_a_slice_only_where_its_rows_are_adjacent_and_ascending():
    assert batch_rows([3, 4, 5]) == slice(3, 6) and batch_rows([2]) == slice(2, 3)
    assert batch_rows([2, 0]) == [2, 0] and batch_rows([0, 2]) == [0, 2]
