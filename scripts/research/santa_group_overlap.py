"""How many V rows a SANTA decode step needs per KV head: each query head's own sampled keys, or their union.

SANTA (Lee et al., arXiv:2605.01910, §3) scores every key exactly and averages the values of S sampled keys
per query head. The G query heads of a GQA group draw their own samples, so a kernel that loads each head's
sampled rows reads ``Σ_g |keys_g|`` rows of the KV head's V, and one that loads their union once reads
``|∪_g keys_g|``: between ``max_g |keys_g|`` (the heads agree) and the sum (they do not). This script measures
where a real model sits, on natural text: the model's own queries and keys at the first decode step after a
prompt, the reference draws (``runtime_kernels.santa.reference.decode_samples``) at the given budget.

    python scripts/research/santa_group_overlap.py --model smollm2 --length 8000 --prompts 3 --out overlap.json

Per layer: distinct sampled keys per head (mean), their sum and union per KV head, each as a share of the
cache; and ``union / sum``, the V bytes a union-loading kernel reads against per-head distinct loads. A kernel
that loads one row per sample reads ``G · S`` rows per KV head (``samples_share`` = S / T per head).
CPU is fine (one prefill per prompt); results: docs/results/serving.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # bench_serving's prompt windows

from omegaconf import OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402

import calib.config  # noqa: E402,F401  (registers the ${calib_root:} resolver the model files use)
from bench_serving import text_rows  # noqa: E402
from calib.models import load_model  # noqa: E402
from runtime_kernels import hf  # noqa: E402
from runtime_kernels.santa.reference import decode_samples  # noqa: E402


def group_overlap(counts: torch.Tensor, hkv: int) -> dict[str, float]:
    """``counts [B, Hq, T]`` samples per key -> shares of the ``T`` keys, averaged over rows and KV heads:
    ``per_head`` distinct keys one head drew, ``sum`` and ``union`` over a KV head's G heads."""
    b, hq, t = counts.shape
    drawn = (counts > 0).reshape(b, hkv, hq // hkv, t)  # [B, Hkv, G, T]
    per_head = drawn.sum(-1).double()  # [B, Hkv, G]
    total = per_head.sum(-1)  # [B, Hkv]
    union = drawn.any(2).sum(-1).double()  # [B, Hkv]
    return {"per_head": float(per_head.mean() / t), "sum": float(total.mean() / t),
            "union": float(union.mean() / t), "union_over_sum": float((union / total.clamp_min(1)).mean())}


class OverlapProbe:
    """A decode runtime that computes nothing (every layer answers dense) but records, per layer, the
    group overlap of the draws SANTA would make from this step's queries and keys."""

    phase = "decode"
    method = "santa-overlap-probe"

    def __init__(self, samples: int, tiling: str, tile: int, seed: int) -> None:
        self.samples, self.tiling, self.tile = samples, tiling, tile
        self.gen = torch.Generator().manual_seed(seed)
        self.rows: dict[int, list[dict[str, float]]] = {}

    def observe_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any) -> None:
        return None  # SANTA keeps no state from the prompt

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ctx: Any):
        b, hq, _, d = q.shape
        t = k.shape[2]
        tiles = -(-t // self.tile)
        draws = decode_samples(q[:, :, 0].float(), k.float(), torch.full((b,), self.samples), tiling=self.tiling,
                               tile=self.tile, scale=scale, cache_len=torch.full((b,), t),
                               tile_uniforms=torch.rand(b, hq, tiles, generator=self.gen, dtype=torch.float64))
        self.rows.setdefault(layer, []).append(group_overlap(draws.counts, k.shape[1]))
        return None


def summary(rows: dict[int, list[dict[str, float]]]) -> dict[str, Any]:
    """Per layer the mean of each share over prompts; over layers the mean of each."""
    layers = {str(layer): {key: statistics.mean(r[key] for r in rs) for key in rs[0]}
              for layer, rs in sorted(rows.items())}
    keys = next(iter(layers.values())).keys()
    return {"layers": layers, "mean": {key: statistics.mean(row[key] for row in layers.values()) for key in keys}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a conf/model name (default smollm2)")
    ap.add_argument("--length", type=int, default=8000, help="prompt tokens (default 8000)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts, each its own window of the novel")
    ap.add_argument("--samples", type=int, default=2048, help="SANTA's samples per query head (default 2048)")
    ap.add_argument("--tiling", choices=("prop", "flash"), default="flash", help="SANTA's tiling (default flash)")
    ap.add_argument("--tile", type=int, default=256, help="keys per tile (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the summary here (JSON)")
    args = ap.parse_args(argv)
    if args.length < 2 or args.samples < 1 or args.prompts < 1:
        ap.error("--length must be >= 2 and --samples, --prompts >= 1")
    loaded = load_model(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml"), device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    probe = OverlapProbe(args.samples, args.tiling, args.tile, args.seed)
    hf.attach(model, decode=probe)
    with torch.inference_mode():
        # windows of the shipped novel, text no calibration reads
        for ids in tqdm(text_rows(tok, args.prompts, args.length, args.seed).split(1), desc="prompts", unit="prompt"):
            out = model(input_ids=ids[:, :-1], use_cache=True)
            model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    hf.remove(model)
    result = {"model": args.model, "length": args.length, "prompts": args.prompts, "samples": args.samples,
              "tiling": args.tiling, "tile": args.tile, "samples_share": min(1.0, args.samples / args.length),
              **summary(probe.rows)}
    print(json.dumps(result["mean"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
