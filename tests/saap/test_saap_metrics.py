"""SAAP evaluation metrics: hand cases, window-only recall, ℓ ≥ C is exact, agreement with the runtime."""

from __future__ import annotations

import math

import pytest
import torch

from calib.saap.metrics import (
    attention_recall,
    eval_query_positions,
    evaluate_layer,
    output_relative_error,
    probe_top_l_by_inner_product,
    recall_at_selectivity,
    selectivity,
)
from runtime_kernels.saap.bucket_index import BucketIndex
from runtime_kernels.saap.reference import SaapLayerParams, saap_decode_attention_reference
from tests.saap.saap_synth import derope, synthetic_prompt

SINK, RECENT, C = 1, 31, 8


def _params(hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return SaapLayerParams(sink=SINK, recent=RECENT, centroids=r(hkv, C, d), w1=r(hq, d, 16) / math.sqrt(d),
                           b1=r(hq, 16) * 0.1, bn_mean=torch.zeros(hq, 16), bn_var=torch.ones(hq, 16),
                           bn_weight=torch.ones(hq, 16), bn_bias=torch.zeros(hq, 16), w2=r(hq, 16, C) / 4,
                           b2=torch.zeros(hq, C))


@pytest.fixture(scope="module")
def prompt():
    p = synthetic_prompt(t=400, d=16)
    p["q_de"], p["k_de"] = derope(p["q_rope"], p["cos"], p["sin"]), derope(p["k_rope"], p["cos"], p["sin"])
    return p


def _eval(p, params, qidx, **kw):
    return evaluate_layer(p["q_rope"], p["q_de"], p["k_rope"], p["k_de"], p["v"], qidx, params=params, **kw)


def test_hand_cases():
    sel = torch.tensor([True, False, True, True])
    cand = torch.tensor([False, True, True, True])
    assert selectivity(sel, cand).item() == pytest.approx(2 / 3)
    assert attention_recall(torch.tensor([0.1, 0.2, 0.3, 0.4]), sel).item() == pytest.approx(0.8)
    assert output_relative_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])).item() == pytest.approx(
        math.sqrt(10) / 5)
    assert recall_at_selectivity([0.0, 0.1, 0.2], [0.5, 0.7, 0.9], [0.05, 0.2, 0.3]) == pytest.approx(
        [0.6, 0.9, float("nan")], nan_ok=True)


def test_probe_top_l_brute_force():
    q, c = torch.randn(4, 3, 5), torch.randn(2, 7, 5)
    top = probe_top_l_by_inner_product(q, c, 3)
    for h in range(4):
        for n in range(3):
            assert set(top[h, n].tolist()) == set((c[h // 2] @ q[h, n]).topk(3).indices.tolist())


def test_window_recall_is_mass_in_window(prompt):
    p = prompt
    qidx = torch.tensor([RECENT + SINK, 100, 399])
    ev = _eval(p, _params(8, 2, 16), qidx)
    rec = ev.metrics["window"]["recall"][0]  # [Hq, nq]
    for n, i in enumerate(qidx.tolist()):
        for h in range(8):
            s = (p["k_rope"][h // 4, : i + 1].double() @ p["q_rope"][h, i].double()) / 4.0
            a = torch.softmax(s, 0)
            mass = a[:SINK].sum() + a[i + 1 - RECENT:].sum()
            assert rec[h, n].item() == pytest.approx(mass.item(), abs=1e-5)
    assert (ev.metrics["window"]["selectivity"] == 0).all()


def test_all_buckets_is_exact_and_curves_monotone(prompt):
    ev = _eval(prompt, _params(8, 2, 16), eval_query_positions(400, SINK, RECENT, 20), top_ls=[1, 2, 4, C],
               rope_centroids=torch.randn(2, C, 16))
    for m in ("saap", "saap_per_head", "kmeans_derope", "kmeans_rope"):
        d = ev.metrics[m]
        assert d["recall"].shape == (4, 8, 20)
        assert torch.allclose(d["recall"][-1], torch.ones(8, 20), atol=1e-5)
        assert (d["rel_error"][-1] < 1e-4).all() and (d["selectivity"][-1] == 1).all()
        assert (d["selectivity_with_window"][-1] == 1).all()
        assert (d["recall"].diff(dim=0) >= -1e-6).all() and (d["selectivity"].diff(dim=0) >= 0).all()
        assert (d["recall"][0] >= ev.metrics["window"]["recall"][0] - 1e-6).all()
    summary = ev.summary()
    assert len(summary["saap"]["recall"]) == 4 and len(summary["window"]["recall"]) == 1


def test_saap_error_matches_runtime_reference(prompt):
    """The query at the last position is a decode step: evaluation and runtime must select alike."""
    p, t = prompt, 400
    params = _params(8, 2, 16)
    ev = _eval(p, params, torch.tensor([t - 1]), top_ls=[2])
    idx = BucketIndex.build(p["k_de"].unsqueeze(0), params.centroids, sink=SINK, recent=RECENT)
    out = saap_decode_attention_reference(p["q_rope"][:, -1].unsqueeze(0), p["q_de"][:, -1].unsqueeze(0),
                                          p["k_rope"].unsqueeze(0), p["v"].unsqueeze(0), idx, params, top_l=2)
    s = torch.einsum("hgd,htd->hgt", p["q_rope"][:, -1].view(2, 4, 16), p["k_rope"]) / 4.0
    dense = (torch.softmax(s, -1) @ p["v"]).reshape(8, 16)
    err = output_relative_error(out[0], dense)
    assert torch.allclose(ev.metrics["saap"]["rel_error"][0, :, 0], err, atol=1e-4)


def test_saap_per_head_ranks_each_heads_own_buckets(prompt):
    """Per-head SAAP visits, for query head h, the keys of the ℓ buckets its own classifier scores highest
    (brute force over the classifier's logits); the group-probe report has no such method."""
    from runtime_kernels.saap.bucket_index import nearest_centroid
    from runtime_kernels.saap.reference import classify_queries

    p, params, qidx, ell = prompt, _params(8, 2, 16), torch.tensor([200, 399]), 3
    ev = _eval(p, params, qidx, top_ls=[ell])
    logits = classify_queries(p["q_de"][:, qidx].transpose(0, 1), params).transpose(0, 1)  # [Hq, n, C]
    buckets = nearest_centroid(p["k_de"], params.centroids)  # [Hkv, T]
    for n, i in enumerate(qidx.tolist()):
        for h in range(8):
            s = (p["k_rope"][h // 4, : i + 1].double() @ p["q_rope"][h, i].double()) / 4.0
            a = torch.softmax(s, 0)
            best = set(logits[h, n].topk(ell).indices.tolist())
            keep = torch.zeros(i + 1, dtype=torch.bool)
            keep[:SINK] = True
            keep[i + 1 - RECENT:] = True
            keep |= torch.tensor([int(b) in best for b in buckets[h // 4, : i + 1]])
            assert ev.metrics["saap_per_head"]["recall"][0, h, n].item() == pytest.approx(a[keep].sum().item(), abs=1e-5)
    assert "saap_per_head" not in _eval(p, params, qidx, top_ls=[ell], baseline_probe="group").metrics


def test_both_probes_in_one_pass_match_the_single_probe_runs(prompt):
    p, params, qidx = prompt, _params(8, 2, 16), eval_query_positions(400, SINK, RECENT, 10)
    kw = dict(top_ls=[1, 3], rope_centroids=torch.randn(2, C, 16, generator=torch.Generator().manual_seed(1)))
    both, head, group = (_eval(p, params, qidx, baseline_probe=b, **kw).metrics for b in ("both", "head", "group"))
    assert set(both) == {"saap", "saap_per_head", "kmeans_derope", "kmeans_rope", "kmeans_derope_group",
                         "kmeans_rope_group", "window"}
    for name, ref in [("kmeans_derope", head["kmeans_derope"]), ("kmeans_rope", head["kmeans_rope"]),
                      ("kmeans_derope_group", group["kmeans_derope"]), ("kmeans_rope_group", group["kmeans_rope"]),
                      ("saap_per_head", head["saap_per_head"]), ("saap", group["saap"])]:
        assert torch.equal(both[name]["recall"], ref["recall"]), name
    assert not torch.equal(both["kmeans_rope"]["recall"], both["kmeans_rope_group"]["recall"])


def test_rejects_queries_inside_window(prompt):
    with pytest.raises(ValueError, match="sink \\+ recent"):
        _eval(prompt, _params(8, 2, 16), torch.tensor([5]))


def test_oracle_bounds_every_ranking_of_its_partition(prompt):
    """``oracle``: each partition's buckets ranked by the group's true mass on the candidate keys. For one
    bucket set per KV head that maximizes the group's captured mass at every ℓ, so the group-mean recall
    of ``oracle_derope`` is at least SAAP's and the group-probed de-RoPE'd k-means' (same partition), and
    ``oracle_rope``'s at least the group-probed RoPE'd k-means'. Hand check of one (head, query): the
    oracle's ℓ = 1 bucket holds the largest candidate mass of the group."""
    p = prompt
    rope_c = torch.randn(2, C, 16, generator=torch.Generator().manual_seed(5))
    qidx = eval_query_positions(400, SINK, RECENT, 24, torch.Generator().manual_seed(2))
    ev = _eval(p, _params(8, 2, 16), qidx, top_ls=[1, 2, 3, 5], rope_centroids=rope_c, baseline_probe="group",
               oracle=True)
    group = lambda m: ev.metrics[m]["recall"].view(4, 2, 4, -1).mean(2)  # noqa: E731 - [nℓ, Hkv, nq]
    for oracle, others in (("oracle_derope", ("saap", "kmeans_derope")), ("oracle_rope", ("kmeans_rope",))):
        for other in others:
            assert (group(oracle) >= group(other) - 1e-6).all(), (oracle, other)
    # by hand: KV head 0, the first query, ℓ = 1
    from runtime_kernels.saap.bucket_index import nearest_centroid

    i = int(qidx[0])
    kb = nearest_centroid(p["k_de"], _params(8, 2, 16).centroids)[0, : i + 1]  # KV head 0's buckets
    a = torch.softmax((p["q_rope"][:4, i].double() @ p["k_rope"][0, : i + 1].double().T) / 4.0, -1)  # [G, i+1]
    cand = torch.zeros(i + 1, dtype=torch.bool)
    cand[SINK: i + 1 - RECENT] = True
    mass = torch.zeros(C, dtype=torch.float64).index_add_(0, kb[cand], a[:, cand].sum(0))
    best = int(mass.argmax())
    window = a[:, :SINK].sum(-1) + a[:, i + 1 - RECENT:].sum(-1)  # [G]
    expected = window + a[:, cand][:, kb[cand] == best].sum(-1)
    assert ev.metrics["oracle_derope"]["recall"][0, :4, 0].double() == pytest.approx(expected, abs=1e-5)
