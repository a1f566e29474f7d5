"""SAAP calibration end to end on a synthetic prompt: k-means -> targets -> classifiers -> evaluation."""

from __future__ import annotations

import torch

from calib.saap import (
    assign,
    evaluate_layer,
    fit_kmeans_heads,
    fit_query_classifiers,
    kl_targets,
    select_training_queries,
)
from calib.saap.metrics import eval_query_positions
from tests.saap.saap_synth import derope, synthetic_prompt

SINK, RECENT, LONG, C = 1, 63, 128, 16


def test_pipeline_learns_long_range_buckets():
    torch.manual_seed(0)
    train = [synthetic_prompt(t=1024, seed=s) for s in range(2)]
    test = synthetic_prompt(t=1024, seed=7)
    # k-means on bucket candidates of the calibration prompts (sink and final window excluded)
    keys = torch.cat([derope(p["k_rope"], p["cos"], p["sin"])[:, SINK:1024 - RECENT] for p in train], 1)
    cents = fit_kmeans_heads(keys, C, iters=10, seed=0, backend="torch", use_gpu=False)
    xs, ts = [], []
    for p in train:  # second pass: targets while the prompt's keys are in memory
        kb = assign(derope(p["k_rope"], p["cos"], p["sin"]), cents)
        qidx, is_lr = select_training_queries(p["q_rope"], p["k_rope"], 128, LONG, sink=SINK, candidates=512,
                                              generator=torch.Generator().manual_seed(0))
        assert is_lr.float().mean() > 0.9
        ts.append(kl_targets(p["q_rope"], p["k_rope"], kb, qidx, C, sink=SINK))
        xs.append(derope(p["q_rope"], p["cos"], p["sin"]).gather(1, qidx.unsqueeze(-1).expand(-1, -1, 32)))
    x, t = torch.cat(xs, 1), torch.cat(ts, 1)
    prompt_index = torch.arange(x.shape[1]) // 128
    model, curve = fit_query_classifiers(x, t, hidden=64, lr=3e-3, steps=100, batch=128, progress=False,
                                         prompt_index=prompt_index)
    assert curve[-10:].mean() < 0.6 * curve[:5].mean()
    params = model.layer_params(cents, sink=SINK, recent=RECENT)
    qd, kd = derope(test["q_rope"], test["cos"], test["sin"]), derope(test["k_rope"], test["cos"], test["sin"])
    qidx = eval_query_positions(1024, SINK, RECENT, 48, torch.Generator().manual_seed(1))
    ev = evaluate_layer(test["q_rope"], qd, test["k_rope"], kd, test["v"], qidx, params=params, top_ls=[2])
    s = ev.summary()  # ℓ = 2 of C = 16 buckets
    assert s["saap"]["selectivity"][0] < 0.45
    assert s["saap"]["recall"][0] > s["window"]["recall"][0] + 0.2
    assert s["saap"]["rel_error"][0] < 0.8 * s["window"]["rel_error"][0]
