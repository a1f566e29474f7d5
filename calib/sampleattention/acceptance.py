"""Held-out acceptance check of a SampleAttention artifact, per length bucket: does it keep dense accuracy?

    python -m calib.sampleattention.acceptance artifact=models:/sampleattention-tiny/1 \
        eval.num_prompts=20 [device=cuda] [--min-prompts 100 --max-drop 0.02]

Answers the held-out prompts (``eval.seed``, ``eval.lengths``, ``eval.tasks``, ``eval.num_prompts``
per task and length; the same generator and greedy decoding as ``calib eval``) densely and with the
artifact applied, groups them by the artifact's bucket of their token length, and reports per bucket
(and per target length): dense and SampleAttention exact-match accuracy, the paired-bootstrap 95% CI
of (SampleAttention - dense), mean sparsity and sampled CRA. ``pass`` is true when every bucket with
prompts has ``>= --min-prompts`` of them and a CI lower bound ``>= -max_drop``, and the longest bucket
with prompts has sparsity ``> 0``. The last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from calib.config import compose
from calib.data import evaluation_prompts
from calib.errors import UserError
from calib.evaluate import answer_prompts
from calib.models import load_model, resolve_device
from calib.stats import paired_bootstrap_diff
from runtime_kernels import hf
from runtime_kernels.artifact import load_artifact
from runtime_kernels.sampleattention.api import SampleAttentionPrefill


def group_summary(dense: Sequence[Any], sparse: Sequence[Any], keys: Sequence[Any], *, resamples: int,
                  seed: int) -> dict[str, dict[str, float]]:
    """Per key: ``n``, accuracies, paired-bootstrap CI of the difference and mean runtime statistics.

    ``dense``/``sparse``: :class:`calib.evaluate.PromptResult` in the same prompt order; ``keys[i]`` is
    prompt ``i``'s group.
    """
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        groups[key].append(i)
    out: dict[str, dict[str, float]] = {}
    for key, idx in sorted(groups.items()):
        d = np.array([dense[i].correct for i in idx], dtype=float)
        s = np.array([sparse[i].correct for i in idx], dtype=float)
        ci = paired_bootstrap_diff(d, s, resamples=resamples, seed=seed)
        entry = {"n": float(len(idx)), "dense_acc": float(d.mean()), "sparse_acc": float(s.mean()),
                 "diff": ci.mean, "diff_ci_low": ci.low, "diff_ci_high": ci.high}
        for name in ("sparsity", "cra", "cra_min"):
            vals = [sparse[i].stats[name] for i in idx if name in sparse[i].stats]
            if vals:
                entry[name] = float(np.mean(vals))
        out[str(key)] = entry
    return out


def verdict(buckets: dict[str, dict[str, float]], *, min_prompts: int, max_drop: float) -> dict[str, Any]:
    """The acceptance rule of the module docstring on :func:`group_summary`'s per-bucket output."""
    if not buckets:
        return {"pass": False, "reasons": ["no prompts"]}
    reasons = [f"bucket {k}: {int(v['n'])} prompts < {min_prompts}" for k, v in buckets.items() if v["n"] < min_prompts]
    reasons += [f"bucket {k}: CI lower bound {v['diff_ci_low']:.4f} < {-max_drop}" for k, v in buckets.items()
                if v["diff_ci_low"] < -max_drop]
    longest = buckets[max(buckets, key=int)]
    if not longest.get("sparsity", 0.0) > 0.0:
        reasons.append(f"longest bucket sparsity {longest.get('sparsity', 0.0)} is not > 0")
    return {"pass": not reasons, "reasons": reasons}


def check(cfg: Any, *, min_prompts: int = 100, max_drop: float = 0.02) -> dict[str, Any]:
    """Run the check for ``cfg.artifact`` (a composed calib config); returns the result dict."""
    if not cfg.get("artifact"):
        raise UserError("give the artifact: artifact=models:/sampleattention-<model>/<version> (or a directory)")
    loaded = load_model(cfg.model, device=str(resolve_device(str(cfg.get("device", "auto")))))
    artifact = load_artifact(str(cfg.artifact), model=hf.model_facts(loaded.model))
    if artifact.method != "sampleattention":
        raise UserError(f"{cfg.artifact} is a {artifact.method!r} artifact, not sampleattention")
    if artifact.manifest.data.seed is not None and int(artifact.manifest.data.seed) == int(cfg.eval.seed):
        raise UserError(f"eval.seed={cfg.eval.seed} is the artifact's calibration seed: pick another eval.seed")
    table = SampleAttentionPrefill.from_artifact(artifact, loaded.model).table
    prompts = evaluation_prompts(cfg, loaded.tokenizer)
    max_new = int(cfg.eval.max_new_tokens)
    dense = answer_prompts(loaded, prompts, max_new)
    runtime = hf.apply(loaded.model, artifact, serve="method", options={"sampleattention": {"stats": True}})
    try:
        sparse = answer_prompts(loaded, prompts, max_new, runtime, desc="sampleattention")
    finally:
        hf.remove(loaded.model)
    kw = {"resamples": int(cfg.eval.bootstrap), "seed": int(cfg.seed)}
    buckets = group_summary(dense, sparse, [table.bucket_index(len(p.input_ids)) for p in prompts], **kw)
    lengths = group_summary(dense, sparse, [p.length for p in prompts], **kw)
    result = {"artifact": str(cfg.artifact), "buckets": buckets, "lengths": lengths,
              "table": table.to_dict(), **verdict(buckets, min_prompts=min_prompts, max_drop=max_drop)}
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m calib.sampleattention.acceptance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-prompts", type=int, default=100, help="held-out prompts needed per bucket")
    parser.add_argument("--max-drop", type=float, default=0.02, help="allowed CI lower bound of the accuracy drop")
    args, overrides = parser.parse_known_args(argv)
    try:
        result = check(compose(overrides), min_prompts=args.min_prompts, max_drop=args.max_drop)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
