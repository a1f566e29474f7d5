"""Where SAAP's per-step bucket selection spends its time: each launch alone.

    python scripts/bench/bench_saap_classifier.py             # Llama-3.1-8B shapes, B = 1
    python scripts/bench/bench_saap_classifier.py --batch 8
    python scripts/bench/bench_saap_classifier.py --batch 8 --classifiers query   # one classifier per query head

The path these rows take (B rows per classifier; B·G with a classifier per KV head): for
``rows <= small_batch_max_b`` layer 1 writing three bf16 hidden terms, layer 2 as one pass over w2
summing the terms and adding b2, then the ranking. Beside them the whole selection, the large-batch path
at the same rows, the ranking without its candidate filter (what the rules save), with ``--variants`` the
row threshold at 16 and layer 2 with 32 rows per program (where the threshold and layer 2's tile
belong), and yardsticks for the w2 stream: a plain bf16 cuBLAS bmm (one term: not the
kernel's precision), a copy and a sum of w2. Each line is its own CUDA graph (so each carries one launch
gap), timed like ``bench_decode.py`` (events, warm-up, read-flushed L2, median). Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import Shapes, Timer, print_launch_times, saap_setup  # noqa: E402
from runtime_kernels.saap import SaapLayerParams, triton_config  # noqa: E402
from runtime_kernels.saap.triton_config import pow2  # noqa: E402

# The Triton kernel modules are imported where used, after main() has checked for CUDA: without it (and
# perhaps without Triton) the script says it needs a GPU.


def with_config(fn: Callable[[], object], **overrides: int) -> Callable[[], None]:
    """``fn`` run under ``triton_config.CONFIG`` with ``overrides`` (restored afterwards)."""
    def call() -> None:
        base = triton_config.CONFIG
        triton_config.CONFIG = replace(base, **overrides)
        try:
            fn()
        finally:
            triton_config.CONFIG = base
    return call


def per_kv_head(p: SaapLayerParams, group: int) -> SaapLayerParams:
    """One classifier per KV head: the first query head's of each group (the weights' shapes are what count)."""
    return replace(p, **{n: getattr(p, n)[::group].contiguous() for n in SaapLayerParams.TENSOR_FIELDS
                         if n != "centroids"})


# classifier settings compared by --variants: the small path for at most 16 rows (larger batches on the
# large path), layer 2 with 32 rows per program (w2 read once; all, or half the logit columns per program,
# or 8 warps), the large path with half the columns per program
VARIANTS = {
    "small <= 16 rows": dict(small_batch_max_b=16),
    "l2 32 rows x 128": dict(l2_rows=32),
    "l2 32 rows x 64": dict(l2_rows=32, l2_block_n=64),
    "l2 32 rows x 128, 8 warps": dict(l2_rows=32, l2_warps=8),
    "large, 64 columns": dict(small_batch_max_b=0, linear_block_n=64),
}


def print_candidates(logits: torch.Tensor, hkv: int, top_l: int) -> None:
    """How many keys pass the ranking's candidate threshold per (batch, KV head) on these inputs (the
    kernel's rule recomputed in float32), and how many rows take the compacted path."""
    from runtime_kernels.saap.triton_rank import THRESHOLD_CHUNKS

    b, hq, c = logits.shape
    k_pad = pow2(top_l)
    score = torch.softmax(logits, -1).view(b, hkv, hq // hkv, c).sum(2)
    maxima = score.view(b, hkv, THRESHOLD_CHUNKS * k_pad, -1).amax(-1)
    tau = maxima.topk(k_pad, -1).values[..., -1:]  # the k_pad-th largest chunk maximum
    n_cand = (score >= tau).sum(-1).flatten().float()
    limit = triton_config.CONFIG.rank_filter * k_pad
    print(f"rank candidates per (b, KV head): min {n_cand.min():.0f}, median {n_cand.median():.0f}, "
          f"max {n_cand.max():.0f}; compacted path (<= {limit}) in {int((n_cand <= limit).sum())} of {n_cand.numel()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="decode batch B (default 1)")
    ap.add_argument("--top-l", type=int, default=32, help="buckets selected per KV head (default 32)")
    ap.add_argument("--classifiers", choices=("query", "kv"), default="kv",
                    help="one classifier per KV head (default; its G queries as rows) or per query head")
    ap.add_argument("--variants", action="store_true", help="also time the whole select under VARIANTS")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_saap_classifier.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from runtime_kernels.saap import triton_classifier_small_batch as small
    from runtime_kernels.saap.triton_classifier import saap_select_buckets_triton
    from runtime_kernels.saap.triton_rank import saap_rank_buckets_triton

    bsz, top_l = args.batch, args.top_l
    sh = Shapes(batches=(bsz,), lengths=(8192,))
    p, _, qd = saap_setup(sh, bsz, 8192, "cuda")
    group = sh.hq // sh.hkv
    if args.classifiers == "kv":
        p = per_kv_head(p, group)
    rows = bsz * sh.hq // p.num_classifiers  # batch rows per classifier
    w1_mb, w2_mb = p.w1.numel() * p.w1.element_size() / 1e6, p.w2.numel() * p.w2.element_size() / 1e6
    hidden = small.layer1_terms(qd, p)  # [Hc, 3·R, Hd] bf16: layer 2's operand
    logits = small.layer2_logits(hidden, p, bsz)  # [B, Hq, C] float32, b2 included
    one_term = hidden[:, :rows].contiguous()  # the hidden rounded to one bf16 term
    w2_copy = torch.empty_like(p.w2)
    rank_mb = logits.numel() * 4 / 1e6
    select = lambda: saap_select_buckets_triton(qd, p, group, top_l)  # noqa: E731
    rank = lambda: saap_rank_buckets_triton(logits, group, top_l)  # noqa: E731
    cases = [
        (f"layer 1, 3 terms ({rows} rows)", lambda: small.layer1_terms(qd, p), w1_mb),
        ("layer 2, w2 stream + b2", lambda: small.layer2_logits(hidden, p, bsz), w2_mb),
        ("rank", rank, rank_mb),
        ("rank, every key sorted", with_config(rank, rank_filter=0), rank_mb),
        ("whole select", select, w1_mb + w2_mb),
        ("whole select, large-batch path", with_config(select, small_batch_max_b=0), w1_mb + w2_mb),
    ]
    cases += [(f"whole select, {name}", with_config(select, **cfg), w1_mb + w2_mb)
              for name, cfg in (VARIANTS.items() if args.variants else ())]
    cases += [
        ("cublas bmm, 1 bf16 term", lambda: torch.bmm(one_term, p.w2), w2_mb),
        ("copy of w2 (read+write)", lambda: w2_copy.copy_(p.w2), 2 * w2_mb),
        ("sum of w2 (read only)", lambda: p.w2.sum(dtype=torch.float32), w2_mb),
    ]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | B={bsz} l={top_l} "
          f"| {p.num_classifiers} classifiers, {rows} rows each | {triton_config.CONFIG}")
    print_candidates(logits, sh.hkv, top_l)
    print_launch_times(Timer(True, 5, 30), cases, 32)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
