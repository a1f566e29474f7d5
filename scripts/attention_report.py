#!/usr/bin/env python
"""Per-head attention statistics of a model on needle-in-a-haystack prompts.

    python scripts/attention_report.py --model artifacts/models/tiny [--length 2048] [--prompts 2]

For every (layer, head), averaged over the prompts (eager attention, teacher-forced answer):

- ``entropy``: mean attention entropy in nats over query positions >= 64 (uniform over t keys = ln t);
- ``sink``: mean attention mass on token 0 (the BOS) over the same queries;
- ``local``: mean mass on the 64 most recent tokens (the query's own included);
- ``retrieval``: mean mass on the needle sentence's tokens from the positions that predict the answer
  (the prompt's last token and the answer tokens but the last); about needle/length if uniform.

A head is tagged ``sink`` (sink >= 0.5), ``local`` (local >= 0.5) or ``retrieval`` (retrieval >= 0.3).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from calib.data.prompt import PromptFormatter  # noqa: E402
from calib.data.synthetic import fit_to_length  # noqa: E402
from calib.data.vocab import seed_from  # noqa: E402

LOCAL_WINDOW = 64
MIN_QUERY = 64
THRESHOLDS = {"sink": 0.5, "local": 0.5, "retrieval": 0.3}


def needle_prompt(tokenizer, length: int, index: int) -> tuple[list[int], list[int], list[int]]:
    """(ids with the answer appended, needle token positions, answer-predicting query positions)."""
    fmt = PromptFormatter(tokenizer)
    fitted = fit_to_length("niah_single", seed_from("calib-attention-report", index), length, fmt)
    q = fitted.instance.queries[0]
    text = fitted.text + q.completion
    ids = fmt.encode(text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    shift = len(ids) - len(enc["input_ids"])  # the BOS the formatter adds
    start = text.index(q.evidence[0])
    end = start + len(q.evidence[0])
    needle = [k + shift for k, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    queries = list(range(len(fitted.input_ids) - 1, len(ids) - 1))
    return ids, needle, queries


@torch.no_grad()
def head_statistics(model_dir: str | Path, length: int = 2048, prompts: int = 2, device: str = "cpu") -> dict:
    """``{"entropy"|"sink"|"local"|"retrieval": [L][H] lists, "needle_tokens": int, "length": int}``."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").to(device).eval()
    sums: dict[str, torch.Tensor] = {}
    needle_sizes = []
    for i in range(prompts):
        ids, needle, queries = needle_prompt(tokenizer, length, i)
        needle_sizes.append(len(needle))
        out = model(input_ids=torch.tensor([ids], device=device), output_attentions=True)
        for name, value in _prompt_stats(out.attentions, needle, queries).items():
            sums[name] = sums.get(name, 0) + value / prompts
    stats = {k: v.tolist() for k, v in sums.items()}
    stats.update(needle_tokens=round(sum(needle_sizes) / prompts), length=length)
    return stats


def _prompt_stats(attentions, needle: list[int], queries: list[int]) -> dict[str, torch.Tensor]:
    """attentions: per layer [1, H, T, T]. Returns [L, H] tensors."""
    rows = {"entropy": [], "sink": [], "local": [], "retrieval": []}
    for att in attentions:
        a = att[0].float()                                   # [H, T, T]
        t = a.shape[-1]
        body = a[:, MIN_QUERY:, :]                           # [H, T-64, T]
        rows["entropy"].append(-(body * body.clamp_min(1e-12).log()).sum(-1).mean(-1))
        rows["sink"].append(body[..., 0].mean(-1))
        pos = torch.arange(t, device=a.device)
        qpos = pos[MIN_QUERY:, None]                         # [T-64, 1]
        window = (pos[None, :] <= qpos) & (pos[None, :] > qpos - LOCAL_WINDOW)
        rows["local"].append((body * window).sum(-1).mean(-1))
        rows["retrieval"].append(a[:, queries][:, :, needle].sum(-1).mean(-1))
    return {k: torch.stack(v).cpu() for k, v in rows.items()}


def tags(stats: dict, layer: int, head: int) -> str:
    return ",".join(k for k, th in THRESHOLDS.items() if stats[k][layer][head] >= th)


def format_table(stats: dict) -> str:
    lines = [f"{'layer':>5} {'head':>4} {'entropy':>8} {'sink':>6} {'local':>6} {'retrieval':>9}  tags"]
    for layer, row in enumerate(stats["entropy"]):
        for head in range(len(row)):
            lines.append(f"{layer:>5} {head:>4} {stats['entropy'][layer][head]:>8.3f} "
                         f"{stats['sink'][layer][head]:>6.3f} {stats['local'][layer][head]:>6.3f} "
                         f"{stats['retrieval'][layer][head]:>9.3f}  {tags(stats, layer, head)}")
    return "\n".join(lines)


def summarize(stats: dict) -> str:
    heads = [(layer, h) for layer, row in enumerate(stats["entropy"]) for h in range(len(row))]
    count = {k: sum(stats[k][l][h] >= th for l, h in heads) for k, th in THRESHOLDS.items()}
    uniform = stats["needle_tokens"] / stats["length"]
    return (f"{count['sink']} sink heads (>= 0.5 of the mass on token 0), {count['local']} local heads "
            f"(>= 0.5 on the last {LOCAL_WINDOW} tokens), {count['retrieval']} retrieval heads (>= 0.3 of the "
            f"answer positions' mass on the {stats['needle_tokens']}-token needle; {uniform:.4f} if uniform) "
            f"out of {len(heads)}; max entropy ln({stats['length']}) = {math.log(stats['length']):.2f}.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="model directory (safetensors + tokenizer)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the statistics here")
    args = ap.parse_args(argv)
    stats = head_statistics(args.model, args.length, args.prompts, args.device)
    print(format_table(stats))
    print(summarize(stats))
    if args.json:
        args.json.write_text(json.dumps(stats, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
