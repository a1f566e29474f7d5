#!/usr/bin/env python
"""Size-aware bucket ranking for SAAP: attention recall vs selectivity against the k-means baselines.

SAAP ranks buckets by the predicted attention *mass* ``p_c`` (the GQA group's summed classifier
probabilities). For a budget of keys the greedy-optimal order is mass per key, ``p_c / n_c`` (``n_c`` =
candidate keys in bucket ``c`` at that query). This script measures the recall-vs-selectivity curve of
size-aware rankings on exactly the calibration eval's held-out set (``calib.saap.recipe.evaluate``: the
artifact's 4 held-out prompts at 4096 tokens, eval.seed = the producer's, 64 query positions per prompt
and layer from ``eval_query_positions`` with ``sample_generator(seed, prompt, layer, "saap-eval")``), with
the eval's own functions (``evaluate_layer`` for the official methods and grid, ``_record`` /
``_bucket_rank`` / ``probe_scores`` / ``classify_queries`` for the new ones) and the report's aggregation
(per head curve ``[(0, window recall), (sel, recall) per knob]``, interpolated at the targets, averaged
over the heads of every evaluated layer = layers >= 1).

Curves (``<method>/<mode>``): ``mode = top`` sweeps ℓ (``--grid-l``), ``mode = budget`` visits buckets in
score order until a key budget (fraction ``--grid-b`` of the query's candidates) is reached (the bucket
crossing the budget is included), ``mode = hyb`` is plain top-ℓ by ``p_c`` plus the top ``ceil(ℓ/2)``
buckets by density among the rest. Methods:

* ``saap`` (``p_c``), ``saap_dens`` (``p_c/n_c``), ``saap_dens05`` (``p_c/√n_c``), ``saap_per_head`` and
  ``saap_per_head_dens`` (each query head its own classifier, no group sum);
* ``kmeans_{derope,rope}_group`` (Σ_group q·c, the eval's group probe), ``kmeans_{derope,rope}`` (per head);
  ``kmeans_*_group_sm`` (Σ_group softmax_c(q·c·scale): an estimate of mass *per key*, the IVF analogue of
  density) and ``kmeans_*_group_smmass`` (``n_c`` × that: the IVF analogue of SAAP's mass ranking).

RoPE'd k-means centroids are not in the artifact: they are refitted with the recipe's own code
(``collect_keys`` on the cached collected set, ``candidate_keys``, ``fit_heads``, seed = the run's), and the
de-RoPE'd refit is compared with the artifact's centroids as a check. The official metrics of the manifest
are recomputed on the official ℓ grid (``--check`` prints the differences).

Usage (CPU, 1 thread)::

    python scripts/diag_saap_density.py --artifact A   # writes outputs/diag_saap_niah/density_recall.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from calib.saap.metrics import (  # noqa: E402
    LayerEvaluation,
    _bucket_rank,
    _empty,
    _group_sum,
    _record,
    _stack,
    evaluate_layer,
    probe_scores,
    recall_at_selectivity,
)
from runtime_kernels.saap.reference import classify_queries, nearest_centroid  # noqa: E402

GRID_L = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192)
GRID_B = (0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.45, 0.65)
OFFICIAL_L = (4, 8, 16, 32, 64, 128)

# (method, mode) curves evaluated
CURVES = [
    ("saap", "top"), ("saap", "budget"), ("saap_dens", "top"), ("saap_dens", "budget"),
    ("saap_dens05", "top"), ("saap_dens05", "budget"), ("saap", "hyb"),
    ("saap_per_head", "top"), ("saap_per_head_dens", "top"), ("saap_per_head_dens", "budget"),
    ("kmeans_derope_group", "top"), ("kmeans_derope_group", "budget"),
    ("kmeans_rope_group", "top"), ("kmeans_rope_group", "budget"),
    ("kmeans_derope", "top"), ("kmeans_rope", "top"), ("kmeans_rope", "budget"),
    ("kmeans_derope_group_sm", "top"), ("kmeans_derope_group_sm", "budget"),
    ("kmeans_rope_group_sm", "top"), ("kmeans_rope_group_sm", "budget"),
    ("kmeans_derope_group_smmass", "top"), ("kmeans_rope_group_smmass", "top"),
]


def candidate_counts(kb: torch.Tensor, cand: torch.Tensor, c: int) -> torch.Tensor:
    """Candidate keys per bucket for each query: ``kb [Hkv, T]``, ``cand [n, T]`` bool -> ``[Hkv, n, C]``."""
    onehot = torch.nn.functional.one_hot(kb.long(), c).float()  # [Hkv, T, C]
    return cand.float().unsqueeze(0) @ onehot  # [Hkv, n, C]


def evaluate_layer_sizeaware(q_rope, q_derope, k_rope, k_derope, v, query_idx, *, params, rope_centroids,
                             scale, grid_l, grid_b, curves) -> dict[str, dict[str, torch.Tensor]]:
    """Like :func:`calib.saap.metrics.evaluate_layer` with the size-aware curves: ``{curve: {metric: [n_knob, Hq, nq]}}``."""
    hq, t, d = q_rope.shape
    hkv, g = k_rope.shape[0], hq // k_rope.shape[0]
    sink, recent = params.sink, params.recent
    c = params.num_clusters
    kb_de = nearest_centroid(k_derope, params.centroids)
    kb_ro = nearest_centroid(k_rope, rope_centroids)
    kpos = torch.arange(t)
    qi = query_idx
    n = qi.numel()
    qr, qd = q_rope[:, qi], q_derope[:, qi]
    s = (qr.float().reshape(hkv, g * n, d) @ k_rope.float().transpose(1, 2)).view(hq, n, t) * scale
    visible = kpos[None, :] <= qi[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    o = (p.reshape(hkv, g * n, t) @ v.float()).view(hq, n, -1)
    window = visible & ((kpos[None, :] < sink) | (kpos[None, :] > qi[:, None] - recent))
    cand = visible & ~window
    ncand = cand.sum(-1).float()  # [n]
    out: dict[str, dict[str, list[torch.Tensor]]] = {"window": _empty()}
    _record(out["window"], p, o, v, g, window.expand_as(p), cand.expand_as(p), visible)

    cnt_de = candidate_counts(kb_de, cand, c).repeat_interleave(g, 0)  # [Hq, n, C]
    cnt_ro = candidate_counts(kb_ro, cand, c).repeat_interleave(g, 0)
    cls = classify_queries(qd.transpose(0, 1), params).transpose(0, 1)  # [Hq, n, C]
    saap = _group_sum(cls, g)
    ip_de, ip_ro = probe_scores(qd, params.centroids), probe_scores(qr, rope_centroids)
    sm_de, sm_ro = _group_sum(torch.softmax(ip_de * scale, -1), g), _group_sum(torch.softmax(ip_ro * scale, -1), g)

    def dens(score, cnt, gamma):
        return (score / cnt.clamp(min=1) ** gamma).masked_fill(cnt <= 0, float("-inf"))

    scores = {  # method -> (score [Hq, n, C], key buckets [Hkv, T], counts [Hq, n, C])
        "saap": (saap, kb_de, cnt_de),
        "saap_dens": (dens(saap, cnt_de, 1.0), kb_de, cnt_de),
        "saap_dens05": (dens(saap, cnt_de, 0.5), kb_de, cnt_de),
        "saap_per_head": (cls, kb_de, cnt_de),
        "saap_per_head_dens": (dens(cls, cnt_de, 1.0), kb_de, cnt_de),
        "kmeans_derope_group": (_group_sum(ip_de, g), kb_de, cnt_de),
        "kmeans_rope_group": (_group_sum(ip_ro, g), kb_ro, cnt_ro),
        "kmeans_derope": (ip_de, kb_de, cnt_de),
        "kmeans_rope": (ip_ro, kb_ro, cnt_ro),
        "kmeans_derope_group_sm": (sm_de, kb_de, cnt_de),
        "kmeans_rope_group_sm": (sm_ro, kb_ro, cnt_ro),
        "kmeans_derope_group_smmass": (sm_de * cnt_de, kb_de, cnt_de),
        "kmeans_rope_group_smmass": (sm_ro * cnt_ro, kb_ro, cnt_ro),
    }
    for method, mode in curves:
        name = f"{method}/{mode}"
        out[name] = _empty()
        score, kb, cnt = scores[method]
        kb_q = kb.repeat_interleave(g, 0).unsqueeze(1).expand(-1, n, -1)  # [Hq, n, T]
        if mode == "hyb":
            dn = dens(score, cnt, 1.0)
            rank_p = _bucket_rank(score)
            for ell in grid_l:
                first = rank_p < ell
                extra = _bucket_rank(dn.masked_fill(first, float("-inf"))) < math.ceil(ell / 2)
                chosen = first | (extra & (cnt > 0))
                _record(out[name], p, o, v, g, window | (cand & chosen.gather(-1, kb_q)), cand.expand_as(p), visible)
            continue
        rank = _bucket_rank(score)  # [Hq, n, C]
        key_rank = rank.gather(-1, kb_q)  # [Hq, n, T]
        if mode == "top":
            for ell in grid_l:
                _record(out[name], p, o, v, g, window | (cand & (key_rank < ell)), cand.expand_as(p), visible)
        else:  # budget: the score-ordered prefix until the key budget is reached (crossing bucket included)
            order = torch.sort(score, dim=-1, descending=True, stable=True).indices
            ns = cnt.gather(-1, order)
            before = ns.cumsum(-1) - ns  # [Hq, n, C]
            for frac in grid_b:
                m = (before < frac * ncand.view(1, n, 1)).sum(-1, keepdim=True)  # buckets taken [Hq, n, 1]
                _record(out[name], p, o, v, g, window | (cand & (key_rank < m)), cand.expand_as(p), visible)
    knobs = {"top": grid_l, "hyb": grid_l, "budget": grid_b}
    return {m: {k: (_stack(vals, [0], "window") if m == "window" else
                    torch.stack([torch.cat(vals[i::len(knobs[m.split('/')[1]])], -1)
                                 for i in range(len(knobs[m.split('/')[1]]))]))
                for k, vals in d.items()} for m, d in out.items()}


def interpolate(curves: dict[str, dict[str, torch.Tensor]], window: torch.Tensor, targets, keep=None) -> dict:
    """``calib.saap.report.interpolated_recall`` for any curve names: ``{curve: [value per target]}``.

    ``curves[m][metric] [n_layers, n_knob, Hq]``, ``window [n_layers, Hq]``; ``keep[m]`` = knob indices to use.
    """
    out = {}
    for m, d in curves.items():
        sel, rec = d["selectivity"], d["recall"]
        idx = list(range(sel.shape[1])) if keep is None or m not in keep else keep[m]
        vals = np.full((sel.shape[0], sel.shape[2], len(targets)), np.nan)
        for layer in range(sel.shape[0]):
            for h in range(sel.shape[2]):
                s = [0.0, *sel[layer, idx, h].tolist()]
                r = [float(window[layer, h]), *rec[layer, idx, h].tolist()]
                vals[layer, h] = recall_at_selectivity(s, r, targets)
        ok = ~np.isnan(vals)
        out[m] = (np.where(ok, vals, 0).sum((0, 1)) / np.maximum(ok.sum((0, 1)), 1)).tolist()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="SAAP artifact: a dir or models:/ URI (session 7: saap-tiny v11)")
    ap.add_argument("--out", default="outputs/diag_saap_niah")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        import faiss

        faiss.omp_set_num_threads(1)
    except ImportError:
        pass
    from omegaconf import OmegaConf

    from calib.collect import run_layer_callbacks
    from calib.collect.sampling import sample_generator
    from calib.config import compose
    from calib.models import load_model
    from calib.saap import report
    from calib.saap.metrics import eval_query_positions
    from calib.saap.recipe import (Settings, build_prompt_sets, candidate_keys, collect_keys, derope_capture,
                                   fit_heads, layer_scales)
    from runtime_kernels import hf
    from runtime_kernels.artifact import load_artifact
    from runtime_kernels.saap.api import SaapDecode

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = compose(["device=cpu", "+method=saap"])
    loaded = load_model(cfg.model, device="cpu")
    art = load_artifact(args.artifact, model=hf.model_facts(loaded.model))
    man = art.manifest
    prod = man.producer["config"] if isinstance(man.producer, dict) else man.producer.config
    # the run's settings: the producer's method / data / eval.seed (checked against the composed config)
    for key in ("method", "data"):
        mine, theirs = OmegaConf.to_container(cfg[key], resolve=True), prod[key]
        diff = {k: (mine.get(k), v) for k, v in theirs.items() if mine.get(k) != v}
        if diff:
            print(f"config {key} differs from the producer's: {diff}; using the producer's values")
            cfg[key] = OmegaConf.merge(cfg[key], theirs)
    cfg.eval.seed = int(prod["eval"]["seed"])
    seed = int(prod.get("seed", 0))
    s = Settings.from_cfg(cfg.method)
    calib_prompts, held_out, _, eval_length = build_prompt_sets(cfg, s, loaded.tokenizer)
    want = man.data["details"]["heldout_prompt_ids"] if isinstance(man.data, dict) else man.data.details["heldout_prompt_ids"]
    assert [p.prompt_id for p in held_out] == want, ([p.prompt_id for p in held_out], want)
    base = SaapDecode.from_artifact(art, loaded.model)
    params = {l: p for l, p in enumerate(base.layers) if not p.dense}
    layers = sorted(params)
    print(f"held-out {want}, eval length {eval_length}, layers {layers}, seed {seed}")

    cache = out_dir / "kmeans_refit_centroids.pt"
    if cache.exists():
        cents = torch.load(cache)
    else:
        collected = collect_keys(cfg, loaded, calib_prompts, s, layers)
        assert collected.content_hash == man.payload["collected_set"], "collected set differs from the run's"
        cents = {}
        for layer in layers:
            de_pts, ro_pts = candidate_keys(collected, layer, s.sink, s.recent)
            cents[layer] = {"rope": fit_heads(ro_pts, s, seed, torch.device("cpu")),
                            "derope": fit_heads(de_pts, s, seed, torch.device("cpu"))}
        torch.save(cents, cache)
    for layer in layers:
        diff = float((cents[layer]["derope"] - params[layer].centroids.float()).abs().max())
        print(f"layer {layer}: de-RoPE'd k-means refit vs artifact centroids, max |diff| {diff:.2e}")
    rope_centroids = {l: cents[l]["rope"] for l in layers}
    print(f"setup {time.perf_counter() - t0:.0f} s")

    scales = layer_scales(loaded.model)
    official: dict[int, list[LayerEvaluation]] = defaultdict(list)
    mine: dict[int, list[dict]] = defaultdict(list)

    def on_layer(cap: Any) -> None:
        if cap.layer not in params:
            return
        qd, kd = derope_capture(loaded.model, cap)
        nq = min(s.eval_queries, cap.num_tokens - s.window)
        qidx = eval_query_positions(cap.num_tokens, s.sink, s.recent, nq,
                                    sample_generator(seed, cap.prompt_index, cap.layer, "saap-eval"))
        official[cap.layer].append(evaluate_layer(
            cap.q_post.float(), qd, cap.k_post.float(), kd, cap.v.float(), qidx, params=params[cap.layer],
            top_ls=s.evaluated_ls, rope_centroids=rope_centroids[cap.layer], baseline_probe=s.baseline_probe,
            scale=scales[cap.layer]))
        sc = scales[cap.layer] if scales[cap.layer] is not None else 1.0 / math.sqrt(qd.shape[-1])
        mine[cap.layer].append(evaluate_layer_sizeaware(
            cap.q_post.float(), qd, cap.k_post.float(), kd, cap.v.float(), qidx, params=params[cap.layer],
            rope_centroids=rope_centroids[cap.layer], scale=sc, grid_l=GRID_L, grid_b=GRID_B, curves=CURVES))
        print(f"  prompt {cap.prompt_index} layer {cap.layer} ({time.perf_counter() - t0:.0f} s)", flush=True)

    with torch.inference_mode():
        run_layer_callbacks(loaded, [p.input_ids for p in held_out], on_layer, layers=layers, desc="density eval")

    torch.save({"mine": dict(mine), "official": dict(official)}, out_dir / "density_recall_raw.pt")
    targets = s.recall_targets
    # 1. the official evaluation, recomputed (must match the manifest where the centroids match)
    evals = {l: LayerEvaluation.concat(v) for l, v in sorted(official.items())}
    head = report.head_curves(evals)
    off = report.interpolated_recall(head, targets)
    print("\nofficial grid (evaluate_layer + report.interpolated_recall) vs manifest:")
    for m, vals in off.items():
        ref = [man.metrics.get(f"{report.target_key(t)}.{m}") for t in targets]
        print(f"  {m:>24}: " + " ".join(f"{x:.3f}" for x in vals) + "   manifest " +
              " ".join("  -  " if r is None else f"{r:.3f}" for r in ref))
    # 2. the size-aware curves
    curves = {name: {k: torch.stack([torch.cat([e[name][k] for e in mine[l]], -1).double().mean(-1) for l in layers])
                     for k in ("selectivity", "recall", "rel_error")} for name in mine[layers[0]][0]}
    window = curves.pop("window")["recall"][:, 0]
    fine = interpolate(curves, window, targets)
    keep = {f"{m}/top": [GRID_L.index(x) for x in OFFICIAL_L] for m, mode in CURVES if mode == "top"}
    coarse = interpolate({k: v for k, v in curves.items() if k in keep}, window, targets, keep)
    print(f"\nrecall at selectivity {targets} (mean over heads of layers {layers}); 'official ℓ' = interpolated on "
          f"ℓ ∈ {OFFICIAL_L} only, 'fine' on ℓ ∈ {GRID_L} or budgets {GRID_B}")
    print(f"{'curve':>34} | {'official ℓ grid':^20} | {'fine grid':^20} | sel@ℓ=16  rec@ℓ=16")
    rows = {}
    for name in curves:
        c = coarse.get(name)
        sel16 = rec16 = float("nan")
        if name.endswith("/top") or name.endswith("/hyb"):
            i = GRID_L.index(16)
            sel16, rec16 = float(curves[name]["selectivity"][:, i].mean()), float(curves[name]["recall"][:, i].mean())
        rows[name] = {"official_grid": c, "fine_grid": fine[name], "sel_l16": sel16, "recall_l16": rec16,
                      "selectivity": curves[name]["selectivity"].mean((0, 2)).tolist(),
                      "recall": curves[name]["recall"].mean((0, 2)).tolist(),
                      "rel_error": curves[name]["rel_error"].mean((0, 2)).tolist()}
        cs = " ".join(f"{x:.3f}" for x in c) if c else " " * 17 + "-"
        print(f"{name:>34} | {cs:>20} | {' '.join(f'{x:.3f}' for x in fine[name]):>20} | {sel16:.4f}   {rec16:.3f}")
    per_layer = {}
    for name in curves:
        per_layer[name] = [interpolate({name: {k: v[i:i + 1] for k, v in curves[name].items()}}, window[i:i + 1],
                                       targets)[name] for i in range(len(layers))]
    res = {"targets": targets, "layers": layers, "grid_l": GRID_L, "grid_b": GRID_B, "official": off,
           "curves": rows, "per_layer": per_layer, "window": float(window.mean()),
           "seconds": time.perf_counter() - t0}
    name = "density_recall" + (f"_{args.tag}" if args.tag else "")
    (out_dir / f"{name}.json").write_text(json.dumps(report.json_safe(res)))
    print(f"wrote {out_dir / (name + '.json')} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
