#!/usr/bin/env python
"""Pool ``calib eval`` runs over several held-out seeds into one paired comparison per setting.

One ``calib eval`` call draws ``eval.num_prompts`` prompts per task from ``eval.seed``; several calls on
different seeds (run side by side on one GPU) hold disjoint prompts. Each call logs ``eval.json`` to
its MLflow run (``tasks``, ``metrics``, ``config``, per-prompt ``dense_predictions`` and
``sparse_predictions``). This script groups those files by the runtime setting (``eval.top_l``,
``eval.top_l_layers``, ``eval.ranking``; the artifact must be the same), concatenates the per-prompt results of a group in
seed order and reports per task: dense and sparse accuracy, the paired-bootstrap 95 % CI of
(sparse − dense) over all pooled prompts (:func:`calib.stats.paired_bootstrap_diff`), the discordant
pairs, and the prompt-weighted mean selectivity.

    python scripts/pool_evals.py RUN_DIR/eval.json ... --out pooled.json

``--out`` writes the summary plus a compact per-prompt record (task, dense and sparse correctness per
seed), enough to recompute every number without the MLflow store.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from calib.stats import paired_bootstrap_diff  # noqa: E402


def setting(run: Mapping[str, Any]) -> tuple[str, int | None, str, str]:
    """(artifact, ℓ override, ranking, per-layer ℓ as ``"3:192"`` or "") of one eval.json: runs that share
    it are pooled."""
    cfg = run["config"]
    ev = cfg.get("eval", {})
    rt = run.get("runtime") or {}  # what the runtime used (artifact defaults + overrides); absent in older eval.json
    per_layer = ev.get("top_l_layers") or rt.get("top_l_layers") or {}
    layers = ",".join(f"{k}:{v}" for k, v in sorted(per_layer.items(), key=lambda kv: int(kv[0])))
    return str(cfg.get("artifact")), ev.get("top_l") or rt.get("top_l"), ev.get("ranking") or "mass", layers


def compact(run: Mapping[str, Any]) -> dict[str, Any]:
    """Seed, per-task selectivity and per-prompt correctness of one run (checks dense/sparse pairing)."""
    dense, sparse = run["dense_predictions"], run["sparse_predictions"]
    if not sparse or len(dense) != len(sparse):
        raise ValueError(f"eval seed {run['config']['eval'].get('seed')}: dense and sparse predictions do not pair "
                         f"({len(dense)} vs {0 if not sparse else len(sparse)})")
    prompts = []
    for d, s in zip(dense, sparse):
        if (d["task"], d["length"]) != (s["task"], s["length"]):
            raise ValueError(f"prompt order differs between dense and sparse: {d['task']} vs {s['task']}")
        prompts.append({"task": f"{d['task']}@{d['length']}", "dense": bool(d["correct"]),
                        "sparse": bool(s["correct"])})
    selectivity = {k[: -len(".selectivity")]: v for k, v in run["metrics"].items()
                   if k.endswith(".selectivity") and "@" in k}
    return {"seed": run["config"]["eval"].get("seed"), "selectivity": selectivity, "prompts": prompts}


def pool(runs: Iterable[Mapping[str, Any]], resamples: int = 10000, seed: int = 0) -> list[dict[str, Any]]:
    """One summary per (setting, task), runs of a setting concatenated in seed order."""
    groups: dict[tuple[str, int | None, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[setting(run)].append(compact(run))
    out = []
    for (artifact, top_l, ranking, layers), members in sorted(groups.items(),
                                                              key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2], kv[0][3])):
        members.sort(key=lambda m: (m["seed"] is None, m["seed"]))
        seeds = [m["seed"] for m in members]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"setting l={top_l} {layers} {ranking}: seed repeated in {seeds} (the same prompts twice)")
        tasks = sorted({p["task"] for m in members for p in m["prompts"]})
        for task in tasks:
            d = np.array([p["dense"] for m in members for p in m["prompts"] if p["task"] == task], dtype=float)
            s = np.array([p["sparse"] for m in members for p in m["prompts"] if p["task"] == task], dtype=float)
            n_per = [sum(p["task"] == task for p in m["prompts"]) for m in members]
            sel = [m["selectivity"].get(task) for m in members]
            mean_sel = (float(np.average([x for x in sel if x is not None],
                                         weights=[n for n, x in zip(n_per, sel) if x is not None]))
                        if any(x is not None for x in sel) else None)
            ci = paired_bootstrap_diff(d, s, resamples=resamples, seed=seed)
            out.append({"artifact": artifact, "top_l": top_l, "top_l_layers": layers, "ranking": ranking, "task": task,
                        "seeds": seeds,
                        "prompts": int(d.size), "dense": float(d.mean()), "sparse": float(s.mean()),
                        "diff": float(ci.mean), "ci_low": float(ci.low), "ci_high": float(ci.high),
                        "sparse_better": int((s > d).sum()), "sparse_worse": int((s < d).sum()),
                        "selectivity": mean_sel})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="eval.json files of `calib eval` runs")
    ap.add_argument("--out", type=Path, default=None, help="write the summary and per-prompt records here")
    ap.add_argument("--resamples", type=int, default=10000)
    args = ap.parse_args(argv)
    runs = [json.loads(f.read_text()) for f in args.files]
    rows = pool(runs, resamples=args.resamples)
    print(f"{'l':>4} {'per layer':>9} {'ranking':8} {'task':22} {'n':>4} {'dense':>6} {'sparse':>6} {'diff':>7} {'95% CI':>17} "
          f"{'+/-':>7} {'select.':>7}")
    for r in rows:
        sel = "-" if r["selectivity"] is None else f"{100 * r['selectivity']:.1f}%"
        print(f"{r['top_l'] or '-':>4} {r['top_l_layers'] or '-':>9} {r['ranking']:8} {r['task']:22} {r['prompts']:4d} {r['dense']:6.3f} "
              f"{r['sparse']:6.3f} {r['diff']:+7.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] "
              f"{r['sparse_better']:>3}/{r['sparse_worse']:<3} {sel:>7}")
    if args.out:
        records = [dict(zip(("artifact", "top_l", "ranking", "top_l_layers"), setting(run)), **compact(run))
                   for run in runs]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": rows, "runs": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
