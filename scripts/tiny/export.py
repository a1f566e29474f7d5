"""Writing the model directory: weights and tokenizer, the training record's lineage, the model card."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path

import torch
from transformers import GenerationConfig

from calib.data import TASKS
from recall_stage import RecallStage

from .config import Phase, TrainConfig


def lineage_entry(record: dict, out: str) -> dict:
    """One step of a model's history, read from the ``training_config.json`` that step wrote (a full run's
    or a ``--recall-only`` checkpoint's)."""
    cfg, recall = record.get("config", {}), record.get("recall") or {}
    keys = ("formats", "steps", "steps_run", "batch", "min_pairs", "max_pairs", "lr", "until", "until_pairs",
            "reached")
    return {"out": out, "init_from": record.get("init_from"),
            "recall": [{k: st.get(k) for k in keys if k in st} for st in recall.get("stages", [])],
            "recall_eval": recall.get("eval"), "phases": cfg.get("phases", []), "lr": cfg.get("lr"),
            "tokens_per_step": cfg.get("tokens_per_step"), "train_seconds": record.get("train_seconds"),
            "device": record.get("device")}


def read_record(model_dir: Path | None) -> dict | None:
    """``model_dir``'s ``training_config.json``, or None (no directory, or weights without a record)."""
    path = None if model_dir is None else model_dir / "training_config.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def parent_lineage(init_from: Path | None, parent: dict | None) -> list[dict]:
    """The lineage of the ``--init-from`` weights (``parent``: their record): theirs if they carry one,
    else the one step their record describes, else a step that says nothing was recorded."""
    if init_from is None:
        return []
    if parent is None:
        return [{"out": str(init_from), "note": "no training_config.json beside these weights"}]
    return parent.get("lineage") or [lineage_entry(parent, str(init_from))]


def _lineage_lines(lineage: list[dict]) -> str:
    lines = []
    for i, e in enumerate(lineage, 1):
        parts = []
        if e.get("note"):
            parts.append(e["note"])
        if e.get("recall"):
            parts.append("recall stages " + ", ".join(
                f"{'+'.join(st['formats'])} {st.get('steps_run', st['steps'])} steps x {st['batch']} "
                f"({st['min_pairs']}-{st['max_pairs']} pairs, lr {st['lr']}"
                + (f", until {st['until']}" + ("" if st.get("reached") else " NOT reached") if st.get("until") else "")
                + ")" for st in e["recall"]))
        if e.get("phases"):
            parts.append(f"task phases at peak lr {e['lr']}: " + ", ".join(
                f"{p['name']} {p['steps']} steps x {e['tokens_per_step']} tokens ({p['min_len']}-{p['max_len']})"
                for p in e["phases"]))
        if e.get("train_seconds") is not None:
            parts.append(f"{e['train_seconds']} s on {e['device']}")
        start = f" from `{e['init_from']}`" if e.get("init_from") else ""
        lines.append(f"{i}. `{e['out']}`{start}: " + "; ".join(parts))
    return "\n".join(lines)


def write_card(out: Path, cfg: TrainConfig, acc: dict, info: dict, attention: dict | None,
               recall: dict | None = None, lineage: list[dict] | None = None) -> None:
    lengths = cfg.eval_lengths
    rows = ["| task | " + " | ".join(str(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths)]
    for task in TASKS:
        rows.append(f"| {task} | " + " | ".join(f"{acc[f'{task}@{n}']:.2f}" for n in lengths) + " |")
    att = ""
    if attention:
        att = ("\n## Attention structure\n\n"
               f"`scripts/attention_report.py` on {attention['prompts']} niah_single prompts of "
               f"{attention['length']} tokens: {attention['summary']}\n\n```\n{attention['table']}\n```\n")
    wall = f" ({info['wall_seconds']} s for the whole script)" if info.get("wall_seconds") else ""
    origin = (f"in {len(lineage)} steps (Lineage below; this paragraph describes the last)"
              if len(lineage or []) > 1 else _origin(info))
    lineage_text = ""
    if len(lineage or []) > 1:
        lineage_text = ("\n## Lineage\n\nEach step started from the weights the step before saved "
                        "(`training_config.json` keeps them all under `lineage`):\n\n"
                        f"{_lineage_lines(lineage)}\n")
    text = f"""# tiny — the embedded model of calib

A {info['layers']}-layer `LlamaForCausalLM` ({info['params']:,} parameters, {info['heads']} query heads /
{info['kv_heads']} KV heads of dim {info['head_dim']}, hidden {info['hidden']}, RoPE θ={info['rope_theta']},
tied embeddings, vocabulary {info['vocab']}) trained {origin} by `scripts/train_tiny.py` (seed {cfg.seed})
on the synthetic tasks of `calib.data` at prompt lengths up to {max(p.max_len for p in cfg.phases)} tokens.
Weights: `model.safetensors` ({cfg.save_dtype}). Tokenizer: word-level WordPiece over the tasks' closed
vocabulary (`calib/data/tokenizer.py`), no chat template. Every hyper-parameter: `training_config.json`.

Training: {_recall_sentence(cfg, recall)}{cfg.total_steps} steps of {cfg.tokens_per_step} tokens on the tasks,
{info['train_seconds']} s on {info['device']}{wall}.
{lineage_text}
## Dense exact-match accuracy

Greedy decoding (at most {cfg.eval_max_new_tokens} new tokens, stop at EOS), `calib.data.exact_match`,
{cfg.eval_num_prompts} held-out prompts per task and length (`build_prompts` seed {cfg.eval_seed}; training
prompts come from a separate seed namespace), weights as saved ({cfg.save_dtype}), evaluated on
{info['device']}. Every task and length is listed, whatever the score.

{chr(10).join(rows)}

Numbers also in `eval.json`.
{att}"""
    (out / "MODEL_CARD.md").write_text(text)


def render_card(model_dir: Path) -> None:
    """``--card-only``: MODEL_CARD.md again from the directory's ``training_config.json`` and ``eval.json``
    (after editing a record's lineage by hand, or to pick up a newer card layout)."""
    record = read_record(model_dir)
    if record is None:
        raise SystemExit(f"error: --card-only {model_dir}: no training_config.json there")
    ev = json.loads((model_dir / "eval.json").read_text())
    c = {k: v for k, v in record["config"].items() if k in {f.name for f in fields(TrainConfig)}}
    c["phases"] = [Phase(**p) for p in c.get("phases", [])]
    known = {f.name for f in fields(RecallStage)}
    c["recall"] = [RecallStage(**{**{k: v for k, v in r.items() if k in known}, "formats": tuple(r["formats"])})
                   for r in c.get("recall", [])]
    write_card(model_dir, TrainConfig(**c), ev["accuracy"], card_info(record), ev.get("attention"),
               record.get("recall") or record.get("recall_inherited"), record.get("lineage"))


def card_info(record: dict) -> dict:
    """What the card states about the model and the run, from its ``training_config.json`` record."""
    arch = record["arch"]
    return {"layers": arch["num_layers"], "heads": arch["num_heads"], "kv_heads": arch["num_kv_heads"],
            "head_dim": arch["head_dim"], "hidden": arch["hidden_size"], "rope_theta": arch["rope_theta"],
            "vocab": record["vocab_size"], "params": record["params"], "train_seconds": record["train_seconds"],
            "device": record["device"], "init_from": record.get("init_from")}


def _origin(info: dict) -> str:
    init = info.get("init_from")
    return f"starting from the weights in `{init}`" if init else "from scratch"


def _recall_sentence(cfg: TrainConfig, recall: dict | None) -> str:
    if not recall:
        return ""
    def steps(st: dict) -> str:
        if not st.get("until"):
            return f"{st['steps']} steps"
        return (f"{st.get('steps_run', st['steps'])} steps (until {st['until']} held-out at "
                f"{st['until_pairs'] or st['max_pairs']} pairs{'' if st.get('reached') else ', NOT reached'})")

    stages = ", then ".join(f"{steps(st)} of {st['batch']} sequences in {'+'.join(st['formats'])} form "
                            f"({st['min_pairs']}-{st['max_pairs']} pairs)" for st in recall["stages"])
    held = "; ".join(f"{fmt}: " + ", ".join(f"{a:.2f} at {n}" for n, a in by_n.items())
                     for fmt, by_n in recall["eval"].items())
    return (f"recall stages (`scripts/recall_stage.py`) {stages} - held-out recall accuracy by pairs {held}; "
            "then ")


def save_model(model, tokenizer_dir: Path, out: Path, cfg: TrainConfig):
    model = model.to(getattr(torch, cfg.save_dtype))
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id, do_sample=False, max_new_tokens=cfg.eval_max_new_tokens)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).resolve() != (out / name).resolve():
            shutil.copy(tokenizer_dir / name, out / name)
    return model
