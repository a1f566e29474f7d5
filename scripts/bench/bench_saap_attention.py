"""Where SAAP's decode attention spends its time: each launch of the attention half alone.

    python scripts/bench/bench_saap_attention.py --batch 8 --length 8192     # Llama-3.1-8B shapes, l = 32

On fixed buckets (the classifier's choice for a random query, computed once): the window partials
alone, the bucket partials alone, the merge alone, the whole attention (partials in one launch +
merge), the window-only step (no buckets) and the whole decode step with its classifier and ranking
(``--classifiers``: one per query head or per KV head). Beside them SDPA over the window's keys alone
(the same bytes streamed by cuDNN) and over the whole cache. Each line is its own CUDA graph (so each
carries one launch gap), timed like ``bench_decode.py`` (events, warm-up, read-flushed L2, median).
``--variants`` also times the attention under the launch settings of :data:`VARIANTS`. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import Shapes, Timer, print_launch_times, _randn, saap_setup  # noqa: E402
from bench_saap_classifier import per_kv_head, with_config  # noqa: E402
from runtime_kernels.saap.bucket_index import searchable_range  # noqa: E402

# runtime_kernels.saap.triton is imported in main(), after the check for CUDA: without it (and perhaps without
# Triton) the script says it needs a GPU.

VARIANTS = {  # triton_config.CONFIG overrides compared by --variants
    "32 keys per step": dict(block_n=32),
    "128 keys per step": dict(block_n=128),
    "8 warps": dict(attn_warps=8),
    "3 stages": dict(attn_stages=3),
    "1 stage": dict(attn_stages=1),
    "window budget 128 programs": dict(win_programs=128),
    "window budget 512 programs": dict(win_programs=512),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="decode batch B (default 8)")
    ap.add_argument("--length", type=int, default=8192, help="cache length T (default 8192)")
    ap.add_argument("--top-l", type=int, default=32, help="buckets visited per KV head (default 32)")
    ap.add_argument("--classifiers", choices=("query", "kv"), default="kv",
                    help="the step's classifiers: one per KV head (default) or per query head")
    ap.add_argument("--variants", action="store_true", help="also time the whole attention under VARIANTS")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_saap_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from runtime_kernels.saap import triton as st

    b, t = args.batch, args.length
    sh = Shapes(batches=(b,), lengths=(t,))
    params, index, qd = saap_setup(sh, b, t, "cuda")
    if args.classifiers == "kv":
        params = per_kv_head(params, sh.hq // sh.hkv)
    q = _randn(b, sh.hq, sh.d, device="cuda", dtype=torch.bfloat16)
    k, v = (_randn(b, sh.hkv, t, sh.d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    group = sh.hq // sh.hkv
    sel = st.saap_select_buckets_triton(qd, params, group, args.top_l)
    lo, hi = searchable_range(t, params.sink, params.recent)
    scale = sh.d ** -0.5
    pl = st._plan(q, k, v, sel.shape[-1], lo, hi, scale, index.bucket_count.shape[-1])  # packed as the step
    pl_win = st._plan(q, k, v, 0, lo, hi, scale)
    n_dense = lo + (t - hi)
    kv_row = 2 * sh.d * k.element_size()  # one key's K and V row
    win_mb = b * sh.hkv * n_dense * kv_row / 1e6
    bkt_keys = index.bucket_count.gather(-1, sel.long()).sum().item()
    bkt_mb = bkt_keys * (kv_row + 4) / 1e6
    k_win = torch.cat([k[:, :, :lo], k[:, :, hi:]], 2).contiguous()
    v_win = torch.cat([v[:, :, :lo], v[:, :, hi:]], 2).contiguous()

    def sdpa(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True)

    cases = [
        (f"window partials ({pl.n_win}/head)", lambda: st._launch_partials(pl, index, sel, True, False), win_mb),
        (f"bucket partials ({pl.n_bkt_prog}/head)", lambda: st._launch_partials(pl, index, sel, False, True), bkt_mb),
        (f"merge ({pl.n_part} partials)", lambda: st._merge(pl), pl.o.numel() * 4 / 1e6),
        ("attention: partials + merge", lambda: st.saap_sparse_attention_triton(q, k, v, index, sel, lo, hi, scale),
         win_mb + bkt_mb),
        ("window only: partials + merge", lambda: (st._launch_partials(pl_win, None, None, True, False),
                                                   st._merge(pl_win)), win_mb),
        (f"sdpa over the window ({n_dense} keys)", lambda: sdpa(k_win, v_win), win_mb),
        (f"sdpa over the cache ({t} keys)", lambda: sdpa(k, v), b * sh.hkv * t * kv_row / 1e6),
    ]
    whole = lambda: st.saap_sparse_attention_triton(q, k, v, index, sel, lo, hi, scale)  # noqa: E731
    step = lambda: st.saap_decode_attention_triton(q, qd, k, v, index, params, top_l=args.top_l)  # noqa: E731
    cls_mb = (params.w1.numel() + params.w2.numel()) * params.w2.element_size() / 1e6
    cases += [(f"attention, {name}", with_config(whole, **cfg), win_mb + bkt_mb)
              for name, cfg in (VARIANTS.items() if args.variants else ())]
    cases.append(("decode step: select + attention", step, cls_mb + win_mb + bkt_mb))
    timer = Timer(True, 5, 30)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | B={b} T={t} l={args.top_l} "
          f"| {bkt_keys / (b * sh.hkv):.0f} bucket keys per KV head")
    print_launch_times(timer, cases, 36)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
