"""Benchmark Q/K/V collection on a randomly initialized Llama-3.1-8B-shaped model (no weights needed).

    python scripts/bench/bench_collect.py                # GPU: 32 layers, one 32k-token prompt, bf16, default budgets
    python scripts/bench/bench_collect.py --smoke        # CPU smoke: 2 layers, 2k tokens, small vocab, float32

Prints a table: a plain prefill of the same prompt (no capture) for reference, then collection
(``calib.collect.collect`` with conf/collect/default.yaml): forward seconds, tokens/s, peak GPU memory
(``torch.cuda.max_memory_allocated``, weights included) and peak host RSS. The last line is JSON.
Random weights give the same arithmetic and memory traffic as real ones, so the figures hold for the
real model; nothing is downloaded. The collected set goes to a temporary directory and is deleted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from calib.collect import collect, run_layer_callbacks  # noqa: E402
from calib.models import LLAMA31_8B_ARCH, loaded_from_model, random_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU-sized run: 2 layers, 2048 tokens, vocab 4096")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; smoke 2)")
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 32768; smoke 2048)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 128256; smoke 4096)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.layers = args.layers or (2 if args.smoke else LLAMA31_8B_ARCH["num_layers"])
    args.tokens = args.tokens or (2048 if args.smoke else 32768)
    args.vocab = args.vocab or (4096 if args.smoke else LLAMA31_8B_ARCH["vocab_size"])
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def plain_prefill(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> tuple[float, int | None]:
    """Seconds and peak GPU bytes of the same forward pass without capture (decoder only, no LM head)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.base_model(input_ids=ids[None].to(device), use_cache=False)
    _sync(device)
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32, "float16": torch.float16}[args.dtype]
    arch = {**LLAMA31_8B_ARCH, "num_layers": args.layers, "vocab_size": args.vocab}
    t0 = time.perf_counter()
    model = random_model("llama", arch, seed=args.seed, dtype=dtype, device=device)
    build_s = time.perf_counter() - t0
    loaded = loaded_from_model(model, name="llama31-shaped-random", family="llama",
                               model_hash=f"random:seed{args.seed}:layers{args.layers}:vocab{args.vocab}")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    warm = ids[: min(1024, args.tokens)]
    run_layer_callbacks(loaded, [warm], lambda cap: None, progress=False)  # kernels, allocator, cuBLAS handles
    plain_s, plain_peak = plain_prefill(model, ids, device)

    budgets = yaml.safe_load((ROOT / "conf" / "collect" / "default.yaml").read_text())
    budgets["progress"] = False
    with tempfile.TemporaryDirectory(prefix="bench_collect_") as tmp:
        collected = collect(loaded, [ids], budgets, cache_root=tmp)
        stats = dict(collected.stats)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = [
        ("model", f"Llama-3.1-8B shape, random init, {args.layers} layers, vocab {args.vocab}, "
                  f"{str(dtype).replace('torch.', '')}"),
        ("device", f"{gpu}, torch {torch.__version__}"),
        ("prompt", f"{args.tokens} tokens (1 prompt)"),
        ("budgets", f"keys/head {budgets['keys_per_head']}, queries/head {budgets['queries_per_head']}, "
                    f"{budgets['sampling']}, store {','.join(budgets['store'])}"),
        ("plain prefill (no capture)", f"{plain_s:.3f} s, {args.tokens / plain_s:,.0f} tokens/s, "
                                       f"peak GPU {_gib(plain_peak)}"),
        ("collection forward", f"{stats['forward_s']:.3f} s, {stats['tokens_per_s']:,.0f} tokens/s, "
                               f"peak GPU {_gib(stats['peak_gpu_bytes'])}"),
        ("collection wall (incl. shard write)", f"{stats['wall_s']:.3f} s; shard {stats['bytes_on_disk'] / 2**20:.1f} MiB"),
        ("peak host RSS (process)", _gib(stats["peak_host_rss_bytes"])),
        ("model build (random init)", f"{build_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"| {'what'.ljust(width)} | value |\n| {'-' * width} | --- |")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")
    result = {"layers": args.layers, "tokens": args.tokens, "dtype": str(dtype), "device": gpu,
              "plain_prefill_s": plain_s, "plain_tokens_per_s": args.tokens / plain_s, "plain_peak_gpu_bytes": plain_peak,
              "collect_forward_s": stats["forward_s"], "collect_tokens_per_s": stats["tokens_per_s"],
              "collect_peak_gpu_bytes": stats["peak_gpu_bytes"], "collect_wall_s": stats["wall_s"],
              "peak_host_rss_bytes": stats["peak_host_rss_bytes"], "shard_bytes": stats["bytes_on_disk"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
