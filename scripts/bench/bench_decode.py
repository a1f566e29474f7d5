"""Benchmark sparse decode attention (SAAP, SANTA-prop, SANTA-flash) against SDPA and the bandwidth floor.

    python scripts/bench/bench_decode.py            # GPU: Llama-3.1-8B shapes, B in {1, 8}, T in {8k, 32k, 128k}
    python scripts/bench/bench_decode.py --smoke    # CPU, tiny shapes, Triton interpreter: checks the script only

One decode step of one layer (Hq = 32, Hkv = 8, D = 128, bf16, random never-zero inputs). Per row: the median
device time (``benchutil.py``) eager (launch overhead included) and CUDA-graphed (the smaller median of two
captures; ``-`` if it cannot be captured), bytes read, achieved TB/s, the dense floor (K+V bytes at
``benchutil.HBM_TBPS``), SDPA's time (one query token, ``enable_gqa=True``, its backend named) and the ratios
``t/floor`` and ``sdpa/t``, ``t`` being the graphed time where there is one. Methods (sizes: :class:`Shapes`):
``saap`` on balanced random buckets with its classifier (bf16 weights) included, plus two stage rows at the
middle ℓ (``saap-cls``: classifier and ranking; ``saap-attn``: attention + merge on fixed buckets);
``santa-prop`` / ``santa-flash`` through ``santa_decode_attention`` (the graphed column captures the backend
forward with offsets drawn once: the public call validates on the host). Bytes: all of K plus the sampled V
rows (an upper bound: heads of a group may share rows).

The last table checks the targets (floor/t, sdpa/t) and says by how much a missed one misses. ``--json
PATH`` writes every row; ``--report PATH`` prints the table and targets of such a file again. Results:
docs/results/kernels.md.
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

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "bench"):  # run from a checkout without `pip install -e .`
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from benchutil import cuda_time, floor_ms, measured_copy_tbps, print_targets  # noqa: E402
from runtime_kernels.rope import derope_coefficients  # noqa: E402
from runtime_kernels.saap import BucketIndex, SaapLayerParams  # noqa: E402
from runtime_kernels.saap.bucket_index import searchable_range  # noqa: E402
from runtime_kernels.santa import api as santa_api  # noqa: E402
from runtime_kernels.santa import reference as santa_reference  # noqa: E402
from runtime_kernels.santa.api import santa_decode_attention  # noqa: E402

# Triton and runtime_kernels.saap.triton are imported where used: --report needs no Triton, and --smoke sets
# TRITON_INTERPRET=1 (run()) before a kernel is defined.


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
    floor_us: float  # dense K+V bytes at benchutil.HBM_TBPS
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
        ``captures`` separate captures (the first capture timed after a heavy step can read slow for its
        whole median, a later capture of the same step not)."""
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
    """(params, index, a query) for one (B, T): bf16 classifier, balanced random bucket assignment."""
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


def query_rotation(b: int, position: int, d: int, device: torch.device, theta: float = 500000.0) -> torch.Tensor:
    """De-RoPE coefficients ``[B, 2, D]`` of plain RoPE (Llama-3's base) at ``position`` for every row."""
    ang = position * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = (torch.cat([f(ang), f(ang)]).float().expand(b, d).to(device) for f in (torch.cos, torch.sin))
    return derope_coefficients(cos, sin)


def saap_bytes(sh: Shapes, params, index, sel: torch.Tensor, b: int, t: int, kv_elem: int) -> dict[str, float]:
    """Bytes one SAAP step reads: classifier weights, visited K/V rows, their slot indices."""
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

    params, index, _ = saap_setup(sh, b, t, q.device.type)
    rot = query_rotation(b, t - 1, sh.d, q.device)
    lo, hi = searchable_range(t, sh.sink, sh.recent)
    group, rows = sh.hq // sh.hkv, []
    logits = saap_triton.saap_classifier_logits_triton(q, params, rot)
    for top_l in sh.top_ls:
        sel = saap_triton.saap_rank_buckets_triton(logits, group, top_l)
        nb = saap_bytes(sh, params, index, sel, b, t, k.element_size())
        # as the runtime calls it: the RoPE'd query and its position's de-RoPE coefficients
        full = lambda top_l=top_l: saap_triton.saap_decode_attention_triton(  # noqa: E731
            q, None, k, v, index, params, top_l=top_l, scale=None, query_rotation=rot)
        variants = [("saap", full, nb["kv"] + nb["index"] + nb["weights"])]
        if top_l == sh.top_ls[len(sh.top_ls) // 2]:
            variants += [
                ("saap-cls", lambda top_l=top_l: saap_triton.saap_select_buckets_triton(q, params, group, top_l, rot),
                 nb["weights"]),  # classifier (de-RoPE on load) + ranking
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
    float64 reference at long lengths takes too long and too much memory); on CPU (smoke) the Triton module under
    the interpreter when it imports, so the smoke run calls the kernels the GPU run times."""
    if device.type != "cuda":
        module = santa_api._triton_module()
        return getattr(module, "santa_decode_forward", None) or santa_reference.santa_decode_forward
    fn = santa_api.backend_function("santa_decode_forward", device, "auto")
    return None if fn is santa_reference.santa_decode_forward else fn


def santa_bytes(sh: Shapes, tiling: str, s: int, b: int, t: int, elem: int) -> float:
    """All of K plus the sampled V rows (upper bound)."""
    n_tiles = -(-t // sh.tile)
    rows = s if tiling == "prop" else n_tiles * max(1, math.floor(s / n_tiles + 0.5))
    return b * sh.hkv * t * sh.d * elem + b * sh.hq * rows * sh.d * elem


def bench_santa(timer: Timer, sh: Shapes, q, k, v, b: int, t: int, floor: float, sdpa: float | None
                ) -> list[Row]:
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
    """(target, measured ratio, required ratio) for the targets (on smoke shapes: their stand-ins)."""
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
    return p.parse_args(argv)


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
    rows, sh = run(args)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "t_us": r.t_us} for r in rows], indent=1))
    print()
    print_rows(rows)
    print_targets(targets(rows, sh), "targets (ratios from graphed times where captured)", 44)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
