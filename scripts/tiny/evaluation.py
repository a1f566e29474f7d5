"""Evaluation of the saved weights: exact greedy decoding without a KV cache (right padding is harmless
under causal attention: a sequence's own positions never see the padding after it)."""

from __future__ import annotations

from pathlib import Path

import attention_report
import torch

from calib.data import build_prompts, exact_match
from calib.data.tokenizer import load_tokenizer

from .config import TrainConfig


@torch.no_grad()
def greedy_decode(model, prompts: list[list[int]], eos: int, pad: int, max_new: int, device) -> list[list[int]]:
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new):
        if not live:
            break
        width = max(len(seqs[i]) for i in live)
        ids = torch.full((len(live), width), pad, dtype=torch.long)
        for r, i in enumerate(live):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        last = torch.tensor([len(seqs[i]) - 1 for i in live], device=device)
        hidden = model.model(input_ids=ids.to(device)).last_hidden_state   # [B, T, H]
        picked = hidden[torch.arange(len(live), device=device), last]      # [B, H]
        nxt = model.lm_head(picked).argmax(-1).tolist()
        still = []
        for i, t in zip(live, nxt):
            if t == eos:
                continue
            out[i].append(t)
            seqs[i].append(t)
            still.append(i)
        live = still
    return out


def build_eval_chunk(args: tuple) -> list:
    """Held-out prompts of one (task, length): run in a process pool while the GPU trains."""
    tok_dir, task, length, n, seed = args
    tok = load_tokenizer(tok_dir)
    cfg = {"source": "synthetic", "tasks": [task], "lengths": [length], "num_prompts": n, "seed": seed}
    return build_prompts(cfg, tok)


def evaluate(cfg: TrainConfig, model, tokenizer, prompts_by_key: dict, device, log) -> dict:
    model.eval()
    results = {}
    for (task, length), prompts in prompts_by_key.items():
        per_batch = max(1, cfg.eval_tokens_per_batch // length)
        hits = 0
        for s in range(0, len(prompts), per_batch):
            chunk = prompts[s: s + per_batch]
            gen = greedy_decode(model, [p.input_ids for p in chunk], tokenizer.eos_token_id,
                                tokenizer.pad_token_id, cfg.eval_max_new_tokens, device)
            for p, g in zip(chunk, gen):
                hits += exact_match(tokenizer.decode(g, skip_special_tokens=True), p.answer)
        results[f"{task}@{length}"] = round(hits / len(prompts), 4)
        log(f"eval {task}@{length}: {results[f'{task}@{length}']:.3f} ({len(prompts)} prompts)")
    return results


def attention_summary(model_dir: Path, cfg: TrainConfig, device) -> dict:
    stats = attention_report.head_statistics(model_dir, length=cfg.attention_report_length, prompts=2,
                                             device=str(device))
    return {"length": cfg.attention_report_length, "prompts": 2, "summary": attention_report.summarize(stats),
            "table": attention_report.format_table(stats)}
