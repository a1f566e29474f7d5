#!/usr/bin/env python
"""Retrain SAAP's query classifiers on a fixed partition (an artifact's centroids) with variations.

Companion of ``scripts/diag_saap_niah.py``: that script shows the niah_single losses come from the
layer-3 classifiers (an oracle ranking of the same buckets fixes every failing prompt at ℓ = 4). This
one keeps the artifact's k-means centroids (the partition), recomputes the classifier training rows
exactly as ``calib.saap.recipe`` does (``training_rows``: sampled long-range queries + teacher-forced
answer rows, ``A·H_k`` targets), and trains the classifiers with variations:

* ``steps``  : optimizer steps (default the artifact's 600);
* ``rep``    : each answer row (teacher-forced decode positions of the gold answer) repeated ``rep``
  times in its prompt's row set, i.e. up-weighted ``rep``-fold in the KL loss (1 = the recipe);
* ``prompts``: calibration prompts (``method.prompts``; rows are cached per prompt count).

For each variant it reports, per non-dense layer, how much of the target mass (summed over a GQA group,
as the runtime ranks) lies in the classifier's top-ℓ buckets, on the answer rows of the calibration
prompts (fit) and of held-out niah_single prompts (eval.seed, never trained on), and on held-out
sampled long-range rows (general recall, to see nothing else regresses); then it writes an artifact
(the base manifest with the new tensors) that ``calib eval`` and ``diag_saap_niah.py --new-artifact``
load.

    python scripts/diag_saap_retrain.py --artifact $A --variants "base:rep=1;rep16:rep=16" --write rep16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402



def parse_variants(spec: str) -> list[tuple[str, dict[str, int]]]:
    out = []
    for part in [p for p in spec.split(";") if p]:
        name, _, kv = part.partition(":")
        opts = {"steps": 600, "rep": 1}
        for item in [x for x in kv.split(",") if x]:
            k, _, v = item.partition("=")
            opts[k] = int(v)
        out.append((name, opts))
    return out


def rows_tensors(rows: Any, rep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``TrainingRows.tensors()`` with every answer row repeated ``rep`` times (in its prompt)."""
    xs, ts, idx = [], [], []
    for x, t, a, p in zip(rows.x, rows.targets, rows.answer, rows.prompt):
        cols = torch.arange(x.shape[1])
        ans = cols[a[0]]  # answer rows are the same columns for every head
        cols = torch.cat([cols, ans.repeat(max(0, rep - 1))])
        xs.append(x[:, cols])
        ts.append(t[:, cols])
        idx.append(torch.full((cols.numel(),), p))
    return torch.cat(xs, 1), torch.cat(ts, 1), torch.cat(idx)


def group_coverage(probs: torch.Tensor, targets: torch.Tensor, group: int, top_l: int) -> float:
    """Mean over rows and KV heads of the group-summed target mass in the group's top-ℓ buckets
    (the runtime's ranking: classifier probabilities summed over the group)."""
    hq, n, c = probs.shape
    score = probs.view(hq // group, group, n, c).sum(1)
    tgt = targets.view(hq // group, group, n, c).sum(1) / group
    top = score.topk(top_l, -1).indices
    return float(tgt.gather(-1, top).sum(-1).mean())


def classify(params: Any, x: torch.Tensor) -> torch.Tensor:
    from runtime_kernels.saap.reference import classify_queries

    return classify_queries(x.transpose(0, 1), params).transpose(0, 1)  # [Hq, N, C]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="base SAAP artifact, a dir or models:/ URI (its centroids are kept)")
    ap.add_argument("--prompts", type=int, default=45)
    ap.add_argument("--variants", default="base:rep=1")
    ap.add_argument("--heldout-seed", type=int, default=616161)
    ap.add_argument("--heldout-n", type=int, default=16)
    ap.add_argument("--top-l", type=int, default=16)
    ap.add_argument("--write", default="", help="comma-separated variant names to write as artifacts")
    ap.add_argument("--out", default="outputs/diag_saap_niah")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from calib.config import compose
    from calib.data import build_prompts
    from calib.models import load_model
    from calib.saap.classifier import fit_query_classifiers
    from calib.saap.recipe import Settings, build_prompt_sets, training_rows
    from runtime_kernels import hf
    from runtime_kernels.artifact import load_artifact
    from runtime_kernels.manifest import write_artifact

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = compose(["+method=saap", "device=cpu", f"method.prompts={args.prompts}"])
    s = Settings.from_cfg(cfg.method)
    seed = int(cfg.get("seed", 0))
    loaded = load_model(cfg.model, device="cpu")
    base = load_artifact(args.artifact, model=hf.model_facts(loaded.model))
    hp = base.manifest.hyperparameters
    assert int(hp["clusters"]) == s.clusters and int(hp["window"]) == s.window, "config differs from the artifact"
    layers = sorted({int(k.split(".")[1]) for k in base.tensors if k.startswith("layers.")})
    centroids = {l: base.tensors[f"layers.{l}.centroids"] for l in layers}
    g = int(base.tensors[f"layers.{layers[0]}.w1"].shape[0]) // int(centroids[layers[0]].shape[0])

    t0 = time.perf_counter()
    cache = out / f"rows_p{args.prompts}.pt"
    if cache.exists():
        rows = torch.load(cache, weights_only=False)
    else:
        calib_prompts, _, _, _ = build_prompt_sets(cfg, s, loaded.tokenizer)
        rows = training_rows(loaded, calib_prompts, centroids, s, seed)
        torch.save(rows, cache)
    hcache = out / f"heldout_rows_s{args.heldout_seed}_n{args.heldout_n}.pt"
    if hcache.exists():
        held_rows = torch.load(hcache, weights_only=False)
    else:
        held = build_prompts(cfg.data, loaded.tokenizer, seed=args.heldout_seed, lengths=[8192], tasks=["niah_single"],
                             num_prompts=args.heldout_n, purpose="evaluation")
        held_rows = training_rows(loaded, held, centroids, dataclasses.replace(s, queries_per_prompt=64), seed + 1)
        torch.save(held_rows, hcache)
    print(f"rows ready ({time.perf_counter() - t0:.0f} s): " + ", ".join(
        f"L{l}: {sum(x.shape[1] for x in r.x)} rows, {sum(int(a[0].sum()) for a in r.answer)} answer"
        for l, r in rows.items()), flush=True)

    def split(r: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        x, t = torch.cat(r.x, 1), torch.cat(r.targets, 1)
        a = torch.cat(r.answer, 1)[0]
        return {"answer": (x[:, a], t[:, a]), "sampled": (x[:, ~a], t[:, ~a])}

    results: dict[str, Any] = {}
    to_write = {w for w in args.write.split(",") if w}
    for name, opts in parse_variants(args.variants):
        t1 = time.perf_counter()
        params, res = {}, {}
        for l in layers:
            x, t, index = rows_tensors(rows[l], opts["rep"])
            model, curve = fit_query_classifiers(x, t, hidden=s.hidden, lr=s.lr, steps=opts["steps"], batch=s.batch,
                                                 seed=s.classifier_seed,
                                                 prompt_index=index if s.batch_from_one_prompt else None,
                                                 device="cpu", progress=False)
            params[l] = model.layer_params(centroids[l], sink=s.sink, recent=s.recent)
            fit, ev = split(rows[l]), split(held_rows[l])
            res[l] = {"fit_answer": group_coverage(classify(params[l], fit["answer"][0]), fit["answer"][1], g, args.top_l),
                      "fit_sampled": group_coverage(classify(params[l], fit["sampled"][0]), fit["sampled"][1], g,
                                                    args.top_l),
                      "heldout_answer": group_coverage(classify(params[l], ev["answer"][0]), ev["answer"][1], g,
                                                       args.top_l),
                      "heldout_sampled": group_coverage(classify(params[l], ev["sampled"][0]), ev["sampled"][1], g,
                                                        args.top_l),
                      "loss_last": float(curve[-30:].mean())}
        results[name] = {"opts": opts, "layers": res, "seconds": time.perf_counter() - t1}
        print(f"{name:>14} {opts}: " + " | ".join(
            f"L{l} fit ans {r['fit_answer']:.3f} samp {r['fit_sampled']:.3f}, held-out ans {r['heldout_answer']:.3f} "
            f"samp {r['heldout_sampled']:.3f}" for l, r in res.items()) + f"  ({time.perf_counter() - t1:.0f} s)",
              flush=True)
        if name in to_write:
            tensors = {f"layer_{l}": p.to_tensors(prefix=f"layers.{l}.") for l, p in params.items()}
            hyper = dict(hp)
            hyper["classifier"] = {**hp["classifier"], "steps": opts["steps"], "answer_row_repeat": opts["rep"]}
            hyper["prompts"] = args.prompts
            hyper["diag_retrain"] = {"base": str(args.artifact), "variant": name, **opts}
            manifest = dataclasses.replace(base.manifest, hyperparameters=hyper, metrics={})
            path = out / f"artifact_{name}_p{args.prompts}"
            if path.exists():
                import shutil

                shutil.rmtree(path)
            write_artifact(path, manifest, tensors)
            results[name]["artifact"] = str(path)
            print(f"  wrote {path}", flush=True)
    (out / f"retrain_p{args.prompts}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
