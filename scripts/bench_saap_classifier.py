"""Where SAAP's per-step bucket ranking spends its time: each launch of the small-batch GEMV path alone.

    python scripts/bench_saap_classifier.py          # H200: Llama-3.1-8B shapes, B = 1

Layer 1 (query -> hidden, batch-norm, ReLU), layer 2 (hidden -> split-K partial logits), the ranking
(partials + b2 -> group softmax sum -> top-ℓ), and for scale cuBLAS ``bmm`` on the same layer-2
weights (bf16 hidden: not the kernel's precision) and a copy of them. Each line is its own CUDA graph
(so each carries one launch gap), timed like ``bench_decode.py`` (events, warm-up, read-flushed L2,
median). Needs CUDA.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import Shapes, Timer, saap_setup  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("error: bench_saap_classifier.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from runtime_kernels.saap import triton_classifier as tc
    from runtime_kernels.saap import triton_config

    cfg = triton_config.CONFIG
    sh = Shapes(batches=(1,), lengths=(8192,))
    p, _, qd = saap_setup(sh, 1, 8192, "cuda")
    hq, d = qd.shape[1], qd.shape[2]
    hd, c = p.w2.shape[1], p.w2.shape[2]
    group, top_l = sh.hq // sh.hkv, 32
    hidden = torch.randn(1, hq, hd, device="cuda")
    part, _ = tc._gemv_partials(qd, p)
    k_chunk = hd // part.shape[0]

    def layer1() -> None:
        tc._gemv_kernel[(hq, triton_cdiv(hd, cfg.gemv1_block_n), 1)](
            qd, p.w1, p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias, hidden, part, p.b2,
            1, hq, d, hd, d, float(p.bn_eps), c, *qd.stride(), *p.w1.stride(),
            FIRST=True, R=1, BLOCK_K=min(cfg.gemv_block_k, d), BLOCK_N=cfg.gemv1_block_n, ATOMIC=False,
            num_warps=cfg.gemv_warps)

    def layer2() -> None:
        tc._gemv_kernel[(hq, triton_cdiv(c, cfg.gemv_block_n), part.shape[0])](
            hidden, p.w2, hidden, hidden, hidden, hidden, hidden, part, part, p.b2,
            1, hq, hd, c, k_chunk, 0.0, c, *hidden.stride(), *p.w2.stride(),
            FIRST=False, R=1, BLOCK_K=cfg.gemv_block_k, BLOCK_N=cfg.gemv_block_n, ATOMIC=False,
            num_warps=cfg.gemv_warps)

    hb = hidden.to(p.w2.dtype).view(hq, 1, hd)
    h3 = hidden.to(p.w2.dtype).view(hq, 1, hd).expand(hq, 3, hd).contiguous()  # three-term operand shape
    bmm_parts = tc._bmm_partials(qd, p) if tc._bmm_supported(qd.device, p.w2.dtype) else None
    w2_copy = torch.empty_like(p.w2)
    w1_mb, w2_mb = p.w1.numel() * p.w1.element_size() / 1e6, p.w2.numel() * p.w2.element_size() / 1e6
    cases = [
        ("layer1 gemv", layer1, w1_mb),
        (f"layer2 gemv ({part.shape[0]} chunks)", layer2, w2_mb),
        (f"rank ({part.shape[0]} partials)", lambda: tc._rank(part, group, top_l, bias=p.b2), part.numel() * 4 / 1e6),
        ("torch.bmm layer 2 (cuBLAS)", lambda: torch.bmm(hb, p.w2), w2_mb),
        ("copy of w2 (read+write)", lambda: w2_copy.copy_(p.w2), 2 * w2_mb),
    ]
    if bmm_parts is not None:  # the cls_bmm_max_b path: layer 1 + three-term bmm + ranking of 3 terms
        cases += [
            ("bmm 3 terms, fp32 out", lambda: torch.bmm(h3, p.w2, out_dtype=torch.float32), w2_mb),
            ("bmm path: layer1 + bmm", lambda: tc._bmm_partials(qd, p), w1_mb + w2_mb),
            ("rank (3 bmm terms)", lambda: tc._rank(bmm_parts, group, top_l, bias=p.b2), bmm_parts.numel() * 4 / 1e6),
        ]
    cases += [
        ("whole select", lambda: tc.saap_select_buckets_triton(qd, p, group, top_l), w1_mb + w2_mb),
    ]
    if bmm_parts is not None:
        bmm_cfg = replace(cfg, cls_bmm_max_b=16)

        def bmm_select() -> None:
            triton_config.CONFIG = bmm_cfg
            try:
                tc.saap_select_buckets_triton(qd, p, group, top_l)
            finally:
                triton_config.CONFIG = cfg

        cases.append(("whole select, bmm path", bmm_select, w1_mb + w2_mb))
    timer = Timer(True, 5, 30)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {cfg}")
    for name, fn, mb in cases:
        us, note = timer.graphed(fn)
        if us is None:
            us = timer.eager(fn)
        print(f"{name:<28} {us:7.1f} us  {mb:6.1f} MB  {mb / us:5.2f} TB/s {note}", flush=True)
    return 0


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    raise SystemExit(main())
