"""SAAP evaluation on one prompt's tensors (Mazaré et al., arXiv:2502.08246, §6, App. E.4 Table 5).

A query at position ``i`` is evaluated as the decode step that sees keys ``0..i``: the dense region is
the sink ``[0, sink)`` plus the window ``[i + 1 - recent, i]``, the bucket candidates are the keys in
between (``[sink, i + 1 - recent)``). For each method and ℓ the visited set is the dense region plus
the candidates whose bucket is among the method's ℓ best buckets. Per (head, query):

* ``selectivity``: visited candidates / candidates (the paper's Table 5: keys outside the dense window);
* ``selectivity_with_window``: visited keys / all ``i + 1`` keys;
* ``recall``: mass of the true causal attention (RoPE'd ``q·k``, softmax over ``0..i``) on visited keys;
* ``rel_error``: ``‖o_sparse − o‖ / ‖o‖`` with ``o_sparse`` the softmax restricted to visited keys.

Methods (:func:`evaluate_layer`): ``saap`` (buckets of de-RoPE'd keys, ranked by the sum of the GQA
group's classifier probabilities, as the runtime does), the paper's IVF baselines ``kmeans_derope`` and
``kmeans_rope`` (k-means on de-RoPE'd / RoPE'd keys, probed by inner product like Faiss IVFFlat), and
``window`` (ℓ = 0, StreamingLLM). Results and their reading: docs/results/saap.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from runtime_kernels.saap.bucket_index import nearest_centroid
from runtime_kernels.saap.reference import SaapLayerParams, classify_queries

_BUDGET = 1 << 24  # elements of one [Hq, chunk, T] buffer


# ------------------------------------------------------------------------------------ per-query metrics
def selectivity(selected: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Fraction of candidate keys that are selected: bool ``[..., T]`` x2 -> ``[...]`` (0 if no candidate)."""
    n = candidates.sum(-1)
    return (selected & candidates).sum(-1).float() / n.clamp(min=1).float()


def attention_recall(probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """True attention mass on the selected keys: ``probs [..., T]`` (rows sum to 1), bool ``[..., T]`` -> ``[...]``."""
    return (probs * selected).sum(-1)


def output_relative_error(o_approx: torch.Tensor, o_exact: torch.Tensor) -> torch.Tensor:
    """``‖o_approx − o_exact‖ / ‖o_exact‖`` over the last dim: ``[..., D]`` x2 -> ``[...]``."""
    return (o_approx.float() - o_exact.float()).norm(dim=-1) / o_exact.float().norm(dim=-1).clamp(min=1e-30)


def probe_scores(q: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Inner products with the centroids of each query's KV head.

    ``q [Hq, n, D]``, ``centroids [Hkv, C, D]`` -> ``[Hq, n, C]``.
    """
    hq, n, d = q.shape
    hkv = centroids.shape[0]
    s = q.float().reshape(hkv, (hq // hkv) * n, d) @ centroids.float().transpose(1, 2)  # [Hkv, G*n, C]
    return s.view(hq, n, -1)


def probe_top_l_by_inner_product(q: torch.Tensor, centroids: torch.Tensor, l: int) -> torch.Tensor:
    """IVFFlat probing, the ℓ centroids of largest ``q·c`` per query.

    ``q [Hq, n, D]``, ``centroids [Hkv, C, D]`` -> ``[Hq, n, ℓ]``.

    Use RoPE'd queries with centroids of RoPE'd keys and de-RoPE'd queries with de-RoPE'd centroids.
    """
    s = probe_scores(q, centroids)
    return s.topk(min(l, s.shape[-1]), dim=-1).indices


def recall_at_selectivity(selectivities, recalls, targets=(0.02, 0.05, 0.10)) -> list[float]:
    """Recall interpolated linearly at the target selectivities (NaN outside the measured range).

    Pass the window-only point (selectivity 0) too if the curve should start there.
    """
    s = np.asarray(selectivities, dtype=np.float64)
    r = np.asarray(recalls, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    s, r = s[order], r[order]
    return [float(np.interp(t, s, r)) if s.size and s[0] <= t <= s[-1] else float("nan") for t in targets]


# ------------------------------------------------------------------------------------- layer evaluation
@dataclass
class LayerEvaluation:
    """Per (head, query) metrics of one layer and prompt.

    ``metrics[method][name]`` is ``[len(top_ls), Hq, nq]`` (``[1, Hq, nq]`` for ``window``), names:
    ``selectivity``, ``selectivity_with_window``, ``recall``, ``rel_error``. ``top1_distance [Hq, nq]``
    (optional): how far back each (head, query)'s top-1 key lies (sink excluded, causal;
    :func:`calib.saap.targets.top1_key_distance`), to split the report by query range.
    """

    top_ls: list[int]
    metrics: dict[str, dict[str, torch.Tensor]]
    top1_distance: torch.Tensor | None = None

    def summary(self) -> dict[str, dict[str, list[float]]]:
        """Means over heads and queries: ``{method: {metric: [value per ℓ]}}``."""
        return {m: {k: v.float().mean((1, 2)).tolist() for k, v in d.items()} for m, d in self.metrics.items()}

    @staticmethod
    def concat(evals: list["LayerEvaluation"]) -> "LayerEvaluation":
        """Join evaluations of several prompts along the query axis."""
        dist = [e.top1_distance for e in evals]
        return LayerEvaluation(evals[0].top_ls, {
            m: {k: torch.cat([e.metrics[m][k] for e in evals], -1) for k in d}
            for m, d in evals[0].metrics.items()},
            None if any(x is None for x in dist) else torch.cat(dist, -1))


def eval_query_positions(seq_len: int, sink: int, recent: int, n: int,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` sorted random positions whose decode step has bucket candidates (``i ≥ sink + recent``)."""
    first = sink + recent
    if seq_len <= first:
        raise ValueError(f"a prompt of {seq_len} tokens has no key outside the dense region ({sink}+{recent})")
    pos = torch.randperm(seq_len - first, generator=generator)[:n] + first
    return pos.sort().values


def _bucket_rank(score: torch.Tensor) -> torch.Tensor:
    """Rank of each bucket (0 = best) from scores ``[..., C]`` -> ``[..., C]`` int64."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    ar = torch.arange(score.shape[-1], device=score.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ar)


def evaluate_layer(q_rope: torch.Tensor, q_derope: torch.Tensor, k_rope: torch.Tensor, k_derope: torch.Tensor,
                   v: torch.Tensor, query_idx: torch.Tensor, *, params: SaapLayerParams,
                   top_ls=(4, 8, 16, 32, 64, 128), rope_centroids: torch.Tensor | None = None,
                   derope_centroids: torch.Tensor | None = None, baseline_probe: str = "head",
                   scale: float | None = None, oracle: bool = False) -> LayerEvaluation:
    """SAAP vs the IVF baselines vs window-only on one prompt of one (non-dense) layer.

    ``q_rope, q_derope [Hq, T, D]``, ``k_rope, k_derope, v [Hkv, T, D]``, ``query_idx [nq]`` positions
    ``≥ sink + recent`` (:func:`eval_query_positions`). ``derope_centroids`` defaults to SAAP's own
    (``params.centroids``); ``kmeans_rope`` is evaluated only when ``rope_centroids`` is given.
    ``oracle``: also ``oracle_derope`` / ``oracle_rope`` — each partition's buckets ranked by the group's
    true attention mass on its candidate keys (a perfect classifier; one bucket set per KV head like the
    runtime), the upper bound of what any ranking of that partition reaches.

    Baselines: each query head probes the ℓ centroids of largest inner product with its de-RoPE'd /
    RoPE'd query; ``baseline_probe="group"`` sums the GQA group's inner products instead. With per-head
    probing also ``saap_per_head``: each query head ranks the buckets by its own classifier, the
    like-for-like partner of the per-head baselines. The runtime's group sum visits one bucket set per
    KV head, so ``saap``'s like-for-like baselines are the group-probed ones; per-head selection visits
    up to g sets per KV head at the same per-head selectivity. ``baseline_probe="both"`` reports both
    pairs in one pass (the group-probed ones as ``kmeans_derope_group`` / ``kmeans_rope_group``);
    ``"none"`` evaluates ``saap`` and the window only (the recipe's default ``method.report``).
    """
    hq, t, d = q_rope.shape
    hkv, g = k_rope.shape[0], hq // k_rope.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sink, recent = params.sink, params.recent
    if baseline_probe not in ("head", "group", "both", "none"):
        raise ValueError(f"baseline_probe must be head, group, both or none, got {baseline_probe!r}")
    if bool((query_idx < sink + recent).any()):
        raise ValueError(f"evaluation queries must sit at positions >= sink + recent = {sink + recent}")
    top_ls = [int(x) for x in top_ls]
    derope_centroids = params.centroids if derope_centroids is None else derope_centroids
    # method -> (key buckets [Hkv, T], scorer(q_rope_chunk, q_derope_chunk) -> [Hq, n, C])
    methods = {
        "saap": (nearest_centroid(k_derope, params.centroids),
                 lambda qr, qd: _group_sum(classify_queries(qd.transpose(0, 1), params).transpose(0, 1), g)),
    }
    per_head, group = baseline_probe in ("head", "both"), baseline_probe in ("group", "both")
    if per_head:
        methods["saap_per_head"] = (methods["saap"][0],
                                    lambda qr, qd: classify_queries(qd.transpose(0, 1), params).transpose(0, 1))
    derope_buckets = nearest_centroid(k_derope, derope_centroids)
    rope_buckets = None if rope_centroids is None else nearest_centroid(k_rope, rope_centroids)
    for probe in [p for p, on in (("head", per_head), ("group", group)) if on]:
        suffix = "_group" if baseline_probe == "both" and probe == "group" else ""
        methods["kmeans_derope" + suffix] = (
            derope_buckets, lambda qr, qd, probe=probe: _maybe_group(probe_scores(qd, derope_centroids), g, probe))
        if rope_buckets is not None:
            methods["kmeans_rope" + suffix] = (
                rope_buckets, lambda qr, qd, probe=probe: _maybe_group(probe_scores(qr, rope_centroids), g, probe))
    oracles = {"oracle_derope": derope_buckets} if oracle else {}
    if oracle and rope_buckets is not None:
        oracles["oracle_rope"] = rope_buckets
    n_c = params.centroids.shape[-2]
    out: dict[str, dict[str, list[torch.Tensor]]] = {m: _empty() for m in [*methods, *oracles, "window"]}
    chunk = max(1, _BUDGET // max(1, hq * t))
    kpos = torch.arange(t, device=q_rope.device)
    for start in range(0, query_idx.numel(), chunk):
        qi = query_idx[start:start + chunk].to(q_rope.device)  # [n]
        qr, qd = q_rope[:, qi], q_derope[:, qi]  # [Hq, n, D]
        s = (qr.float().reshape(hkv, g * qi.numel(), d) @ k_rope.float().transpose(1, 2)).view(hq, -1, t) * scale
        visible = kpos[None, :] <= qi[:, None]  # [n, T]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)  # [Hq, n, T] exact causal attention
        o = _attend(p, v, g)  # [Hq, n, D]
        window = visible & ((kpos[None, :] < sink) | (kpos[None, :] > qi[:, None] - recent))  # [n, T]
        cand = visible & ~window
        _record(out["window"], p, o, v, g, window.expand_as(p), cand.expand_as(p), visible)
        scored = [(name, kb, scorer(qr, qd)) for name, (kb, scorer) in methods.items()]
        for name, kb in oracles.items():  # the group's true mass per bucket on the candidate keys
            onehot = torch.nn.functional.one_hot(kb, n_c).to(p.dtype)  # [Hkv, T, C]
            mass = ((p * cand).reshape(hkv, g * qi.numel(), t) @ onehot).view(hq, qi.numel(), n_c)
            scored.append((name, kb, _group_sum(mass, g)))
        for name, kb, score in scored:
            rank = _bucket_rank(score)  # [Hq, n, C]
            key_rank = rank.gather(-1, kb.repeat_interleave(g, 0).unsqueeze(1).expand(-1, qi.numel(), -1))
            for ell in top_ls:
                picked = cand & (key_rank < ell)  # [Hq, n, T]
                _record(out[name], p, o, v, g, window | picked, cand.expand_as(p), visible)
    return LayerEvaluation(top_ls, {m: {k: _stack(vals, top_ls, m) for k, vals in d.items()} for m, d in out.items()})


def _group_sum(score: torch.Tensor, g: int) -> torch.Tensor:
    """Sum over the GQA group, repeated for each head of the group: ``[Hq, n, C]`` -> ``[Hq, n, C]``."""
    hq = score.shape[0]
    return score.view(hq // g, g, *score.shape[1:]).sum(1).repeat_interleave(g, 0)


def _maybe_group(score: torch.Tensor, g: int, probe: str) -> torch.Tensor:
    return _group_sum(score, g) if probe == "group" else score


def _attend(p: torch.Tensor, v: torch.Tensor, g: int) -> torch.Tensor:
    """``p [Hq, n, T]`` (rows need not sum to 1) times ``v [Hkv, T, D]`` -> ``[Hq, n, D]``."""
    hq, n, t = p.shape
    return (p.reshape(hq // g, g * n, t) @ v.float()).view(hq, n, -1)


def _empty() -> dict[str, list[torch.Tensor]]:
    return {"selectivity": [], "selectivity_with_window": [], "recall": [], "rel_error": []}


def _record(acc: dict[str, list[torch.Tensor]], p: torch.Tensor, o: torch.Tensor, v: torch.Tensor, g: int,
            sel: torch.Tensor, cand: torch.Tensor, visible: torch.Tensor) -> None:
    """Append the metrics of one visited set ``sel [Hq, n, T]`` (chunk of queries)."""
    ps = p * sel
    mass = ps.sum(-1)  # [Hq, n]
    o_sparse = _attend(ps, v, g) / mass.clamp(min=1e-30).unsqueeze(-1)
    acc["selectivity"].append(selectivity(sel, cand))
    acc["selectivity_with_window"].append((sel & visible).sum(-1).float() / visible.sum(-1).float())
    acc["recall"].append(mass)
    acc["rel_error"].append(output_relative_error(o_sparse, o))


def _stack(vals: list[torch.Tensor], top_ls: list[int], method: str) -> torch.Tensor:
    """Chunks recorded in (chunk, ℓ) order -> ``[nL, Hq, nq]``."""
    nl = 1 if method == "window" else len(top_ls)
    per_l = [torch.cat(vals[i::nl], -1) for i in range(nl)]
    return torch.stack(per_l)
