#!/usr/bin/env python
"""Train the embedded ``tiny`` model on the synthetic tasks and write it, with its card.

    python scripts/train_tiny.py                      # GPU
    python scripts/train_tiny.py --smoke --out /tmp/t # CPU smoke run

What it does, deterministically from ``--seed`` (the recipe and its results: docs/results/tiny-model.md):

0. Recall stages (:mod:`recall_stage`): associative recall in ``k v``, then JSON and ``k: 1234567`` form.
1. The architecture of ``conf/model/tiny.yaml`` and the tokenizer of :mod:`calib.data.tokenizer`.
2. Data (``scripts/tiny/data.py``): every step a batch of fresh prompts from ``calib.data``'s generators, in
   a curriculum of three phases from short prompts to 8192 tokens, built in DataLoader workers.
3. Loss: cross-entropy on the answer tokens and the EOS after each answer (each example weighted
   equally), plus ``lm_loss_weight`` x next-token loss on all other tokens.
4. AdamW, linear warm-up + cosine decay, gradient clipping, bf16 autocast, SDPA attention.
5. Saves bf16 safetensors + tokenizer + ``training_config.json``, evaluates the saved weights greedily on
   held-out prompts (``--eval-seed``) and writes ``eval.json`` and ``MODEL_CARD.md``.

The stages live in ``scripts/tiny/``; this file chains them. Data and initialization are bitwise deterministic;
the CUDA backward of SDPA and of the embedding use atomics, so two GPU runs agree only up to float rounding.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked data workers tokenize one text at a time
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from calib.data import TASKS  # noqa: E402
from calib.data.tokenizer import load_tokenizer, save_tiny_tokenizer  # noqa: E402
from calib.data.vocab import name_pool, sentence_bank  # noqa: E402
from recall_stage import RecallStage  # noqa: E402
from tiny.config import Phase, TrainConfig, read_arch, smoke_config  # noqa: E402
from tiny.data import ANSWER, LM, NO_LOSS, StepBatches  # noqa: E402
from tiny.evaluation import attention_summary, build_eval_chunk, evaluate  # noqa: E402
from tiny.export import (card_info, lineage_entry, parent_lineage, read_record, render_card,  # noqa: E402
                         save_model, write_card)
from tiny.training import build_model, load_weights, run_recall, train  # noqa: E402

__all__ = ["ANSWER", "LM", "NO_LOSS", "TASKS", "Phase", "StepBatches", "TrainConfig", "build_model",
           "load_weights", "main", "read_arch"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "models" / "tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a few tiny steps on CPU (tests)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every phase's steps")
    ap.add_argument("--no-eval", action="store_true", help="skip the evaluation, eval.json and the card")
    ap.add_argument("--log-every", type=int, default=None, help="steps between log lines (default 50)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate")
    ap.add_argument("--lm-loss-weight", type=float, default=None, help="weight of the next-token loss off answers")
    ap.add_argument("--context-lm-tasks", default=None,
                    help="comma-separated tasks whose context tokens carry the next-token loss ('all' (default), "
                         "'none')")
    ap.add_argument("--extra-queries", default=None,
                    help="task=n,... further questions per training context (default niah_multikey=3, "
                         "kv_retrieval=15, variable_tracking=1)")
    ap.add_argument("--kv-recall-pairs", type=int, default=None,
                    help="pairs repeated after a kv context as dense answer targets (default 0 = off)")
    ap.add_argument("--tokens-per-step", type=int, default=None)
    ap.add_argument("--phases", default=None,
                    help="curriculum as name:steps:min_len:max_len[:task=w/task=w],... (replaces the default "
                         "phases; the optional fifth field is that phase's task mix)")
    ap.add_argument("--rope-theta", type=float, default=None,
                    help="RoPE base (default: conf/model/tiny.yaml's arch.rope_theta)")
    ap.add_argument("--arch", default=None,
                    help="key=int,... overrides of conf/model/tiny.yaml's arch (num_heads, num_kv_heads, "
                         "hidden_size, num_layers) for experiments; ship a model only with a matching YAML")
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--untied-embeddings", action="store_true",
                    help="separate input embedding and LM head (tied by default)")
    ap.add_argument("--task-weights", default=None, help="task:weight,... (replaces the default mix)")
    ap.add_argument("--eval-num-prompts", type=int, default=None)
    ap.add_argument("--eval-lengths", default=None, help="comma-separated prompt lengths of the final evaluation")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this saved model's weights (same architecture) instead of a fresh init: "
                         "continues a run across several GPU sessions; the phases given here are run anew, "
                         "the recall stages only if --recall is given")
    ap.add_argument("--recall", default=None,
                    help="recall stages 'field:value,...;...' (recall_stage.RecallStage fields, formats joined "
                         "by '+'), or 'none'; default: TrainConfig.recall (three stages)")
    ap.add_argument("--card-only", type=Path, default=None, metavar="DIR",
                    help="only write DIR/MODEL_CARD.md from DIR's training_config.json and eval.json")
    ap.add_argument("--recall-only", action="store_true",
                    help="save after the recall stages (no phases, no evaluation): the first half of a run "
                         "split across two GPU commands; the second is --init-from OUT")
    return ap


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's :class:`TrainConfig`: the defaults (or the smoke config) with the command line's
    overrides. ``--recall-only`` drops the phases and sets ``args.no_eval``."""
    cfg = smoke_config() if args.smoke else TrainConfig()
    cfg.seed = args.seed
    if args.workers is not None:
        cfg.workers = args.workers
    if args.log_every is not None:
        cfg.log_every = max(1, args.log_every)
    if args.lr is not None:
        cfg.lr = args.lr
    if args.lm_loss_weight is not None:
        cfg.lm_loss_weight = args.lm_loss_weight
    if args.context_lm_tasks is not None:
        chosen = {"all": list(TASKS), "none": []}.get(args.context_lm_tasks, args.context_lm_tasks.split(","))
        unknown = set(chosen) - set(TASKS)
        if unknown:
            raise SystemExit(f"error: --context-lm-tasks: unknown tasks {sorted(unknown)}; known: {list(TASKS)}")
        cfg.context_lm_tasks = tuple(chosen)
    if args.extra_queries:
        cfg.extra_queries = {k: int(v) for k, v in (x.split("=") for x in args.extra_queries.split(","))}
    if args.kv_recall_pairs is not None:
        cfg.kv_recall_pairs = args.kv_recall_pairs
    if args.tokens_per_step is not None:
        cfg.tokens_per_step = args.tokens_per_step
    if args.eval_num_prompts is not None:
        cfg.eval_num_prompts = args.eval_num_prompts
    if args.eval_lengths:
        cfg.eval_lengths = [int(x) for x in args.eval_lengths.split(",")]
    if args.phases:
        cfg.phases = [Phase.parse(x) for x in args.phases.split(",")]
    if args.task_weights:
        cfg.task_weights = {k: float(v) for k, v in (x.split(":") for x in args.task_weights.split(","))}
    for p in cfg.phases:
        p.steps = max(1, round(p.steps * args.steps_scale))
    if args.recall is not None:
        try:
            cfg.recall = [] if args.recall == "none" else [RecallStage.parse(x) for x in args.recall.split(";")]
        except ValueError as e:
            raise SystemExit(f"error: --recall: {e}")
    elif args.init_from is not None:
        cfg.recall = []  # the weights already went through them
    if args.recall_only:
        if not cfg.recall:
            raise SystemExit("error: --recall-only with no recall stages (--recall none or --init-from)")
        cfg.phases, args.no_eval = [], True
    if args.untied_embeddings:
        cfg.tie_word_embeddings = False
    if args.intermediate_size is not None:
        cfg.intermediate_size = args.intermediate_size
    return cfg


def arch_from_args(args: argparse.Namespace) -> dict:
    """``conf/model/tiny.yaml``'s architecture with ``--rope-theta`` and ``--arch`` applied."""
    arch = read_arch(ROOT / "conf" / "model" / "tiny.yaml")
    if args.rope_theta is not None:
        arch["rope_theta"] = args.rope_theta
    for item in filter(None, (args.arch or "").split(",")):
        key, value = item.split("=")
        if key not in ("num_heads", "num_kv_heads", "hidden_size", "num_layers"):
            raise SystemExit(f"error: --arch {key!r}: only num_heads, num_kv_heads, hidden_size, num_layers")
        arch[key] = int(value)
    return arch


def training_record(cfg: TrainConfig, arch: dict, model, tokenizer, args: argparse.Namespace, device,
                    recall: dict | None, result: dict, inherited: dict | None, lineage: list[dict]) -> dict:
    """``training_config.json``: the config, the model facts, the run's logs and the lineage so far."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    record = {"config": asdict(cfg), "arch": arch, "params": sum(p.numel() for p in model.parameters()),
              "vocab_size": len(tokenizer), "init_from": str(args.init_from) if args.init_from else None,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "device": device_name, "train_seconds": result["train_seconds"], "recall": recall,
              "recall_inherited": inherited, "log": result["log"]}
    record["lineage"] = lineage + [lineage_entry(record, str(args.out))]
    return record


def evaluate_saved(cfg: TrainConfig, out: Path, tokenizer, device, eval_jobs: list, eval_async, log
                   ) -> tuple[dict, dict, str]:
    """Greedy accuracy of the weights as saved (on the prompts the pool built) and the attention summary."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, attn_implementation="sdpa").to(device)
    chunks = eval_async.get()
    prompts = {(t, n): ps for (_, t, n, _, _), ps in zip(eval_jobs, chunks)}
    acc = evaluate(cfg, saved, tokenizer, prompts, device, log)
    return acc, attention_summary(out, cfg, device), str(dtype).replace("torch.", "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.card_only is not None:
        render_card(args.card_only)
        return 0
    t0 = time.time()
    cfg = config_from_args(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":  # leave cores to the data worker and the eval pool: spinning threads stall
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    def log(msg: str) -> None:
        print(f"[train_tiny {time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out  # the tokenizer files are written first; the weights join them at the end
    save_tiny_tokenizer(tok_dir)
    tokenizer = load_tokenizer(tok_dir)
    sentence_bank(), name_pool()  # built once, inherited by forked workers
    arch = arch_from_args(args)

    # Held-out evaluation prompts are built on the CPU while the GPU trains.
    pool = mp.get_context("fork").Pool(max(1, min(cfg.eval_pool, os.cpu_count() or 1)))
    eval_jobs = [(str(tok_dir), t, n, cfg.eval_num_prompts, cfg.eval_seed) for t in TASKS for n in cfg.eval_lengths]
    eval_async = None if args.no_eval else pool.map_async(build_eval_chunk, eval_jobs)

    model = build_model(cfg, arch, tokenizer)
    if args.init_from is not None:
        load_weights(model, args.init_from)
        log(f"initialized from {args.init_from}")
    model = model.to(device)
    log(f"device={device} params={sum(p.numel() for p in model.parameters()):,} vocab={len(tokenizer)} "
        f"recall steps={sum(r.steps for r in cfg.recall)} steps={cfg.total_steps} workers={cfg.workers}")
    parent = read_record(args.init_from)
    lineage = parent_lineage(args.init_from, parent)
    inherited = parent.get("recall") if parent else None  # the recall stages the starting weights went through

    def checkpoint(partial: dict) -> None:
        """--recall-only: weights and record after every stage, so a command stopped at its time limit
        (a GPU lease) keeps the stages it finished; --init-from reads both."""
        save_model(copy.deepcopy(model), tok_dir, out, cfg)  # a copy: training goes on in float32
        rec = {"config": asdict(cfg), "recall": partial, "init_from": str(args.init_from) if args.init_from else None,
               "train_seconds": round(time.time() - t0, 1), "device": str(device)}
        rec["lineage"] = lineage + [lineage_entry(rec, str(out))]
        (out / "training_config.json").write_text(json.dumps(rec, indent=2))
        log(f"saved the weights after recall stage {partial['completed_stages']} of {len(cfg.recall)} -> {out}")

    recall = run_recall(cfg, model, device, log, checkpoint if args.recall_only else None) if cfg.recall else None
    result = train(cfg, model, tokenizer, device, log) if cfg.phases else {"train_seconds": 0.0, "log": []}
    if recall:
        result["train_seconds"] = round(result["train_seconds"] + recall["seconds"], 1)
    save_model(model, tok_dir, out, cfg)
    record = training_record(cfg, arch, model, tokenizer, args, device, recall, result, inherited, lineage)
    (out / "training_config.json").write_text(json.dumps(record, indent=2) + "\n")
    info = card_info(record)

    if not args.no_eval:
        acc, attention, dtype = evaluate_saved(cfg, out, tokenizer, device, eval_jobs, eval_async, log)
        info["wall_seconds"] = round(time.time() - t0, 1)
        (out / "eval.json").write_text(json.dumps(
            {"accuracy": acc, "seed": cfg.eval_seed, "num_prompts": cfg.eval_num_prompts,
             "lengths": cfg.eval_lengths, "decoding": "greedy", "dtype": dtype,
             "device": info["device"], "attention": attention}, indent=2) + "\n")
        write_card(out, cfg, acc, info, attention, recall or inherited, record["lineage"])
        print(json.dumps({"out": str(out), "accuracy": acc, "wall_seconds": info["wall_seconds"]}))
    pool.close()
    log(f"done in {time.time() - t0:.1f}s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
