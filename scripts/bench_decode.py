"""Benchmark sparse decode attention (SAAP, SANTA-prop, SANTA-flash) against SDPA and the bandwidth floor.

    python scripts/bench_decode.py            # H200: Llama-3.1-8B shapes, B in {1, 8}, T in {8k, 32k, 128k}
    python scripts/bench_decode.py --smoke    # CPU, tiny shapes, Triton interpreter: checks the script only

One decode step of one layer (Hq = 32, Hkv = 8, D = 128, bf16, random never-zero inputs). Per row: the
median device time (``scripts/benchutil.py``: CUDA events, warm-up, cold L2 before every timed call),
eager (the Python call as a runtime would make it, launch overhead included) and CUDA-graphed (the
same call captured and replayed, as a real decode loop would run it: the smaller median of two
captures; ``-`` if it cannot be captured); bytes read, achieved TB/s, the dense bandwidth floor (K+V bytes / 4.2 TB/s), SDPA's time
(``scaled_dot_product_attention`` with one query token and ``enable_gqa=True``, whatever backend torch
picks: its name is printed) and the ratios ``t/floor`` and ``sdpa/t``, where ``t`` is the graphed time
when there is one (SDPA's too), else the eager one.

Methods:

* ``saap`` (ℓ = 16, 32, 64): C = 1024 balanced buckets (a random balanced assignment: each bucket holds
  ``N_s / C`` keys), window 1 + 2047, the classifier (2-layer MLP D -> 1024 -> C per query head, bf16
  weights, 75.5 MB) included. Stage variants at ℓ = 32 show where the time goes: ``saap-cls`` (classifier
  and ranking: ``saap_select_buckets_triton``), ``saap-attn`` (attention + merge on fixed buckets).
* ``santa-prop`` (S = 128, 256) and ``santa-flash`` (S = 1024, 2048), tile 256, through
  ``runtime_kernels.santa.api.santa_decode_attention`` (eager: validation and offset drawing included);
  the graphed column captures the backend forward (``santa_decode_forward``) with offsets drawn once,
  since the public call validates its arguments on the host. Bytes: all of K plus the sampled V rows
  (an upper bound: heads of a group may share rows).

The last table checks the issue's targets (floor/t, sdpa/t) and says by how much a missed one misses.
``--json PATH`` writes every row; ``--report PATH`` prints the table and targets of such a file again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):  # run from a checkout without `pip install -e .`
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from benchutil import cuda_time, floor_ms, measured_copy_tbps, print_targets  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    """What one run measures."""

    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    hq: int = 32
    hkv: int = 8
    d: int = 128
    clusters: int = 1024
    hidden: int = 1024
    sink: int = 1
    recent: int = 2047
    top_ls: tuple[int, ...] = (16, 32, 64)
    prop_s: tuple[int, ...] = (128, 256)
    flash_s: tuple[int, ...] = (1024, 2048)
    tile: int = 256


SMOKE = Shapes(batches=(1, 2), lengths=(700,), hq=8, hkv=2, d=64, clusters=16, hidden=32, sink=1, recent=63,
               top_ls=(2, 4), prop_s=(16,), flash_s=(64,), tile=64)


@dataclass
class Row:
    method: str
    params: str
    batch: int
    length: int
    eager_us: float
    graph_us: float | None
    bytes_read: float
    floor_us: float  # dense K+V bytes / 4.2 TB/s
    sdpa_us: float | None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def t_us(self) -> float:
        return self.graph_us if self.graph_us is not None else self.eager_us


# ------------------------------------------------------------------------------------------------ timing


class Timer:
    """benchutil.cuda_time on CUDA (cold L2, medians); a wall-clock median on CPU (``--smoke`` only)."""

    def __init__(self, cuda: bool, warmup: int, repeats: int, flush: str = "read") -> None:
        self.cuda, self.warmup, self.repeats, self.flush = cuda, warmup, repeats, flush

    def eager(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            return cuda_time(fn, warmup=self.warmup, repeats=self.repeats, flush=self.flush).median_ms * 1e3
        fn()
        times = []
        for _ in range(max(1, min(self.repeats, 2))):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def graphed(self, fn: Callable[[], object], captures: int = 2) -> tuple[float | None, str]:
        """Median replay time of ``fn`` captured in a CUDA graph, or (None, why not); the smaller over
        ``captures`` separate captures (on the H200 the first capture timed after a heavy step could
        read ~6 µs slow at B=8 128k for its whole median, and a later capture of the same step not:
        ``docs/bench/2026-11-21-h200/saap_win_programs.txt``)."""
        if not self.cuda:
            return None, ""
        best = None
        for _ in range(captures):
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # compile and allocate outside the capture
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
            except Exception as err:  # noqa: BLE001 - report, keep benchmarking
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - an invalidated capture may leave an error to clear
                    pass
                return None, f"no graph: {type(err).__name__}"
            us = self.eager(graph.replay)
            del graph
            best = us if best is None else min(best, us)
        return best, ""


def print_launch_times(timer: Timer, cases: list[tuple[str, Callable[[], object], float]], width: int = 32) -> None:
    """One line per ``(name, fn, MB read)``: graphed median (eager where it cannot be captured), MB, TB/s
    (the stage benchmarks ``bench_saap_classifier.py`` and ``bench_saap_attention.py``)."""
    for name, fn, mb in cases:
        us, note = timer.graphed(fn)
        if us is None:
            us = timer.eager(fn)
        print(f"{name:<{width}} {us:7.1f} us  {mb:7.1f} MB  {mb / us:5.2f} TB/s {note}", flush=True)


# ------------------------------------------------------------------------------------------------ inputs


def _randn(*shape: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Random normal, never exactly zero."""
    x = torch.randn(*shape, device=device, dtype=torch.float32) * scale
    return torch.where(x == 0, 1e-3, x).to(dtype)


def saap_setup(sh: Shapes, b: int, t: int, device: str):
    """(params, index, q_derope) for one (B, T): bf16 classifier, balanced random bucket assignment."""
    from runtime_kernels.saap import BucketIndex, SaapLayerParams

    f32 = dict(device=device, dtype=torch.float32)
    wdt = torch.bfloat16 if device == "cuda" else torch.float32
    hq, c, hd, d = sh.hq, sh.clusters, sh.hidden, sh.d
    params = SaapLayerParams(
        sink=sh.sink, recent=sh.recent, centroids=_randn(sh.hkv, c, d, **f32),
        w1=_randn(hq, d, hd, device=device, dtype=wdt, scale=d ** -0.5), b1=_randn(hq, hd, **f32, scale=0.1),
        bn_mean=_randn(hq, hd, **f32, scale=0.1), bn_var=torch.rand(hq, hd, **f32) + 0.5,
        bn_weight=_randn(hq, hd, **f32), bn_bias=_randn(hq, hd, **f32, scale=0.1),
        w2=_randn(hq, hd, c, device=device, dtype=wdt, scale=hd ** -0.5), b2=_randn(hq, c, **f32, scale=0.1))
    # balanced: a random permutation of positions, bucket = rank mod C; keys equal to their centroid
    assign = torch.argsort(torch.rand(b, sh.hkv, t, device=device), -1) % c  # [B, Hkv, T]
    keys = params.centroids[torch.arange(sh.hkv, device=device)[None, :, None], assign]  # [B, Hkv, T, D] fp32
    index = BucketIndex.build(keys, params.centroids, sink=sh.sink, recent=sh.recent)
    del keys, assign
    return params, index, _randn(b, hq, d, device=device, dtype=wdt)


def saap_bytes(sh: Shapes, params, index, sel: torch.Tensor, b: int, t: int, kv_elem: int) -> dict[str, float]:
    """Bytes one SAAP step reads: classifier weights, visited K/V rows, their slot indices."""
    from runtime_kernels.saap.reference import searchable_range

    lo, hi = searchable_range(t, sh.sink, sh.recent)
    visited = float(index.bucket_count.gather(-1, sel.long()).sum())  # bucket keys over (b, h)
    dense_rows = b * sh.hkv * (lo + t - hi)
    kv = (dense_rows + visited) * sh.d * kv_elem * 2
    weights = sum(getattr(params, n).numel() * getattr(params, n).element_size()
                  for n in ("w1", "b1", "bn_mean", "bn_var", "bn_weight", "bn_bias", "w2", "b2"))
    return {"kv": kv, "index": visited * 4, "weights": float(weights),
            "visited_per_head": (dense_rows + visited) / (b * sh.hkv)}


# ------------------------------------------------------------------------------------------------ methods


def bench_sdpa(timer: Timer, q, k, v) -> tuple[float, float | None, str]:
    """(eager µs, graphed µs, backend name) of SDPA with one query token and enable_gqa."""
    from torch.nn.attention import SDPBackend

    q4 = q[:, :, None]
    try:
        backend = SDPBackend(torch._fused_sdp_choice(q4, k, v, enable_gqa=True)).name
    except Exception:  # noqa: BLE001 - private API; the name is informative only
        backend = "unknown"
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: E731
    graph, _ = timer.graphed(fn)
    return timer.eager(fn), graph, backend


def bench_saap(timer: Timer, sh: Shapes, q, k, v, b: int, t: int, floor: float, sdpa: float | None
               ) -> list[Row]:
    from runtime_kernels.saap import triton as saap_triton
    from runtime_kernels.saap.reference import searchable_range

    params, index, qd = saap_setup(sh, b, t, q.device.type)
    lo, hi = searchable_range(t, sh.sink, sh.recent)
    group, rows = sh.hq // sh.hkv, []
    logits = saap_triton.saap_classifier_logits_triton(qd, params)
    for top_l in sh.top_ls:
        sel = saap_triton.saap_rank_buckets_triton(logits, group, top_l)
        nb = saap_bytes(sh, params, index, sel, b, t, k.element_size())
        full = lambda top_l=top_l: saap_triton.saap_decode_attention_triton(  # noqa: E731
            q, qd, k, v, index, params, top_l=top_l, scale=None)
        variants = [("saap", full, nb["kv"] + nb["index"] + nb["weights"])]
        if top_l == sh.top_ls[len(sh.top_ls) // 2]:
            variants += [
                ("saap-cls", lambda top_l=top_l: saap_triton.saap_select_buckets_triton(qd, params, group, top_l),
                 nb["weights"]),  # classifier + ranking (the GEMV path sums its partial logits in the ranking)
                ("saap-attn", lambda sel=sel: saap_triton.saap_sparse_attention_triton(
                    q, k, v, index, sel, lo, hi, sh.d ** -0.5), nb["kv"] + nb["index"]),
            ]
        for name, fn, nbytes in variants:
            graph, note = timer.graphed(fn)
            rows.append(Row(name, f"C={sh.clusters} l={top_l}", b, t, timer.eager(fn), graph, nbytes, floor, sdpa,
                            note, {"visited_keys_per_head": nb["visited_per_head"]}))
    del index, params
    return rows


def _santa_backend(device: torch.device):
    """The backend forward santa_decode_attention dispatches to: Triton on CUDA (None without it: the
    float64 reference at 128k would take minutes and tens of GB); on CPU (smoke) the Triton module under
    the interpreter when it imports, so the smoke run calls the kernels the GPU run times."""
    from runtime_kernels.santa import api, reference

    if device.type != "cuda":
        module = api._triton_module()
        return getattr(module, "santa_decode_forward", None) or reference.santa_decode_forward
    fn = api._backend_function("santa_decode_forward", device, "auto")
    return None if fn is reference.santa_decode_forward else fn


def santa_bytes(sh: Shapes, tiling: str, s: int, b: int, t: int, elem: int) -> float:
    """All of K plus the sampled V rows (upper bound)."""
    n_tiles = -(-t // sh.tile)
    rows = s if tiling == "prop" else n_tiles * max(1, math.floor(s / n_tiles + 0.5))
    return b * sh.hkv * t * sh.d * elem + b * sh.hq * rows * sh.d * elem


def bench_santa(timer: Timer, sh: Shapes, q, k, v, b: int, t: int, floor: float, sdpa: float | None
                ) -> list[Row]:
    from runtime_kernels.santa.api import santa_decode_attention

    forward = _santa_backend(q.device)
    if forward is None:
        return [Row("santa", "skipped", b, t, float("nan"), None, 0.0, floor, sdpa,
                    "runtime_kernels.santa.triton missing")]
    gen = torch.Generator(device=q.device).manual_seed(0)
    n_tiles = -(-t // sh.tile)
    offsets = torch.rand(b, sh.hq, n_tiles, generator=gen, dtype=torch.float64, device=q.device)
    cache_len = torch.full((b,), t, dtype=torch.int64, device=q.device)
    rows = []
    for tiling, budgets in (("prop", sh.prop_s), ("flash", sh.flash_s)):
        for s in budgets:
            public = lambda tiling=tiling, s=s: santa_decode_attention(  # noqa: E731
                q, k, v, s, tiling=tiling, tile=sh.tile, generator=gen)
            s_t = torch.full((b,), s, dtype=torch.int64, device=q.device)
            fwd = lambda tiling=tiling, s_t=s_t: forward(  # noqa: E731
                q, k, v, s_t, tiling=tiling, tile=sh.tile, estimator="sys", scale=sh.d ** -0.5,
                uniforms=offsets, cache_len=cache_len)
            if fwd().shape != q.shape:  # also compiles the kernels before any timing
                raise RuntimeError(f"santa_decode_forward returned a wrong shape for {tiling}")
            graph, note = timer.graphed(fwd)
            rows.append(Row(f"santa-{tiling}", f"S={s} tile={sh.tile}", b, t, timer.eager(public), graph,
                            santa_bytes(sh, tiling, s, b, t, k.element_size()), floor, sdpa, note))
    return rows


# ------------------------------------------------------------------------------------------------ report


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_rows(rows: list[Row]) -> None:
    cols = [("method", 11, "<"), ("params", 19, "<"), ("B", 2, ">"), ("T", 7, ">"), ("eager_us", 9, ">"),
            ("graph_us", 9, ">"), ("MB_read", 8, ">"), ("TB/s", 5, ">"), ("floor_us", 9, ">"), ("t/floor", 8, ">"),
            ("sdpa_us", 9, ">"), ("sdpa/t", 7, ">"), ("note", 0, "<")]
    line = lambda vals: " ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(vals, cols))  # noqa: E731
    head = line([c[0] for c in cols])
    print(head)
    print("-" * len(head))
    for r in rows:
        t = r.t_us
        achieved = r.bytes_read / (t * 1e-6) / 1e12 if t > 0 else None
        print(line([r.method, r.params, r.batch, r.length, _fmt(r.eager_us), _fmt(r.graph_us),
                    f"{r.bytes_read / 1e6:.1f}", _fmt(achieved, ".2f"), f"{r.floor_us:.1f}",
                    _fmt(t / r.floor_us, ".3g"), _fmt(r.sdpa_us), _fmt(r.sdpa_us / t if r.sdpa_us else None, ".2f"),
                    r.note]))


def _find(rows: list[Row], method: str, params_prefix: str, b: int, t: int) -> Row | None:
    for r in rows:
        if r.method == method and r.params.startswith(params_prefix) and r.batch == b and r.length == t:
            return r
    return None


def _pick(values: tuple[int, ...], want: int, fallback: int) -> int:
    return want if want in values else values[fallback]


def targets(rows: list[Row], sh: Shapes) -> list[tuple[str, float | None, float]]:
    """(target, measured ratio, required ratio) for the issue's targets (on smoke shapes: their stand-ins)."""
    out: list[tuple[str, float | None, float]] = []

    def add(label: str, r: Row | None, kind: str, need: float) -> None:
        if r is None or math.isnan(r.t_us):
            return
        ratio = r.floor_us / r.t_us if kind == "floor" else (r.sdpa_us / r.t_us if r.sdpa_us else None)
        out.append((f"{label}: {kind}/t", ratio, need))

    big, mid = _pick(sh.lengths, 131072, -1), _pick(sh.lengths, 32768, len(sh.lengths) // 2)
    b_one, b_many = _pick(sh.batches, 1, 0), _pick(sh.batches, 8, -1)
    top_l = _pick(sh.top_ls, 32, len(sh.top_ls) // 2)
    s_prop, s_flash = _pick(sh.prop_s, 128, 0), _pick(sh.flash_s, 2048, -1)
    for b, need in ((b_one, 3.0), (b_many, 5.0)):
        add(f"saap T={big} B={b} l={top_l}", _find(rows, "saap", f"C={sh.clusters} l={top_l}", b, big), "floor", need)
    for b in sh.batches:
        r = _find(rows, "santa-prop", f"S={s_prop} ", b, mid)
        add(f"santa-prop T={mid} B={b} S={s_prop}", r, "floor", 1.4)
        add(f"santa-prop T={mid} B={b} S={s_prop}", r, "sdpa", 2.0)
        r = _find(rows, "santa-flash", f"S={s_flash} ", b, mid)
        add(f"santa-flash T={mid} B={b} S={s_flash}", r, "floor", 1.25)
    for r in rows:
        methods = ("saap", "santa-prop", "santa-flash")
        if r.batch == b_many and r.length >= min(8192, min(sh.lengths)) and r.method in methods:
            add(f"{r.method} {r.params.split(' tile')[0]} T={r.length} B={b_many}", r, "sdpa", 1.0)
    return out


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="default 8192 32768 131072")
    p.add_argument("--methods", nargs="+", default=["saap", "santa"], choices=["saap", "santa"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--flush", choices=["read", "write"], default="read",
                   help="cold-L2 flush before each timed call (benchutil: a write leaves dirty lines)")
    p.add_argument("--json", type=Path, default=None, help="write all rows here")
    p.add_argument("--report", type=Path, default=None, metavar="JSON",
                   help="print the table and targets of a saved --json run (no timing, no GPU)")
    p.add_argument("--saap-variants", nargs="*", default=None, metavar="NAME",
                   help=f"time named SAAP configs side by side instead of the full table (B 1 8 x T 8192 131072, "
                        f"l=32); no name: all of {', '.join(SAAP_VARIANTS)}")
    p.add_argument("--top-l", type=int, default=None, help="--saap-variants: buckets visited (default 32)")
    p.add_argument("--saap-config", nargs="*", default=[], metavar="KEY=INT",
                   help="override runtime_kernels.saap.triton_config.CONFIG fields, e.g. block_n=32 linear_stages=3")
    return p.parse_args(argv)


def apply_saap_config(pairs: list[str]) -> None:
    """Set tile sizes of the SAAP kernels from ``KEY=INT`` pairs (tuning on the GPU without editing code)."""
    if not pairs:
        return
    from dataclasses import replace

    from runtime_kernels.saap import triton_config

    values = dict(pair.split("=", 1) for pair in pairs)
    triton_config.CONFIG = replace(triton_config.CONFIG, **{k: int(v) for k, v in values.items()})
    print(f"SAAP config: {triton_config.CONFIG}")


# named CONFIG overrides timed side by side by --saap-variants (one GPU run compares schedules)
SAAP_VARIANTS: dict[str, dict[str, int]] = {
    "default": {},
    "fused": {"cls_fused": 1, "overlap_window": 1},  # the split-K one-launch classifier + side-stream window
    "overlap": {"overlap_window": 1},
    "cls-h128-n64": {"cls_fused": 1, "cls_block_h": 128, "cls_block_n": 64},
    "cls-h64-n64-s4": {"cls_fused": 1, "cls_block_h": 64, "cls_block_n": 64, "cls_stages": 4},
    "cls-h128-n128-w8": {"cls_fused": 1, "cls_block_h": 128, "cls_block_n": 128, "cls_warps": 8},
    "cls-h64-n256-w8": {"cls_fused": 1, "cls_block_h": 64, "cls_block_n": 256, "cls_warps": 8},
    "cls-nsplit2": {"cls_fused": 1, "cls_n_split": 2},
    "tc-cls": {"cls_gemv_max_b": 0},  # the tensor-core classifier at B = 1 too (the previous default)
    "gemv-n128": {"gemv_block_n": 128},
    "gemv-ks2": {"gemv_k_split": 2},
    "gemv-ks8": {"gemv_k_split": 8},
    "gemv-k32": {"gemv_block_k": 32},
    "gemv-w8": {"gemv_warps": 8},
    "gemv-b8": {"cls_gemv_max_b": 8},  # the GEMV classifier at B = 8 as well
    # whole weight rows per program (2 KB contiguous each), layer 2 split into k chunks of rows
    "rows-k8-ks16": {"gemv_block_n": 1024, "gemv_block_k": 8, "gemv_k_split": 16, "gemv_warps": 8},
    "rows-k16-ks16": {"gemv_block_n": 1024, "gemv_block_k": 16, "gemv_k_split": 16, "gemv_warps": 8},
    "rows-k8-ks8": {"gemv_block_n": 1024, "gemv_block_k": 8, "gemv_k_split": 8, "gemv_warps": 8},
    "rows-k8-ks32": {"gemv_block_n": 1024, "gemv_block_k": 8, "gemv_k_split": 32, "gemv_warps": 8},
    "rows-k4-ks32-w4": {"gemv_block_n": 1024, "gemv_block_k": 4, "gemv_k_split": 32, "gemv_warps": 4},
    "n256-k32-ks8": {"gemv_block_n": 256, "gemv_block_k": 32, "gemv_k_split": 8, "gemv_warps": 8},
    "n128-l1n128": {"gemv_block_n": 128, "gemv1_block_n": 128},
    "n128-rank8": {"gemv_block_n": 128, "rank_warps": 8},
    "n128-rank16": {"gemv_block_n": 128, "rank_warps": 16},
    "atomic-ks4": {"gemv_atomic": 1},
    "atomic-ks8": {"gemv_atomic": 1, "gemv_k_split": 8},
    "atomic-ks16-oneshot": {"gemv_atomic": 1, "gemv_k_split": 16, "gemv_block_k": 64},
    "atomic-ks8-oneshot-w8": {"gemv_atomic": 1, "gemv_k_split": 8, "gemv_block_k": 128, "gemv_warps": 8},
    "atomic-ks16-n64": {"gemv_atomic": 1, "gemv_k_split": 16, "gemv_block_n": 64},
    "bmm": {"cls_bmm_max_b": 16},  # layer 1 GEMV writing three bf16 terms + layer 2 as one cuBLAS bmm
    "bmm-rank8": {"cls_bmm_max_b": 16, "rank_warps": 8},
    "bmm-rank16": {"cls_bmm_max_b": 16, "rank_warps": 16},
    "bmm-rank2": {"cls_bmm_max_b": 16, "rank_warps": 2},
    "bmm-l1n32": {"cls_bmm_max_b": 16, "gemv1_block_n": 32},
    "bmm-l1n128": {"cls_bmm_max_b": 16, "gemv1_block_n": 128},
    # window tiles per (batch, KV head) capped by a program budget: B=8 streams longer tiles
    "winp0": {"win_programs": 0},  # the window cut by max_win_tiles alone (before 2026-11-21 18:00)
    "winp128": {"win_programs": 128},
    "winp256": {"win_programs": 256},
    "winp512": {"win_programs": 512},
    "winp256-s3": {"win_programs": 256, "attn_stages": 3},
    "winp512-s3": {"win_programs": 512, "attn_stages": 3},
    "winp1024-s3": {"win_programs": 1024, "attn_stages": 3},
    "s3": {"attn_stages": 3},
    "winp512-s3-w8": {"win_programs": 512, "attn_stages": 3, "attn_warps": 8},
    "rank-filter2": {"rank_filter": 2},  # sort only the candidates above the smallest chunk maximum
    "rank-filter4": {"rank_filter": 4},
    "rank-filter4-w4": {"rank_filter": 4, "rank_warps": 4},
    "rank-filter8": {"rank_filter": 8},
    "prefetch-v": {"attn_prefetch_v": 1},
    "prefetch-v-overlap": {"attn_prefetch_v": 1, "overlap_window": 1},
    "attn-bn32": {"block_n": 32, "min_win_steps": 2, "max_win_tiles": 64},
    "attn-w8": {"attn_warps": 8},
    "win-big": {"min_win_steps": 4, "max_win_tiles": 16, "attn_stages": 3},
    "bkt-split2": {"bkt_split": 2},
    "bkt-per4": {"bkt_per_prog": 4},
    # the window on a side stream in few long programs, so the classifier's kernels have SMs beside it
    "overlap-winp64": {"overlap_window": 1, "win_programs": 64},
    "overlap-winp128": {"overlap_window": 1, "win_programs": 128},
    "overlap-winp64-per4": {"overlap_window": 1, "win_programs": 64, "bkt_per_prog": 4},
    "l1n32": {"gemv1_block_n": 32},  # layer 1: twice the programs (B=8: 15.5 us alone at 64)
    "l1n16": {"gemv1_block_n": 16},
    "split2-pv": {"bkt_split": 2, "attn_prefetch_v": 1},  # bucket chains halved, V loaded with K
    # layer 1 (bmm path) in fewer, wider k steps: B=8 walks D = 128 in 8 steps of 16 at the default
    "l1-k256": {"gemv_block_k": 256},
    "l1-k256-w8": {"gemv_block_k": 256, "gemv_warps": 8},
    "l1-k512-w8": {"gemv_block_k": 512, "gemv_warps": 8},
    "l1-gemv": {"l1_dot_min_b": 0},  # layer 1 as the GEMV at every batch (the default before 2026-11-21 20:00)
    "l1-dot": {"l1_dot_min_b": 1},  # layer 1 on tensor cores at B = 1 too (the default since)
    "l1-dot-n32": {"l1_dot_block_n": 32},
    # the merge reads all partials of a row in one step (36-48 partials: 3 steps of 16 at the default)
    "merge-p64": {"merge_block_p": 64},
    "merge-p64-d16": {"merge_block_p": 64, "merge_block_d": 16},
    "merge-p32": {"merge_block_p": 32},
    "merge-p64-d64": {"merge_block_p": 64, "merge_block_d": 64},
    # longer window tiles (fewer partials to merge) and one 128-key step per bucket
    "winsteps4": {"min_win_steps": 4},
    "winsteps8": {"min_win_steps": 8},
    "bn128": {"block_n": 128},
    # layer 2 as Triton's pipelined w2 stream (three terms summed in its epilogue) instead of cuBLAS bmm
    "cublas-l2": {"l2_triton": 0},  # the default before 2026-11-21 20:00
    "cublas-l2-sort": {"l2_triton": 0, "rank_count": 0, "rank_chunks": 1},  # ... and its ranking
    "l2t": {"l2_triton": 1, "l2_block_n": 64},
    "l2t-s6": {"l2_triton": 1, "l2_stages": 6},
    "l2t-n128": {"l2_triton": 1, "l2_block_n": 128},
    "l2t-k128": {"l2_triton": 1, "l2_block_k": 128, "l2_stages": 3},
    "l2t-n32": {"l2_triton": 1, "l2_block_n": 32, "l2_stages": 6},
    "l2t-w8-n128": {"l2_triton": 1, "l2_block_n": 128, "l2_warps": 8},
    "rank-count": {"rank_count": 1, "rank_chunks": 1},  # filtered candidates placed by counting, not sorted
    "l2t-n128-count": {"l2_triton": 1, "l2_block_n": 128, "rank_count": 1},
    # the ranking's threshold from 2 / 4 x K_PAD chunk maxima (fewer candidates, no fallback to the full sort)
    "count-ch2": {"rank_count": 1, "rank_chunks": 2},
    "count-ch4": {"rank_count": 1, "rank_chunks": 4},
    "l2t-n128-count-ch2": {"l2_triton": 1, "l2_block_n": 128, "rank_count": 1, "rank_chunks": 2},
    "l2t-n128-count-ch4": {"l2_triton": 1, "l2_block_n": 128, "rank_count": 1, "rank_chunks": 4},
    "l2t-n128-count-ch4-w4": {"l2_triton": 1, "l2_block_n": 128, "rank_count": 1, "rank_chunks": 4, "rank_warps": 4},
    # session 11: b2 added by layer 2 and sorted candidates became the default; the earlier ranking, and more
    "b2-in-rank-counted": {"l2_bias": 0, "rank_count": 1},  # the default before session 11
    "b2-in-rank": {"l2_bias": 0},
    "counted": {"rank_count": 1},
    "nofilter": {"rank_filter": 0},
    "rank-w4": {"rank_warps": 4},
    "l1-k128": {"l1_dot_block_k": 128},
    # session 12: small buckets packed, several per program as one key list
    "pack2": {"bkt_pack": 2},
    "pack4": {"bkt_pack": 4},
    "pack8": {"bkt_pack": 8},
    "pack16": {"bkt_pack": 16},
    # session 12: the 128k B=1 step's remaining tile shapes
    "l2n256": {"l2_block_n": 256},
    "l2n256-w8": {"l2_block_n": 256, "l2_warps": 8},
    "l2s5": {"l2_stages": 5},
    "l2s3": {"l2_stages": 3},
    "l1n128": {"l1_dot_block_n": 128},
    "l1n128-k128": {"l1_dot_block_n": 128, "l1_dot_block_k": 128},
}


def bench_saap_variants(args: argparse.Namespace, names: list[str]) -> None:
    """Graphed time of the full SAAP step and of the classifier alone, per named CONFIG, at B x T, l = 32."""
    from dataclasses import replace

    from runtime_kernels.saap import triton as saap_triton
    from runtime_kernels.saap import triton_config

    cuda = torch.cuda.is_available() and not args.smoke
    sh = SMOKE if args.smoke else Shapes(batches=(1, 8), lengths=(8192, 131072))
    batches = tuple(args.batches) if args.batches else sh.batches
    lengths = tuple(args.lengths) if args.lengths else sh.lengths
    top_l = args.top_l or _pick(sh.top_ls, 32, len(sh.top_ls) // 2)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    timer = Timer(cuda, args.warmup if cuda else 1, args.repeats, args.flush)
    base = triton_config.CONFIG
    results: list[tuple[str, int, int, float, float, float | None]] = []
    for b in batches:
        for t in lengths:
            q = _randn(b, sh.hq, sh.d, device=device, dtype=dtype)
            k, v = (_randn(b, sh.hkv, t, sh.d, device=device, dtype=dtype) for _ in range(2))
            _, sdpa_graph, _ = bench_sdpa(timer, q, k, v)
            params, index, qd = saap_setup(sh, b, t, device)
            # Two rounds over the variants (each timing itself the smaller of two captures), the smaller
            # median kept: whichever variant was timed first at a (B, T) read ~6 us slow at B=8 128k on the
            # H200, even after a discarded timing of the same step (2026-11-21, saap_win_programs.txt).
            best: dict[str, list[float]] = {}
            for rnd in range(2):
                for name in names:
                    triton_config.CONFIG = replace(base, **SAAP_VARIANTS[name])
                    full = lambda: saap_triton.saap_decode_attention_triton(  # noqa: E731
                        q, qd, k, v, index, params, top_l=top_l, scale=None)
                    cls = lambda: saap_triton.saap_select_buckets_triton(qd, params, sh.hq // sh.hkv, top_l)  # noqa: E731
                    times = []
                    for fn in (full, cls):
                        graph, _ = timer.graphed(fn)
                        times.append(graph if graph is not None else timer.eager(fn))
                    best[name] = [min(x, y) for x, y in zip(best.get(name, times), times)]
                    print(f"  round {rnd} {name:<18} B={b} T={t}: saap {times[0]:.1f} us, cls {times[1]:.1f} us",
                          flush=True)
            results += [(name, b, t, best[name][0], best[name][1], sdpa_graph) for name in dict.fromkeys(names)]
            triton_config.CONFIG = base
            del q, k, v, params, index
            if cuda:
                torch.cuda.empty_cache()
    print(f"\nSAAP variants (graphed us, the smaller of two rounds; l={top_l}, C={sh.clusters}; sdpa graphed)")
    print(f"{'variant':<18} {'B':>2} {'T':>7} {'saap_us':>8} {'cls_us':>7} {'sdpa_us':>8} {'sdpa/saap':>9}  overrides")
    for name, b, t, full_us, cls_us, sdpa in results:
        ratio = f"{sdpa / full_us:.2f}" if sdpa else "-"
        print(f"{name:<18} {b:>2} {t:>7} {full_us:>8.1f} {cls_us:>7.1f} {_fmt(sdpa):>8} {ratio:>9}  "
              f"{SAAP_VARIANTS[name]}")


def run(args: argparse.Namespace) -> tuple[list[Row], Shapes]:
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    base = SMOKE if args.smoke else Shapes(batches=(1, 8), lengths=(8192, 32768, 131072))
    sh = Shapes(**{**asdict(base), **({"batches": tuple(args.batches)} if args.batches else {}),
                   **({"lengths": tuple(args.lengths)} if args.lengths else {})})
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    timer = Timer(cuda, args.warmup if cuda else 1, args.repeats, args.flush)
    torch.manual_seed(0)
    _print_header(cuda)
    apply_saap_config(args.saap_config)
    rows: list[Row] = []
    for b in sh.batches:
        for t in sh.lengths:
            q = _randn(b, sh.hq, sh.d, device=device, dtype=dtype)
            k, v = (_randn(b, sh.hkv, t, sh.d, device=device, dtype=dtype) for _ in range(2))
            kv_bytes = 2 * k.numel() * k.element_size()
            floor = floor_ms(kv_bytes) * 1e3
            sdpa_eager, sdpa_graph, backend = bench_sdpa(timer, q, k, v)
            sdpa = sdpa_graph if sdpa_graph is not None else sdpa_eager
            rows.append(Row("sdpa", f"gqa {backend.lower()}", b, t, sdpa_eager, sdpa_graph, kv_bytes, floor, sdpa))
            if "saap" in args.methods:
                rows += bench_saap(timer, sh, q, k, v, b, t, floor, sdpa)
            if "santa" in args.methods:
                rows += bench_santa(timer, sh, q, k, v, b, t, floor, sdpa)
            print(f"  done B={b} T={t}", flush=True)
            del q, k, v
            if cuda:
                torch.cuda.empty_cache()
    return rows, sh


def _print_header(cuda: bool) -> None:
    import triton

    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    if cuda:
        dev = f"{torch.cuda.get_device_name()}, copy {measured_copy_tbps():.2f} TB/s (floor uses 4.2)"
    else:
        dev = "CPU smoke (TRITON_INTERPRET=1): times are meaningless"
    print(f"bench_decode {when} | {dev} | torch {torch.__version__} | triton {triton.__version__}", flush=True)


def load_rows(path: Path) -> list[Row]:
    """Rows of a ``--json`` file (``t_us`` is derived, not stored back)."""
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in rec.items() if k in fields}) for rec in json.loads(path.read_text())]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        rows = load_rows(args.report)
        sh = Shapes(batches=tuple(sorted({r.batch for r in rows})), lengths=tuple(sorted({r.length for r in rows})))
        print(f"bench_decode report of {args.report}")
        print_rows(rows)
        print_targets(targets(rows, sh), "targets (ratios from graphed times where captured)", 44)
        return 0
    if args.saap_variants is not None:
        if args.smoke or not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        _print_header(torch.cuda.is_available() and not args.smoke)
        apply_saap_config(args.saap_config)  # a base that every variant overrides
        unknown = sorted(set(args.saap_variants) - set(SAAP_VARIANTS))
        if unknown:
            raise SystemExit(f"unknown SAAP variants {unknown}; known: {sorted(SAAP_VARIANTS)}")
        bench_saap_variants(args, args.saap_variants or list(SAAP_VARIANTS))
        return 0
    rows, sh = run(args)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "t_us": r.t_us} for r in rows], indent=1))
    print()
    print_rows(rows)
    print_targets(targets(rows, sh), "targets (ratios from graphed times where captured)", 44)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
