"""End-to-end generation with calib methods loaded: time to first token and decode ms/token.

    python scripts/bench/bench_generate.py                          # the grid below, one process per cell
    python scripts/bench/bench_generate.py --points 32768x1 --methods dense,saap
    python scripts/bench/bench_generate.py --smoke                  # CPU, a 2-layer model: checks the script
    python scripts/bench/bench_generate.py --compile both --points 131072x1 --methods dense-flash,saap

Llama-3.1-8B's architecture (``conf/model/llama31.yaml``) with random bf16 weights (seeded; no weights are
read), on one GPU. Every cell runs in its own process (a first configuration in a process reads slow) through
:class:`runtime_kernels.generate.StaticGenerator`, the same loop for dense and for every method, so the ratio
is the method's. Decode: the median device time of ``--steps`` graph replays (host time to issue a step
beside it); B > 1 prefills one prompt and copies its cache to every row (:func:`replicate_prefill`). TTFT
(B = 1): the prompt's forward pass and first token after one untimed warm-up prefill. The methods and their
settings: :data:`METHODS`; random weights give meaningless attention, so a prefill method's own selection
runs (and is counted) and its mask is then replaced by a planted one at ``--density`` (:class:`PlantedMasks`).
``--compile``: decode steps through ``StaticGenerator(compile=True)``; a compiled row's ratio is to the faster
compiled dense path. The table (stdout, last) gives each method's ratio to dense, the copy rate measured on
the card and the KV-read floor; ``--json PATH`` writes every row. Results: docs/results/generate.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "bench"):  # run from a checkout without `pip install -e .`
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import yaml  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import runtime_kernels.blocksparse.api as bs_api  # noqa: E402
import runtime_kernels.sampleattention.api as sa_api  # noqa: E402
from bench_prefill import random_block_mask  # noqa: E402
from calib.saap.kmeans import fit_kmeans_heads  # noqa: E402
from runtime_kernels import hf  # noqa: E402
from runtime_kernels.generate import FlashDecode, StaticGenerator, StepTimes  # noqa: E402
from runtime_kernels.saap import SaapDecode, SaapLayerParams, derope  # noqa: E402
from runtime_kernels.saap.api import AttentionPositions  # noqa: E402
from runtime_kernels.sale.api import SalePrefill  # noqa: E402
from runtime_kernels.sampleattention.api import SampleAttentionPrefill  # noqa: E402
from runtime_kernels.sampleattention.buckets import BucketRow  # noqa: E402
from runtime_kernels.santa.runtime import SantaDecode  # noqa: E402

POINTS = ("32768x1", "131072x1", "32768x8", "65536x8")
# dense: SDPA on the masked cache view; dense-flash: flash-decoding on the valid length; no-attention: a step whose
# attention reads no key or value (the floor of every decode method, :class:`NoAttention`); saap: l = --saap-top-l,
# C = 1024, hidden 1024, window 1 + (--saap-window - 1), centroids a k-means of each KV head's own prompt keys
# (:func:`saap_runtime`), classifier weights random; santa-prop: S = 128 per layer; santa-flash: S = 2048; sale:
# tau = 0.008 on every head; sampleattention: alpha_c = 0.95, alpha_s = 0.9, chunk_n = 2 (both prefill methods);
# sampleattention+saap. Also hf-generate: transformers' model.generate() with its default cache, for context.
METHODS = ("dense", "dense-flash", "no-attention", "saap", "santa-prop", "santa-flash", "sale", "sampleattention",
           "sampleattention+saap")
PREFILL_METHODS = ("sale", "sampleattention")
DECODE_ONLY_AT_BATCH = ("dense", "dense-flash", "no-attention", "saap", "santa-prop", "santa-flash")  # B > 1: the decode methods


@dataclass
class Row:
    """One (point, method) cell."""

    method: str
    length: int
    batch: int
    ms_per_token: float | None = None
    host_ms: float | None = None
    ttft_ms: float | None = None
    steps: int = 0
    captures: int = 0
    density: float | None = None  # the prefill selection's own kept fraction (planted or not)
    planted: float | None = None
    copy_tbps: float | None = None
    kv_floor_ms: float | None = None  # dense K+V bytes of one step / the measured copy rate
    device: str = ""
    compiled: bool = False  # decode steps through torch.compile (--compile)
    compiles: int = 0  # frames torch.compile compiled during the cell's decode
    compile_s: float | None = None  # host time those compiles took
    notes: list[str] = field(default_factory=list)  # failures
    notes_info: str = ""  # what the cell measured beside the times


# -------------------------------------------------------------------------------------------- model
def llama31_model(layers: int | None, device: str, seed: int = 0):
    """Llama-3.1-8B's architecture from conf/model/llama31.yaml, random weights, bf16, eval mode."""
    arch = yaml.safe_load((ROOT / "conf/model/llama31.yaml").read_text())["arch"]
    cfg = LlamaConfig(hidden_size=arch["hidden_size"], intermediate_size=14336, vocab_size=128256,
                      num_hidden_layers=layers or arch["num_layers"], num_attention_heads=arch["num_heads"],
                      num_key_value_heads=arch["num_kv_heads"], head_dim=arch["head_dim"],
                      max_position_embeddings=arch["max_position_embeddings"], rope_theta=arch["rope_theta"],
                      rope_scaling=dict(arch["rope_scaling"]), tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def smoke_model(device: str):
    """2 layers, 4 query / 2 KV heads of 16: the --smoke path's model (CPU)."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ methods
def saap_runtime(model, cache, t: int, *, top_l: int, clusters: int, hidden: int, window: int, seed: int = 0,
                 classifiers: str = "kv"):
    """A SAAP runtime whose centroids are a 5-iteration k-means (calib's torch backend, on the GPU) of
    each KV head's own de-RoPE'd prompt keys outside the window, as calibration would fit them (layer 0
    dense), with every layer's index built from ``cache`` (``t`` prompt keys); random classifiers, one
    per query head or (``classifiers="kv"``) one per KV head. Returns the runtime and the mean share of
    the bucket keys that lie in the ℓ largest buckets (the worst case of a step)."""
    cfg = model.config
    d = cfg.head_dim
    hq = cfg.num_key_value_heads if classifiers == "kv" else cfg.num_attention_heads  # classifiers per layer
    dev = cache.keys[0].device
    wdt = cache.keys[0].dtype
    rotary = model.model.rotary_emb
    gen = torch.Generator(device=dev).manual_seed(seed)
    pos = torch.arange(1, max(2, t - window + 1), device=dev)  # bucket candidates: sink and window excluded
    cos, sin = rotary(torch.empty(0, dtype=torch.float32, device=dev), pos[None])
    layers = [SaapLayerParams(sink=1, recent=window - 1, dense=True)]
    for layer in range(1, cfg.num_hidden_layers):
        keys = derope(cache.keys[layer][:1, :, pos], cos, sin)[0]  # [Hkv, N, D] float32
        cents = fit_kmeans_heads(keys, min(clusters, keys.shape[1]), 5, seed=seed + layer, backend="torch")
        r = lambda *s, sc=1.0: torch.randn(*s, generator=gen, device=dev) * sc  # noqa: E731
        layers.append(SaapLayerParams(
            sink=1, recent=window - 1, centroids=cents, w1=r(hq, d, hidden, sc=d ** -0.5).to(wdt),
            b1=r(hq, hidden, sc=0.1), bn_mean=r(hq, hidden, sc=0.1), bn_var=torch.rand(hq, hidden, device=dev) + 0.5,
            bn_weight=r(hq, hidden), bn_bias=r(hq, hidden, sc=0.1), w2=r(hq, hidden, cents.shape[1],
                                                                           sc=hidden ** -0.5).to(wdt),
            b2=r(hq, cents.shape[1], sc=0.1)))
    rt = SaapDecode(layers, top_l=top_l, stats=False)
    ctx = AttentionPositions(rotary)
    shares = []
    for layer in range(1, cfg.num_hidden_layers):
        rt.build_index(layer, cache.keys[layer][:, :, :t], ctx)
        counts = rt.index[layer].bucket_count.double()  # [B, Hkv, C]
        shares.append(float((counts.topk(min(top_l, counts.shape[-1]), -1).values.sum(-1)
                             / counts.sum(-1).clamp(min=1)).mean()))
    return rt, statistics.mean(shares)


def prefill_runtime(name: str, layers: int, heads: int):
    if name == "sale":
        return SalePrefill(torch.full((layers, heads), 0.008))
    return SampleAttentionPrefill(BucketRow(0.95, 0.9, 2), report_cra=False)


class PlantedMasks:
    """Replace the prefill selections' masks by planted ones of ``density`` of the causal blocks (diagonal
    blocks always kept; ``random_block_mask`` of ``bench_prefill.py``) before the block-sparse attention;
    ``density`` 0 keeps the selection's own mask. Records the density each selection produced."""

    def __init__(self, density: float) -> None:
        self.density = density
        self.selected: list[float] = []
        self._cache: dict[tuple, object] = {}

    def install(self) -> None:
        original = bs_api.block_sparse_attention

        def planted(q, k, v, mask, **kw):
            self.selected.append(float(mask.density().float().mean()))
            if self.density > 0:
                mask = self._planted(mask, q.device)
            return original(q, k, v, mask, **kw)

        bs_api.block_sparse_attention = planted
        sa_api.block_sparse_attention = planted

    def _planted(self, mask, device):
        key = (mask.heads, mask.seq_q, mask.block_q, mask.block_k)
        if key not in self._cache:
            self._cache[key] = random_block_mask(mask.heads, mask.seq_q, mask.block_q, mask.block_k,
                                                 self.density, seed=0, device=device)
        return self._cache[key]


# --------------------------------------------------------------------------------------------- cell
def copy_rate_tbps() -> float:
    """Device-to-device copy rate of a 2 GiB buffer (read + write bytes / time), median of 5."""
    a = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del a, b
    return 2 * 2 * (1 << 30) / (statistics.median(times[1:]) * 1e-3) / 1e12


def _timed(fn, cuda: bool) -> tuple[object, float]:
    if not cuda:
        t0 = time.perf_counter()
        return fn(), (time.perf_counter() - t0) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    out = fn()
    e.record()
    e.synchronize()
    return out, s.elapsed_time(e)


def replicate_prefill(gen, prompt: torch.Tensor) -> None:
    """Prefill row 0 with ``prompt [1, T]`` and copy its cache to every row: the decode cost does not depend
    on the rows' content, and prefilling B long prompts at once would not fit beside the cache."""
    cache = gen.cache
    full_k, full_v, batch = cache.keys, cache.values, cache.batch
    cache.keys, cache.values, cache.batch = [k[:1] for k in full_k], [v[:1] for v in full_v], 1
    token = gen.token
    gen.token = token[:1]
    try:
        gen.prefill(prompt)
    finally:
        cache.keys, cache.values, cache.batch, gen.token = full_k, full_v, batch, token
    t = prompt.shape[1]
    for k, v in zip(full_k, full_v):
        k[1:, :, :t].copy_(k[:1, :, :t])
        v[1:, :, :t].copy_(v[:1, :, :t])
    token[1:].copy_(token[:1])


def run_cell(method: str, t: int, b: int, compiled: bool, args: argparse.Namespace) -> Row:
    cuda = not args.smoke
    device = "cuda" if cuda else "cpu"
    row = Row(method, t, b, device=torch.cuda.get_device_name() if cuda else "cpu", compiled=compiled)
    if cuda:
        row.copy_tbps = copy_rate_tbps()
    model = smoke_model(device) if args.smoke else llama31_model(args.layers, device)
    cfg = model.config
    kv_bytes = 2 * cfg.num_hidden_layers * b * cfg.num_key_value_heads * t * cfg.head_dim * 2
    if row.copy_tbps:
        row.kv_floor_ms = kv_bytes / (row.copy_tbps * 1e12) * 1e3
    prompt = torch.randint(cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(1)).to(device)
    if method == "hf-generate":
        return hf_generate_cell(model, prompt, args, row)
    prefill_name = method.split("+")[0] if method.split("+")[0] in PREFILL_METHODS else None
    planted = None
    if prefill_name:
        planted = PlantedMasks(args.density)
        planted.install()
        hf.attach(model, prefill=prefill_runtime(prefill_name, cfg.num_hidden_layers, cfg.num_attention_heads))
        row.planted = args.density or None
    gen = StaticGenerator(model, batch=b, max_len=t + args.steps + 8, graphs=cuda, compile=compiled,
                          fuse_projections=not args.unfused)
    if b == 1:
        gen.prefill(prompt)  # warm-up: compilation, autotuning, allocator
        _, row.ttft_ms = _timed(lambda: gen.prefill(prompt), cuda)
    else:
        replicate_prefill(gen, prompt)
    if planted is not None and planted.selected:
        n = cfg.num_hidden_layers
        row.density = statistics.mean(planted.selected[-n:])
    decode = None
    if method.endswith("saap"):
        win, top_l = (args.saap_window, args.saap_top_l) if not args.smoke else (64, 4)
        decode, share = saap_runtime(model, gen.cache, t, top_l=top_l,
                                     clusters=1024 if not args.smoke else 16, hidden=1024 if not args.smoke else 32,
                                     window=win, classifiers=args.saap_classifiers)
        row.notes_info = (f"l = {top_l}, window {win}, a classifier per {args.saap_classifiers} head: top-l buckets "
                          f"hold <= {share:.1%} of the bucket keys")
    elif method == "dense-flash":
        decode = FlashDecode()
    elif method == "no-attention":
        decode = NoAttention()
    elif method.startswith("santa"):
        tiling, s = ("prop", 128) if method == "santa-prop" else ("flash", 2048)
        decode = SantaDecode([s] * cfg.num_hidden_layers, tiling=tiling, tile=256, seed=0)
    if decode is not None:
        state = getattr(model, "calib_attention", None)
        hf.attach(model, prefill=state.prefill if state else None, decode=decode)
    times = StepTimes()
    gen.decode(args.steps, times)
    if args.profile and cuda:
        print_profile(gen, method)
    if times.step_ms:
        row.ms_per_token = statistics.median(times.step_ms)
        row.host_ms = statistics.median(times.host_ms)
    row.steps, row.captures = len(times.step_ms), times.captures
    if args.unfused:
        row.notes_info = "; ".join(x for x in (row.notes_info, "projections unfused") if x)
    if compiled:
        row.compiles, row.compile_s = times.compiles, times.compile_ms / 1e3
    return row


class NoAttention:
    """Attention that reads no key or value (it returns the query): what a decode step or a prefill costs
    outside attention (weights, norms, MLP, LM head, the cache write), the floor below which no attention
    method can take it. A measuring device, never a runtime."""

    method = "none"
    phase = "both"

    def prefill(self, layer, q, k, v, scale, ctx):
        return q.clone()

    def observe_prefill(self, layer, q, k, v, ctx) -> None:
        """Nothing to build."""

    def decode(self, layer, q, k, v, scale, ctx):
        return q.clone()


def print_profile(gen, method: str, steps: int = 2) -> None:
    """GPU time per kernel over ``steps`` more replayed steps (torch.profiler), to stderr."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.decode(steps)
        torch.cuda.synchronize()
    print(f"--- {method}: kernels over {steps} steps", file=sys.stderr)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60),
          file=sys.stderr)


def hf_generate_cell(model, prompt, args, row: Row) -> Row:
    """transformers' own ``generate`` (default cache, dense): TTFT and ms/token from two calls."""
    def gen(n: int):
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    gen(2)  # warm-up
    _, one = _timed(lambda: gen(1), not args.smoke)
    _, many = _timed(lambda: gen(args.steps + 1), not args.smoke)
    row.ttft_ms, row.ms_per_token, row.steps = one, (many - one) / args.steps, args.steps
    return row


# ------------------------------------------------------------------------------------------- driver
def cells(args: argparse.Namespace) -> list[tuple[str, int, int, bool]]:
    """(method, T, B, compiled) per cell; ``hf-generate`` runs uncompiled only (its own loop)."""
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    out = []
    for point in args.points.split(","):
        t, b = (int(x) for x in point.split("x"))
        for compiled in modes:
            for m in args.methods.split(","):
                if (b > 1 and m not in DECODE_ONLY_AT_BATCH) or (compiled and m == "hf-generate"):
                    continue
                out.append((m, t, b, compiled))
    return out


def run_child(method: str, t: int, b: int, compiled: bool, args: argparse.Namespace) -> Row:
    """Run one cell in a fresh process; its Row comes back as JSON on the last stdout line."""
    cmd = [sys.executable, __file__, "--one", f"{method}@{t}x{b}", "--steps", str(args.steps),
           "--density", str(args.density), "--compile", "on" if compiled else "off"]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--saap-top-l", str(args.saap_top_l), "--saap-window", str(args.saap_window),
            "--saap-classifiers", args.saap_classifiers]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--profile"] if args.profile else []
    cmd += ["--unfused"] if args.unfused else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if args.profile:
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        row = Row(method, t, b, compiled=compiled, notes=["failed: " + " | ".join(tail)])
        print(f"{method} {t}x{b}: FAILED {tail}", file=sys.stderr)
        return row
    return Row(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _best_dense(rows: list[Row]) -> dict[tuple[int, int, bool], Row]:
    """Per point and loop (compiled or not), the faster of the two dense decode paths (SDPA on the
    masked view, flash-decoding)."""
    best: dict[tuple[int, int, bool], Row] = {}
    for r in rows:
        if r.method in ("dense", "dense-flash") and r.ms_per_token:
            cur = best.get((r.length, r.batch, r.compiled))
            if cur is None or r.ms_per_token < cur.ms_per_token:
                best[(r.length, r.batch, r.compiled)] = r
    return best


def _notes(r: Row) -> str:
    parts = r.notes + ([r.notes_info] if r.notes_info else [])
    if r.compile_s is not None:
        parts.append(f"compiled {r.compiles} frames in {r.compile_s:.0f} s host")
    return f" ({'; '.join(parts)})" if parts else ""


def print_table(rows: list[Row]) -> None:
    """Ratios: decode against the faster dense path at the point in the same loop, compiled against
    the same method uncompiled, TTFT against dense (SDPA) prefill (prefill is never compiled)."""
    dense = _best_dense(rows)
    # prefill is never compiled: either dense row's TTFT will do, the uncompiled one where both ran
    sdpa = {(r.length, r.batch): r for r in sorted(rows, key=lambda r: -r.compiled) if r.method == "dense"}
    plain = {(r.method, r.length, r.batch): r for r in rows if not r.compiled}
    print("| T | B | method | compiled | ms/token | x dense | x uncompiled | host ms/step | TTFT ms | x dense "
          "| KV floor ms | selected density |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        d, s = dense.get((r.length, r.batch, r.compiled)), sdpa.get((r.length, r.batch))
        u = plain.get((r.method, r.length, r.batch)) if r.compiled else None
        dec = d.ms_per_token / r.ms_per_token if d and r.ms_per_token else None
        gain = u.ms_per_token / r.ms_per_token if u and u.ms_per_token and r.ms_per_token else None
        ttft = s.ttft_ms / r.ttft_ms if s and s.ttft_ms and r.ttft_ms else None
        print(f"| {r.length} | {r.batch} | {r.method}{_notes(r)} | {'yes' if r.compiled else 'no'} "
              f"| {_f(r.ms_per_token)} | {_f(dec)} | {_f(gain)} | {_f(r.host_ms, '.3f')} | {_f(r.ttft_ms, '.0f')} "
              f"| {_f(ttft)} | {_f(r.kv_floor_ms)} | {_f(r.density, '.3f')} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=",".join(POINTS), help="TxB list, e.g. 32768x1,65536x8")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}, hf-generate")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per cell (>= 20)")
    ap.add_argument("--density", type=float, default=0.10, help="planted prefill mask density (0: the selection's)")
    ap.add_argument("--saap-top-l", type=int, default=32, help="SAAP's buckets per step (l)")
    ap.add_argument("--saap-window", type=int, default=2048, help="SAAP's dense window (sink + recent keys)")
    ap.add_argument("--saap-classifiers", choices=("query", "kv"), default="kv",
                    help="one SAAP classifier per KV head (calib's default, the paper's batched search, §5) or per query head")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (debugging)")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    ap.add_argument("--profile", action="store_true", help="print each cell's kernel times (stderr)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, short prompts: checks the script")
    ap.add_argument("--compile", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                    help="decode steps through torch.compile (bare flag: on); both: every cell both ways")
    ap.add_argument("--unfused", action="store_true",
                    help="keep the model's q/k/v and gate/up projections as separate GEMMs (StaticGenerator's "
                         "fuse_projections off: what fusing them gains)")
    ap.add_argument("--table", type=Path, nargs="+", default=None, help="print the table of saved --json files")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # method@TxB: run one cell in this process
    args = ap.parse_args(argv)
    if args.smoke and args.points == ",".join(POINTS):
        args.points = "300x1,300x2"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        rows = [Row(**r) for path in args.table for r in json.loads(path.read_text())]
        print_table(rows)
        return 0
    if args.one:
        method, point = args.one.split("@")
        t, b = (int(x) for x in point.split("x"))
        print(json.dumps(asdict(run_cell(method, t, b, args.compile == "on", args))))
        return 0
    print(f"# bench_generate {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch "
          f"{torch.__version__}", file=sys.stderr)
    rows = []
    for method, t, b, compiled in cells(args):
        rows.append(run_child(method, t, b, compiled, args))
        r = rows[-1]
        compile_note = f", compiled {r.compiles} frames in {_f(r.compile_s, '.1f')} s host" if compiled else ""
        print(f"{method} {t}x{b}: {_f(r.ms_per_token)} ms/token, TTFT {_f(r.ttft_ms, '.0f')} ms{compile_note}",
              file=sys.stderr)
        if args.json:
            args.json.write_text(json.dumps([asdict(x) for x in rows], indent=1))
    devices = sorted({r.device for r in rows if r.device})
    rates = [r.copy_tbps for r in rows if r.copy_tbps]
    print(f"device: {', '.join(devices)}; copy rate {_f(statistics.median(rates) if rates else None)} TB/s")
    print_table(rows)
    return 0 if all(not r.notes for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
