"""tau-halving: hand-worked synthetic error tables, monotonicity in theta, and a small end-to-end layer."""

from __future__ import annotations

import math

import pytest
import torch

from calib.sale.halving import halve_thresholds, head_errors, sale_errors_fn
from runtime_kernels.sale.reference import SaleSelectionConfig

LADDER = [0.008, 0.004, 0.002, 0.001, 0.0005, 0.00025, 0.000125, 0.0]  # tau0 = 0.008, tau_min = 1e-4


def _table_errors_fn(table: torch.Tensor, calls: list[torch.Tensor]):
    """errors_fn from a table ``[len(LADDER), S, H]``: the error of head h on sample s at LADDER[i]."""

    def errors_fn(tau: torch.Tensor) -> torch.Tensor:
        calls.append(tau.clone())
        rows = [min(range(len(LADDER)), key=lambda i: abs(LADDER[i] - float(t))) for t in tau]
        return torch.stack([table[r, :, h] for h, r in enumerate(rows)], dim=1)  # [S, H]

    return errors_fn


def _hand_table() -> torch.Tensor:
    """Two samples, five heads; theta = 0.5. Worked by hand:

    head 0: 0.3 / 0.2 at tau0 already               -> 0.008
    head 1: sample 1 fails until 0.001               -> 0.001 (errors 0.45, 0.5: equality passes)
    head 2: above theta all the way to 0.000125      -> 0 (dense), its dense error 0.01 / 0.02
    head 3: passes at 0.004, would fail at 0.002     -> 0.004 (the first passing tau, not a later one)
    head 4: sample 0 passes at 0.002, sample 1 at 0.0005 -> 0.0005
    """
    t = torch.full((len(LADDER), 2, 5), 9.0)
    t[:, :, 0] = torch.tensor([0.3, 0.2])
    t[:, 0, 1] = torch.tensor([0.40, 0.40, 0.40, 0.45, 0.4, 0.3, 0.2, 0.0])
    t[:, 1, 1] = torch.tensor([0.90, 0.80, 0.70, 0.50, 0.4, 0.3, 0.2, 0.0])
    t[:, 0, 2] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.2, 1.0, 0.8, 0.01])
    t[:, 1, 2] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.2, 1.0, 0.8, 0.02])
    t[:, :, 3] = torch.tensor([0.9, 0.4, 0.6, 0.1, 0.1, 0.1, 0.1, 0.0])[:, None]
    t[:, 0, 4] = torch.tensor([0.9, 0.8, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    t[:, 1, 4] = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.2, 0.1, 0.0])
    return t


def test_hand_worked_table():
    calls: list[torch.Tensor] = []
    tau, err, trace = halve_thresholds(_table_errors_fn(_hand_table(), calls), theta=0.5, num_heads=5)
    torch.testing.assert_close(tau, torch.tensor([0.008, 0.001, 0.0, 0.004, 0.0005]))
    torch.testing.assert_close(err, torch.tensor([[0.3, 0.45, 0.01, 0.4, 0.3], [0.2, 0.5, 0.02, 0.4, 0.5]]))
    assert len(calls) == len(trace) == 8  # every head of the layer evaluated together, once per step
    assert all(c.shape == (5,) for c in calls)
    torch.testing.assert_close(trace[2].tau, torch.tensor([0.008, 0.002, 0.002, 0.004, 0.002]))
    assert [int(s.accepted.sum()) for s in trace] == [1, 1, 0, 1, 1, 0, 0, 1]
    torch.testing.assert_close(torch.stack([s.tau[2] for s in trace]), torch.tensor(LADDER))


def test_ladder_turns_dense_below_tau_min_and_respects_max_steps():
    calls: list[torch.Tensor] = []
    never = torch.full((len(LADDER), 1, 2), 5.0)
    never[-1] = 0.0
    tau, err, trace = halve_thresholds(_table_errors_fn(never, calls), theta=1.0, num_heads=2)
    assert [float(c[0]) for c in calls] == pytest.approx(LADDER) and torch.all(tau == 0)
    calls.clear()
    tau, _, trace = halve_thresholds(_table_errors_fn(never, calls), theta=1.0, num_heads=2, max_steps=2)
    assert [float(c[0]) for c in calls] == pytest.approx([0.008, 0.004, 0.0]) and torch.all(tau == 0)
    tau, _, trace = halve_thresholds(lambda t: torch.zeros(3, 2), theta=0.0, tau0=torch.tensor([5e-5, 0.01]))
    assert tau.tolist() == [0.0, pytest.approx(0.01)] and len(trace) == 1


@pytest.mark.parametrize("seed", range(20))
def test_larger_theta_never_gives_smaller_tau(seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(len(LADDER), 5, 16, generator=g) * 2  # arbitrary, even non-monotone, errors
    table[-1] *= 0.1
    taus = [halve_thresholds(_table_errors_fn(table, []), theta=th, num_heads=16).tau for th in (0.2, 0.6, 1.0, 1.5)]
    for small, large in zip(taus, taus[1:]):
        assert torch.all(large >= small)


def test_head_errors_by_hand():
    o = torch.zeros(2, 3, 2)
    o_tilde = torch.tensor([[[1.0, -1.0], [0.0, 0.0], [2.0, 0.0]], [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]])
    torch.testing.assert_close(head_errors(o, o_tilde), torch.tensor([4.0 / 3, 3.0 / 3]))
    assert head_errors(o[None].expand(4, -1, -1, -1), o_tilde[None].expand(4, -1, -1, -1)).shape == (4, 2)
    with pytest.raises(ValueError):
        head_errors(o, o_tilde[:1])


def _layer_samples(n=2, t=256, hq=4, hkv=2, d=32):
    """Samples of one layer: a positional kernel (local attention) of growing sharpness per head, a sink
    key, noise; blocks of 32 x 16 so that 256 tokens hold enough blocks to skip."""
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.logspace(-2.5, 0, 8)
        feat = torch.cat([pos.cos(), pos.sin()], -1)  # [T, 16]: q_i . k_j ~ sum_f cos(w_f (i - j))
        sharp = torch.tensor([2.0, 4.0, 6.0, 8.0])[:, None, None]
        q = torch.cat([feat.expand(1, hq, t, 16) * sharp, torch.randn(1, hq, t, d - 16, generator=g)], -1)
        k = torch.cat([feat.expand(1, hkv, t, 16), torch.randn(1, hkv, t, d - 16, generator=g)], -1)
        k[:, :, :4, 20] += 6
        q[..., 20] += 1.0
        out.append((q, k, torch.randn(1, hkv, t, d, generator=g)))
    return out


def test_end_to_end_layer_calibration_meets_bound_and_is_monotone():
    samples = _layer_samples()
    cfg = SaleSelectionConfig(bits=8, block_q=32, block_k=16, sink=16, local=64)
    errors_fn, density_fn = sale_errors_fn(samples, config=cfg)
    assert torch.all(errors_fn(torch.zeros(4)) == 0)  # tau = 0 is exactly dense
    thetas = (0.005, 0.05, 0.5)
    results = {th: halve_thresholds(errors_fn, theta=th, tau0=0.064, num_heads=4) for th in thetas}
    for th, (tau, err, _) in results.items():
        assert torch.all((err <= th) | (tau == 0))
        torch.testing.assert_close(err, errors_fn(tau))
    taus = [results[th].tau for th in thetas]
    densities = [density_fn(t).mean(0) for t in taus]
    for i in range(len(thetas) - 1):
        assert torch.all(taus[i + 1] >= taus[i]) and torch.all(densities[i + 1] <= densities[i])
    assert float(densities[-1].min()) < 0.9 and bool((taus[-1] > taus[0]).any())  # non-trivial
