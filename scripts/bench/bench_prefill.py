"""Benchmark block-sparse prefill attention, SALE and SampleAttention end to end, against causal SDPA.

    python scripts/bench/bench_prefill.py                      # GPU: Llama-3.1-8B shapes, T = 16k 32k 64k 128k
    python scripts/bench/bench_prefill.py --lengths 131072     # one length
    python scripts/bench/bench_prefill.py --smoke              # CPU, tiny shapes, Triton interpreter: checks the script
    python scripts/bench/bench_prefill.py --lengths 131072 --parts sale --sale-launch 128,32,8,3   # SALE launch shapes

One layer's prefill (B = 1, Hq = 32, Hkv = 8, D = 128, bf16); every time is a median device time
(``benchutil.py``; the repeat count adapts to ``--budget-ms`` per row). Rows: ``sdpa`` (causal SDPA, its
default backend with ``enable_gqa`` and on expanded K/V, the faster being every speedup's baseline; the flash
and cuDNN backends forced, informational); ``blocksparse`` (the public kernel on random masks at 5-100 % of
the causal blocks, :func:`random_block_mask`; at 100 % checked against SDPA's output); ``sale`` /
``sampleattention`` (selection alone, attention alone on the selected mask, and end to end, on
:func:`structured_inputs`, whose passage count is set per method so that its default knobs keep about 10 %
of the causal blocks at 128k).

TFLOP/s count ``4 * D * pairs`` with ``pairs`` = the causal (query, key) pairs in kept blocks (all causal
pairs for SDPA); ``x sdpa`` = SDPA baseline time / row time. Progress lines go to stderr, the markdown table
and the target check (MET / MISSED by how much) to stdout, last; ``--json PATH`` writes every row.
``CALIB_BLOCKSPARSE_AUTOTUNE=1`` autotunes the block-sparse kernel's launch config
(``TRITON_PRINT_AUTOTUNING=1`` prints the winner). Results: docs/results/kernels.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "bench"):  # run from a checkout without `pip install -e .`
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchutil import cuda_time, print_targets  # noqa: E402
from runtime_kernels.blocksparse import api  # noqa: E402
from runtime_kernels.blocksparse.mask import BlockMask, causal_block_mask  # noqa: E402
from runtime_kernels.sale import SaleSelectionConfig, sale_prefill_attention, sale_select  # noqa: E402
from runtime_kernels.sampleattention import (  # noqa: E402
    BucketRow,
    BucketTable,
    sampleattention_prefill_attention,
    sampleattention_prefill_mask,
)

# Triton and runtime_kernels.blocksparse.triton are imported where used: bench_generate imports this module's
# mask helper where Triton may be absent, and --smoke sets TRITON_INTERPRET=1 (run()) before a kernel is defined.


@dataclass(frozen=True)
class Shapes:
    """What one run measures."""

    lengths: tuple[int, ...] = (16384, 32768, 65536, 131072)
    hq: int = 32
    hkv: int = 8
    d: int = 128
    densities: tuple[float, ...] = (0.05, 0.10, 0.20, 0.50, 1.00)
    blocks: tuple[tuple[int, int], ...] = ((64, 64), (64, 32))


SMOKE = Shapes(lengths=(320,), hq=4, hkv=1, d=64, densities=(0.1, 1.0))


@dataclass
class Row:
    length: int
    case: str  # sdpa | blocksparse | sale | sampleattention
    part: str  # e.g. "default gqa", "p=10%", "select", "attend", "e2e"
    blocks: str
    density: float | None
    ms: float
    tflops: float | None
    sdpa_ms: float | None = None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        return self.sdpa_ms / self.ms if self.sdpa_ms and self.ms > 0 else None


# ------------------------------------------------------------------------------------------------ timing
class Timer:
    """benchutil.cuda_time on CUDA with a repeat count sized to ``budget_ms``; a wall-clock median on CPU."""

    def __init__(self, cuda: bool, budget_ms: float = 1500.0) -> None:
        self.cuda, self.budget_ms = cuda, budget_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            first = cuda_time(fn, warmup=1, repeats=1).median_ms  # compiles / autotunes outside the timing
            repeats = int(min(20, max(3, self.budget_ms // max(first, 1e-3))))
            return cuda_time(fn, warmup=1, repeats=repeats).median_ms
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


# ------------------------------------------------------------------------------------------------ masks
def diagonal_blocks(t: int, bq: int, bk: int, device: torch.device | str) -> torch.Tensor:
    """``[NQ, NK]`` bool: key blocks overlapping each query block's own positions (prefill)."""
    nq, nk = -(-t // bq), -(-t // bk)
    first = torch.arange(nq, device=device) * bq
    last = torch.clamp(first + bq, max=t) - 1
    j = torch.arange(nk, device=device)
    return (j[None, :] * bk <= last[:, None]) & ((j[None, :] + 1) * bk > first[:, None])


def random_block_mask(heads: int, t: int, bq: int, bk: int, density: float, seed: int,
                      device: torch.device | str):
    """Prefill BlockMask over ``[1, heads]`` keeping the diagonal blocks plus random causal blocks, so
    that the expected kept fraction of causal blocks is ``density``. Built one head at a time (the
    ``[NQ, NK]`` block table, never a ``[T, T]`` one)."""
    causal = causal_block_mask(t, t, bq, bk, device)
    diag = diagonal_blocks(t, bq, bk, device)
    n_c, n_d = int(causal.sum()), int(diag.sum())
    rate = 1.0 if density >= 1 else min(1.0, max(0.0, (density * n_c - n_d) / max(1, n_c - n_d)))
    gen = torch.Generator(device=device).manual_seed(seed)
    counts, indices = [], []
    for _ in range(heads):
        keep = ((torch.rand(causal.shape, generator=gen, device=device) < rate) & causal) | diag
        counts.append(keep.sum(-1))
        indices.append(keep.nonzero()[:, 1].to(torch.int32))
    offsets = torch.zeros(heads * causal.shape[0] + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(torch.cat(counts), 0)
    return BlockMask(offsets, torch.cat(indices), 1, heads, t, t, bq, bk)


def kept_pairs(mask, rows_per_chunk: int = 8192) -> int:
    """Causal (query, key) element pairs inside the kept blocks of ``mask`` (exact, per block in closed
    form: ``sum_p clamp(p - k0 + 1, 0, w)`` over the block's query positions ``p``), in row chunks."""
    dev, nq, total = mask.offsets.device, mask.num_q_blocks, 0
    n_rows = mask.offsets.numel() - 1
    bounds = mask.offsets[:: rows_per_chunk].tolist() + [int(mask.offsets[-1])]
    for c, r0 in enumerate(range(0, n_rows, rows_per_chunk)):
        r1 = min(r0 + rows_per_chunk, n_rows)
        rows = torch.repeat_interleave(torch.arange(r0, r1, device=dev), mask.offsets[r0 : r1 + 1].diff())
        qb = rows % nq
        p0 = (mask.seq_k - mask.seq_q) + qb * mask.block_q
        p1 = (mask.seq_k - mask.seq_q) + torch.clamp((qb + 1) * mask.block_q, max=mask.seq_q) - 1
        k0 = mask.indices[bounds[c] : bounds[c + 1]].long() * mask.block_k  # GPU selections over-size indices
        w = torch.clamp(mask.seq_k - k0, max=mask.block_k)

        def cum(x: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:  # sum_{a=1..x} min(a, w); 0 for x <= 0
            x = x.clamp(min=0)
            return torch.where(x <= w, x * (x + 1) // 2, w * (w + 1) // 2 + (x - w) * w)

        total += int((cum(p1 - k0 + 1) - cum(p0 - k0)).sum())
    return total


def mean_density(mask) -> float:
    return float(mask.density().mean())


# ------------------------------------------------------------------------------------------- inputs
def random_inputs(sh: Shapes, t: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, sh.hq, t, sh.d, generator=g, device=device, dtype=dtype)
    k = torch.randn(1, sh.hkv, t, sh.d, generator=g, device=device, dtype=dtype)
    v = torch.randn(1, sh.hkv, t, sh.d, generator=g, device=device, dtype=dtype)
    return q, k, v


def structured_inputs(sh: Shapes, t: int, n_passages: int, device: str, dtype: torch.dtype, seed: int = 1,
                      sink: int = 32, local_width: float = 64.0):
    """q, k, v with planted structure; logits (``q·k / sqrt(D)``) are built per component on disjoint
    dimensions: dim 0 = sink (keys ``< sink``: logit 12 for every query), dim 1 = passages (``n_passages``
    random 64-aligned 64-token spans per KV head after the first block: logit 11), dims 2..2F+1 (F = D/4)
    = a local band (``sum_f cos(w_f (i - j))`` with random ``w_f < pi / local_width``: peak logit 11, 13
    on odd heads of a group), the rest = noise (logit std 1)."""
    d, group, scale = sh.d, sh.hq // sh.hkv, 1.0 / math.sqrt(sh.d)
    n_freq = d // 4
    n_noise = d - 2 - 2 * n_freq
    amp = scale ** -0.5  # q entry L * amp times k entry amp, times scale, gives logit L
    nz = math.sqrt(1.0 / (scale * math.sqrt(n_noise)))
    g = torch.Generator(device=device).manual_seed(seed)
    pos = torch.arange(t, device=device, dtype=torch.float64)
    q = torch.empty(1, sh.hq, t, d, device=device, dtype=dtype)
    k = torch.empty(1, sh.hkv, t, d, device=device, dtype=dtype)
    v = torch.randn(1, sh.hkv, t, d, generator=g, device=device, dtype=dtype)
    for kh in range(sh.hkv):
        omega = torch.rand(n_freq, generator=g, device=device, dtype=torch.float64) * (math.pi / local_width)
        ang = pos[:, None] * omega[None, :]
        pe = torch.cat([torch.cos(ang), torch.sin(ang)], -1).float()  # [T, 2F]
        kk = torch.zeros(t, d, device=device)
        kk[:sink, 0] = amp
        starts = (torch.randperm(max(1, t // 64 - 1), generator=g, device=device)[:n_passages] + 1) * 64
        tok = (starts[:, None] + torch.arange(64, device=device)).flatten()
        kk[tok[tok < t], 1] = amp
        kk[:, 2 : 2 + 2 * n_freq] = pe * amp
        kk[:, 2 + 2 * n_freq :] = torch.randn(t, n_noise, generator=g, device=device) * nz
        k[0, kh] = kk.to(dtype)
        for j in range(group):
            qq = torch.zeros(t, d, device=device)
            qq[:, 0] = 12.0 * amp
            qq[:, 1] = 11.0 * amp
            qq[:, 2 : 2 + 2 * n_freq] = pe * (amp * (13.0 if j % 2 else 11.0) / n_freq)
            qq[:, 2 + 2 * n_freq :] = torch.randn(t, n_noise, generator=g, device=device) * nz
            q[0, kh * group + j] = qq.to(dtype)
    return q, k, v


# ------------------------------------------------------------------------------------------- rows
def sdpa_flops(sh: Shapes, t: int) -> float:
    return 4.0 * sh.d * sh.hq * t * (t + 1) / 2


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def default_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> str:
    try:
        name = SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=gqa)).name
    except (AttributeError, RuntimeError, TypeError) as err:  # private API; keep the bench running
        return f"unknown ({type(err).__name__})"
    impl = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return f"{name} ({impl()})" if name == "FLASH_ATTENTION" and impl is not None and impl() else name


def bench_sdpa(timer: Timer, sh: Shapes, q, k, v, forced: bool) -> tuple[list[Row], float, torch.Tensor]:
    """SDPA rows; returns them, the baseline time (fastest default variant) and the baseline output."""
    t, g = q.shape[2], sh.hq // sh.hkv
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    variants = [("default gqa", None, k, v, True), ("default expanded", None, ke, ve, False)]
    if forced:
        variants += [(f"{b.name.lower()} {'gqa' if gq else 'expanded'}", b, kk, vv, gq)
                     for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)
                     for kk, vv, gq in ((k, v, True), (ke, ve, False))]
    rows, best, best_call = [], math.inf, None
    for label, backend, kk, vv, gq in variants:
        def call(kk=kk, vv=vv, gq=gq):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gq)

        try:
            if backend is None:
                name = default_sdpa_backend(q, kk, vv, gq)
                ms = timer(call)
            else:
                name = backend.name
                with sdpa_kernel([backend]):
                    ms = timer(call)
        except (RuntimeError, NotImplementedError, ValueError) as err:  # a forced backend refusing the inputs
            rows.append(Row(t, "sdpa", label, "-", 1.0, math.nan, None, note=str(err).splitlines()[0][:60]))
            continue
        rows.append(Row(t, "sdpa", label, "-", 1.0, ms, _tflops(sdpa_flops(sh, t), ms), note=name))
        if backend is None and ms < best:
            best, best_call = ms, call
    if best_call is None:
        raise RuntimeError("default SDPA failed on these inputs: " + "; ".join(r.note for r in rows))
    out = best_call()
    del ke, ve
    for r in rows:
        r.sdpa_ms = best
    return rows, best, out


def bench_blocksparse(timer: Timer, sh: Shapes, q, k, v, sdpa_ms: float, sdpa_out, smoke: bool) -> list[Row]:
    fn = api.block_sparse_attention
    if smoke:  # CPU: call the Triton kernel (interpreter) directly, the api would pick the reference
        from runtime_kernels.blocksparse import triton as tri

        fn = tri.block_sparse_attention
    else:
        assert api.resolve_backend(q) == "triton", "the api does not pick the Triton kernel on CUDA"
    t, rows = q.shape[2], []
    for bq, bk in sh.blocks:
        if not smoke:
            print(f"  blocksparse {bq}x{bk} D={sh.d}: {kernel_resources(q, k, v, bq, bk)}", file=sys.stderr)
        for p in sh.densities:
            mask = random_block_mask(sh.hq, t, bq, bk, p, seed=int(1000 * p) + bk, device=q.device)
            ms = timer(lambda: fn(q, k, v, mask))
            note = ""
            if p >= 1:
                note = f"max|d| vs sdpa {float((fn(q, k, v, mask).float() - sdpa_out.float()).abs().max()):.1e}"
            rows.append(report(Row(t, "blocksparse", f"p={p:.0%}", f"{bq}x{bk}", mean_density(mask), ms,
                                   _tflops(4.0 * sh.d * kept_pairs(mask), ms), sdpa_ms, note)))
            del mask
    return rows


def kernel_resources(q, k, v, bq: int, bk: int) -> str:
    """Registers / spills / shared memory of the compiled block-sparse kernel for these blocks."""
    from runtime_kernels.blocksparse import triton as tri

    t = min(q.shape[2], 4 * bq)
    mask = BlockMask.full(1, q.shape[1], t, t, bq, bk, device=q.device)
    handle = tri.block_sparse_attention_into(q[:, :, :t], k[:, :, :t], v[:, :, :t], mask,
                                             torch.empty_like(q[:, :, :t]))
    meta = getattr(handle, "metadata", None)
    return (f"regs {getattr(handle, 'n_regs', '?')}, spills {getattr(handle, 'n_spills', '?')}, "
            f"smem {getattr(meta, 'shared', '?')} B, warps {getattr(meta, 'num_warps', '?')}, "
            f"stages {getattr(meta, 'num_stages', '?')}")


def _method_rows(timer: Timer, sh: Shapes, name: str, select: Callable, e2e: Callable, q, k, v,
                 sdpa_ms: float, note: str) -> list[Row]:
    t = q.shape[2]
    mask = select()
    density, flops = mean_density(mask), 4.0 * sh.d * kept_pairs(mask)
    blocks = f"{mask.block_q}x{mask.block_k}"
    sel_ms = timer(select)
    att_ms = timer(lambda: api.block_sparse_attention(q, k, v, mask))
    e2e_ms = timer(e2e)
    return [report(r) for r in (
        Row(t, name, "select", blocks, density, sel_ms, None, sdpa_ms, f"{sel_ms / sdpa_ms:.1%} of sdpa; {note}"),
        Row(t, name, "attend", blocks, density, att_ms, _tflops(flops, att_ms), sdpa_ms),
        Row(t, name, "e2e", blocks, density, e2e_ms, _tflops(flops, e2e_ms), sdpa_ms,
            f"select {sel_ms / e2e_ms:.0%} of e2e"),
    )]


def _gpu_module(module: str) -> str:
    """Whether the method's Triton selection module imports (the api dispatches to it on CUDA)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{module.rsplit('.', 2)[1]}.triton absent"
    return f"{module.rsplit('.', 2)[1]}.triton present"


def bench_sale(timer: Timer, sh: Shapes, t: int, device: str, dtype, sdpa_ms: float, args) -> list[Row]:
    # SALE keeps every block that holds a strong key: passages in ~9 % of the key blocks for ~10 % density
    q, k, v = structured_inputs(sh, t, n_passages=round(0.09 * t / 64), device=device, dtype=dtype)
    cfg = SaleSelectionConfig(bits=args.sale_bits)
    tau = torch.full((sh.hq,), args.sale_tau, device=device)
    note = f"tau={args.sale_tau} {cfg.precision}, {_gpu_module('runtime_kernels.sale.triton')}"
    select = lambda: sale_select(q, k, tau, config=cfg)  # noqa: E731
    rows = _method_rows(timer, sh, "sale", select, lambda: sale_prefill_attention(q, k, v, tau, config=cfg),
                        q, k, v, sdpa_ms, note)
    return rows + [sale_launch_row(timer, t, select, launch, rows[0]) for launch in args.sale_launch]


def sale_launch_row(timer: Timer, t: int, select: Callable, launch: tuple[int, int, int, int], default: Row) -> Row:
    """The selection pass under another launch shape of its kernel (``rows, block_n, warps, stages``; the
    warps of its keep walk, :class:`runtime_kernels.sale.triton.SelectLaunch`), checked to keep the blocks
    the default keeps."""
    from runtime_kernels.sale import triton as sale_triton

    base = sale_triton.LAUNCH
    try:
        want = sale_triton.block_table(select())
        rows, block_n, warps, stages = launch
        sale_triton.LAUNCH = sale_triton.SelectLaunch(rows=rows, block_n=block_n, keep_warps=warps,
                                                      num_stages=stages)
        same = torch.equal(sale_triton.block_table(select()), want)
        ms = timer(select)
    finally:
        sale_triton.LAUNCH = base
    shape = "/".join(str(x) for x in launch)
    return report(Row(t, "sale", f"select {shape}", default.blocks, default.density, ms, None, default.sdpa_ms,
                      f"rows/block_n/warps/stages; {'same blocks' if same else 'DIFFERENT blocks'}"))


def bench_sampleattention(timer: Timer, sh: Shapes, t: int, device: str, dtype, sdpa_ms: float, args) -> list[Row]:
    # the slash budget must also cover the passages' mass (each passage adds bands): a few give ~10 % density
    q, k, v = structured_inputs(sh, t, n_passages=max(1, round(t / 2400)), device=device, dtype=dtype)
    table = BucketTable([], [BucketRow(args.sa_alpha_c, args.sa_alpha_s, args.sa_chunks)])
    note = (f"alpha=({args.sa_alpha_c}, {args.sa_alpha_s}) chunk_n={args.sa_chunks}, "
            f"{_gpu_module('runtime_kernels.sampleattention.triton')}")
    return _method_rows(timer, sh, "sampleattention", lambda: sampleattention_prefill_mask(q, k, table),
                        lambda: sampleattention_prefill_attention(q, k, v, table), q, k, v, sdpa_ms, note)


# ------------------------------------------------------------------------------------------- report
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _cells(r: Row) -> tuple[str, ...]:
    return (str(r.length), r.case, r.part, r.blocks, _fmt(r.density, ".1%"), _fmt(r.ms, ".2f"),
            _fmt(r.tflops, ".0f"), _fmt(r.speedup, ".2f"), r.note)


def print_rows(rows: list[Row]) -> None:
    """Markdown table; ``x sdpa`` = the length's SDPA baseline time / the row's time."""
    head = ("T", "case", "part", "blocks", "density", "ms", "TFLOP/s", "x sdpa", "note")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(_cells(r)) + " |")


def report(row: Row) -> Row:
    """One progress line on stderr per row (partial results survive a time limit)."""
    print("  " + " ".join(_cells(row)), file=sys.stderr, flush=True)
    return row


def targets(rows: list[Row], sh: Shapes) -> list[tuple[str, float | None, float]]:
    """(target, measured speedup vs SDPA, required) at the longest length (128k on a GPU run)."""
    t = max(sh.lengths)

    def find(case: str, part: str, blocks: str | None = None) -> Row | None:
        for r in rows:
            if r.length == t and r.case == case and r.part == part and (blocks is None or r.blocks == blocks):
                return r
        return None

    out = []
    lo, hi = f"p={min(sh.densities, key=lambda p: abs(p - 0.1)):.0%}", f"p={max(sh.densities):.0%}"
    for blocks in (f"{bq}x{bk}" for bq, bk in sh.blocks):
        for part, need in ((lo, 6.0), (hi, 1 / 1.5)):
            r = find("blocksparse", part, blocks)
            out.append((f"blocksparse {part} {blocks} T={t}", r.speedup if r else None, need))
    for case, need in (("sale", 2.0), ("sampleattention", 3.0)):
        r = find(case, "e2e")
        out.append((f"{case} e2e T={t} (density {_fmt(r.density if r else None, '.1%')})",
                    r.speedup if r else None, need))
    return out


# ------------------------------------------------------------------------------------------------ main
def _launch(text: str) -> tuple[int, int, int, int]:
    """``R,N,W,S`` -> four positive ints (``--sale-launch``)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected four positive integers R,N,W,S, got {text!r}")
    return shape  # type: ignore[return-value]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="default 16384 32768 65536 131072")
    p.add_argument("--parts", nargs="+", default=["blocksparse", "sale", "sampleattention"],
                   choices=["blocksparse", "sale", "sampleattention"])
    p.add_argument("--no-sdpa-forced", dest="sdpa_forced", action="store_false",
                   help="skip timing the forced flash / cuDNN SDPA backends")
    p.add_argument("--sale-tau", type=float, default=0.008)
    p.add_argument("--sale-bits", type=int, default=8, choices=[4, 8])
    p.add_argument("--sale-launch", type=_launch, action="append", default=[], metavar="R,N,W,S",
                   help="also time SALE's selection with R rows per program, N keys per tile, W warps, S stages "
                        "(repeatable; each checked to keep the default's blocks)")
    p.add_argument("--sa-alpha-c", type=float, default=0.95)
    p.add_argument("--sa-alpha-s", type=float, default=0.90)
    p.add_argument("--sa-chunks", type=int, default=2)
    p.add_argument("--budget-ms", type=float, default=1500.0, help="timed device time per row (repeats 3..20)")
    p.add_argument("--json", type=Path, default=None, help="write all rows here")
    return p.parse_args(argv)


def _print_header(cuda: bool, args: argparse.Namespace) -> None:
    import triton

    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    dev = torch.cuda.get_device_name() if cuda else "CPU smoke (TRITON_INTERPRET=1): times are meaningless"
    print(f"bench_prefill {when} | {dev} | torch {torch.__version__} | triton {triton.__version__} | "
          f"tune={os.environ.get('CALIB_BLOCKSPARSE_AUTOTUNE', '0')}", flush=True)


def run(args: argparse.Namespace) -> tuple[list[Row], Shapes]:
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    base = SMOKE if not cuda else Shapes()
    sh = Shapes(**{**asdict(base), **({"lengths": tuple(args.lengths)} if args.lengths else {})})
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.bfloat16)
    timer = Timer(cuda, args.budget_ms)
    _print_header(cuda, args)
    rows: list[Row] = []
    for t in sh.lengths:
        q, k, v = random_inputs(sh, t, device, dtype)
        sdpa_rows, sdpa_ms, sdpa_out = bench_sdpa(timer, sh, q, k, v, args.sdpa_forced and cuda)
        rows += [report(r) for r in sdpa_rows]
        parts: list[tuple[str, Callable[[], list[Row]]]] = [
            ("blocksparse", lambda: bench_blocksparse(timer, sh, q, k, v, sdpa_ms, sdpa_out, smoke=not cuda)),
            ("sale", lambda: bench_sale(timer, sh, t, device, dtype, sdpa_ms, args)),
            ("sampleattention", lambda: bench_sampleattention(timer, sh, t, device, dtype, sdpa_ms, args)),
        ]
        for name, part in parts:
            if name not in args.parts:
                continue
            try:
                rows += part()
            except Exception as err:  # noqa: BLE001 - one failing part must not lose the others' rows
                traceback.print_exc()
                rows.append(report(Row(t, name, "FAILED", "-", None, math.nan, None, sdpa_ms,
                                       f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}")))
            if name == "blocksparse":
                del q, k, v, sdpa_out  # the structured parts build their own inputs
            if cuda:
                torch.cuda.empty_cache()
    return rows, sh


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, sh = run(args)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "speedup": r.speedup} for r in rows], indent=1))
    print()
    print_rows(rows)
    print_targets(targets(rows, sh), "targets (speedup = sdpa / t; 1.5x slower = 0.67)", 52)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
