"""Per-task answer flips of SampleAttention grid points on one length's profiling prompts, under both feasibility rules.

    python scripts/research/sampleattention_profile_flips.py --length 1024 --points 0.8,0.8,1 0.95,0.95,1 \
        --out flips.json -- model=smollm2 device=cpu

The profile is the one ``python -m calib run +method=sampleattention`` scores for that length (the model's
``method.profiling`` and data, trailing Hydra overrides applied), answered densely once and at each point by
greedy exact match (:class:`calib.sampleattention.scoring.BucketEvaluator`, the serving loop's batches). Per
task: dense and sparse correct answers, answers lost (dense right, sparse wrong) and gained, the per-task mean
rule (sparse / dense correct) and the retention rule the tuner applies (answers dense got that the point keeps).
Needs Hydra and OmegaConf (``calib.config``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from calib.config import compose
from calib.models import load_model
from calib.sampleattention.recipe import Settings, _profiling_prompts
from calib.sampleattention.scoring import BucketEvaluator
from calib.sampleattention.tuning import GridPoint


def parse_point(text: str) -> GridPoint:
    try:
        alpha_c, alpha_s, chunk_n = text.split(",")
        return GridPoint(float(alpha_c), float(alpha_s), int(chunk_n))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is alpha_c,alpha_s,chunk_n (got {text!r})") from None


def per_task(evaluator: BucketEvaluator, sparse: list[float]) -> dict[str, dict[str, float]]:
    """Counts and both rules' ratios per task (dense and sparse scores in the evaluator's prompt order)."""
    out: dict[str, dict[str, float]] = {}
    for i, dense in enumerate(evaluator.dense_scores):
        row = out.setdefault(evaluator.task(i), {"prompts": 0, "dense": 0.0, "sparse": 0.0, "lost": 0, "gained": 0})
        row["prompts"] += 1
        row["dense"] += dense.score
        row["sparse"] += sparse[i]
        row["lost"] += dense.score > sparse[i]
        row["gained"] += sparse[i] > dense.score
    for row in out.values():
        row["mean_rule"] = row["sparse"] / row["dense"] if row["dense"] else 1.0
        row["retention"] = (row["dense"] - row["lost"]) / row["dense"] if row["dense"] else 1.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, required=True, help="the profiled prompt length (one of the model's lengths)")
    ap.add_argument("--points", type=parse_point, nargs="+", required=True, help="alpha_c,alpha_s,chunk_n ...")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after --, e.g. model=smollm2 device=cpu")
    args = ap.parse_args()
    cfg = compose(["+method=sampleattention", *args.overrides, f"model.lengths=[{args.length}]"])
    s = Settings.from_cfg(cfg)
    loaded = load_model(cfg.model, device=str(cfg.device))
    prompts = _profiling_prompts(cfg, s, loaded.tokenizer)
    evaluator = BucketEvaluator(loaded, prompts, s.blk, "exact_match", s.profiling.max_new_tokens, loop="static",
                                batch_tokens=s.profiling.batch_tokens, report_cra=False)
    started = time.time()
    evaluator.dense()
    result = {"length": args.length, "prompts": dict(Counter(p.task for p in prompts)), "overrides": args.overrides,
              "dense_s": round(time.time() - started), "points": []}
    for point in args.points:
        started = time.time()
        got = evaluator.full(point)
        result["points"].append({"point": [point.alpha_c, point.alpha_s, point.chunk_n], "sparsity": got.sparsity,
                                 "retention_score": got.score, "seconds": round(time.time() - started),
                                 "per_task": per_task(evaluator, [x.score for x in got.scores])})
        print(json.dumps(result["points"][-1]), flush=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
