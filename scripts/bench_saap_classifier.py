"""Where SAAP's per-step bucket ranking spends its time: each launch alone.

    python scripts/bench_saap_classifier.py             # H200: Llama-3.1-8B shapes, B = 1
    python scripts/bench_saap_classifier.py --batch 8

The default path (B <= ``cls_bmm_max_b``): layer 1 writing three bf16 hidden terms, layer 2 as Triton's
w2 stream summing the terms and adding b2 (``l2_triton``, ``l2_bias``), the ranking (filtered candidates
sorted); beside it
the cuBLAS layer 2 (``bmm`` with float32 output, also over w2 stored transposed ``[Hq, C, Hd]``, and a
plain bf16 bmm: one term, not the kernel's precision), the ranking's other schedules, and a copy and a
sum of w2 (what the GPU streams). At B = 1 also the GEMV path's
launches (layer 2 split-K on CUDA cores). Each line is its own CUDA graph (so each carries one launch
gap), timed like ``bench_decode.py`` (events, warm-up, read-flushed L2, median). Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import Shapes, Timer, print_launch_times, saap_setup  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="decode batch B (default 1)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_saap_classifier.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from runtime_kernels.saap import triton_classifier as tc
    from runtime_kernels.saap import triton_config

    cfg = triton_config.CONFIG
    bsz = args.batch
    sh = Shapes(batches=(bsz,), lengths=(8192,))
    p, _, qd = saap_setup(sh, bsz, 8192, "cuda")
    hq, d = qd.shape[1], qd.shape[2]
    hd, c = p.w2.shape[1], p.w2.shape[2]
    group, top_l = sh.hq // sh.hkv, 32
    w1_mb, w2_mb = p.w1.numel() * p.w1.element_size() / 1e6, p.w2.numel() * p.w2.element_size() / 1e6
    cublas = replace(cfg, l2_triton=0)  # layer 2 as one cuBLAS bmm (the default before 2026-11-21 20:00)
    hid3 = tc._layer1_terms(qd, p)  # [Hq, 3·B, Hd] bf16: layer 2's operand
    triton_config.CONFIG = cublas
    parts3 = tc._bmm_partials(qd, p).parts  # [3, B, Hq, C]: the cuBLAS path's per-term partials
    triton_config.CONFIG = replace(cfg, l2_bias=0)
    parts1 = tc._bmm_partials(qd, p).parts  # Triton layer 2's summed terms, b2 left to the ranking
    triton_config.CONFIG = replace(cfg, l2_bias=1)
    with_b2 = tc._bmm_partials(qd, p).parts  # b2 added by layer 2 (the default)
    triton_config.CONFIG = cfg
    w2t = p.w2.transpose(1, 2).contiguous()  # [Hq, C, Hd]: the transposed storage
    hid_t = hid3.transpose(1, 2)  # [Hq, Hd, 3·B] view
    hb = hid3[:, :bsz].contiguous()  # one bf16 term per row
    w2_copy = torch.empty_like(p.w2)

    def with_cfg(fn, other):  # noqa: ANN001, ANN202 - fn run under another CONFIG
        def call() -> None:
            triton_config.CONFIG = other
            try:
                fn()
            finally:
                triton_config.CONFIG = cfg
        return call

    def rank(parts: torch.Tensor, **over: int):  # noqa: ANN202
        return with_cfg(lambda: tc._rank(parts, group, top_l, bias=p.b2), replace(cfg, **over))

    select = lambda: tc.saap_select_buckets_triton(qd, p, group, top_l)  # noqa: E731
    r_mb = parts1.numel() * 4 / 1e6
    cases = [
        (f"layer1, 3 terms (B={bsz})", lambda: tc._layer1_terms(qd, p), w1_mb),
        ("cublas bmm 3 terms, fp32 out", lambda: tc._bmm_f32(hid3, p.w2), w2_mb),
        ("cublas bmm w2 transposed, fp32 out", lambda: torch.bmm(w2t, hid_t, out_dtype=torch.float32), w2_mb),
        ("cublas bmm 1 term, bf16 out", lambda: torch.bmm(hb, p.w2), w2_mb),
        ("triton layer2 (terms summed)", lambda: tc._layer2_triton(hid3, p.w2, bsz), w2_mb),
        ("triton layer2 + b2", lambda: tc._layer2_triton(hid3, p.w2, bsz, p.b2), w2_mb),
        ("layer1 + cublas bmm", with_cfg(lambda: tc._bmm_partials(qd, p), cublas), w1_mb + w2_mb),
        ("layer1 + triton layer2", with_cfg(lambda: tc._bmm_partials(qd, p), replace(cfg, l2_triton=1)),
         w1_mb + w2_mb),
        ("rank of logits without b2", rank(parts1), r_mb),
        ("rank, b2 in the logits", with_cfg(lambda: tc._rank(with_b2, group, top_l), cfg), r_mb),
        *[(f"rank, profile: {what}", with_cfg(lambda st=st: tc._rank(with_b2, group, top_l, stop=st), cfg),
           r_mb) for st, what in ((-1, "launch only"), (1, "logits loaded"), (2, "+ group scores"),
                                  (3, "+ threshold, count"), (4, "+ compaction"))],
        *[(f"layer1 + layer2 + rank profile: {what}",
           lambda st=st: tc._rank(tc._bmm_partials(qd, p).parts, group, top_l, stop=st), w1_mb + w2_mb)
          for st, what in ((-1, "launch only"), (1, "logits loaded"), (2, "+ group scores"),
                           (3, "+ threshold, count"), (4, "+ compaction"), (0, "whole"))],
        *[(f"rank, {w} warps", rank(parts1, rank_warps=w), r_mb) for w in (2, 4, 16)],
        ("rank, sorted candidates (K_PAD chunks)", rank(parts1, rank_count=0, rank_chunks=1), r_mb),
        ("rank, counted candidates", rank(parts1, rank_count=1), r_mb),
        ("rank, counted, 4 K_PAD chunk maxima", rank(parts1, rank_count=1, rank_chunks=4), r_mb),
        ("rank, full bitonic sort (no filter)", rank(parts1, rank_filter=0), r_mb),
        ("rank of 3 cublas terms", rank(parts3), parts3.numel() * 4 / 1e6),
        ("whole select (default)", select, w1_mb + w2_mb),
        ("whole select, b2 by the ranking", with_cfg(select, replace(cfg, l2_bias=0)), w1_mb + w2_mb),
        ("whole select, counted candidates", with_cfg(select, replace(cfg, rank_count=1)), w1_mb + w2_mb),
        ("whole select, no candidate filter", with_cfg(select, replace(cfg, rank_filter=0)), w1_mb + w2_mb),
        ("whole select, layer 1 in one k step", with_cfg(select, replace(cfg, l1_dot_block_k=128)), w1_mb + w2_mb),
        ("whole select, cublas layer2 + sorted rank", with_cfg(select, replace(cublas, rank_count=0, rank_chunks=1)),
         w1_mb + w2_mb),
        ("copy of w2 (read+write)", lambda: w2_copy.copy_(p.w2), 2 * w2_mb),
        ("sum of w2 (read only)", lambda: p.w2.sum(dtype=torch.float32), w2_mb),
    ]
    if bsz <= 2:  # the GEMV path's launches (cls_gemv_max_b): layer 2 split-K on CUDA cores
        hidden = torch.randn(bsz, hq, hd, device="cuda")
        part, _ = tc._gemv_partials(qd, p)
        k_chunk = hd // part.shape[0]

        def layer1() -> None:
            tc._gemv_kernel[(hq, triton_cdiv(hd, cfg.gemv1_block_n), 1)](
                qd, p.w1, p.b1, p.bn_mean, p.bn_var, p.bn_weight, p.bn_bias, hidden, part, p.b2,
                bsz, hq, d, hd, d, float(p.bn_eps), c, *qd.stride(), *p.w1.stride(),
                FIRST=True, R=tc._pow2(bsz), BLOCK_K=min(cfg.gemv_block_k, d), BLOCK_N=cfg.gemv1_block_n,
                ATOMIC=False, num_warps=cfg.gemv_warps)

        def layer2() -> None:
            tc._gemv_kernel[(hq, triton_cdiv(c, cfg.gemv_block_n), part.shape[0])](
                hidden, p.w2, hidden, hidden, hidden, hidden, hidden, part, part, p.b2,
                bsz, hq, hd, c, k_chunk, 0.0, c, *hidden.stride(), *p.w2.stride(),
                FIRST=False, R=tc._pow2(bsz), BLOCK_K=cfg.gemv_block_k, BLOCK_N=cfg.gemv_block_n, ATOMIC=False,
                num_warps=cfg.gemv_warps)

        gemv_select = with_cfg(lambda: tc.saap_select_buckets_triton(qd, p, group, top_l),
                               replace(cfg, cls_bmm_max_b=0, cls_gemv_max_b=16))
        cases += [
            ("gemv path: layer1 (fp32)", layer1, w1_mb),
            (f"gemv path: layer2 ({part.shape[0]} chunks)", layer2, w2_mb),
            (f"gemv path: rank ({part.shape[0]} partials)", lambda: tc._rank(part, group, top_l, bias=p.b2),
             part.numel() * 4 / 1e6),
            ("gemv path: whole select", gemv_select, w1_mb + w2_mb),
        ]
    timer = Timer(True, 5, 30)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {cfg}")
    # the ranking's candidate filter on these inputs (the kernel's rule, recomputed in float32)
    k_pad = tc._pow2(top_l)
    score = torch.softmax(parts3.sum(0) + p.b2.float(), -1).view(bsz, sh.hkv, group, c).sum(2)
    for chunks in (1, 2, 4):  # tau: the k_pad-th largest of chunks * k_pad chunk maxima
        maxima = score.view(bsz, sh.hkv, chunks * k_pad, -1).amax(-1)
        tau = maxima.topk(k_pad, -1).values[..., -1:]
        n_cand = (score >= tau).sum(-1).flatten().float()
        print(f"rank candidates >= tau ({chunks} x {k_pad} chunks) per (b, KV head): min {n_cand.min():.0f}, "
              f"median {n_cand.median():.0f}, max {n_cand.max():.0f}; compacted path (<= "
              f"{cfg.rank_filter * k_pad}) in {int((n_cand <= cfg.rank_filter * k_pad).sum())} of {n_cand.numel()}")
    print_launch_times(timer, cases, 32)
    return 0


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    raise SystemExit(main())
