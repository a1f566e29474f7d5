"""Time each stage of the S²ANTA Triton decode kernels alone.

    python scripts/bench/bench_santa_stages.py                          # GPU: B in {1, 8}, T in {8k, 32k, 128k}
    python scripts/bench/bench_santa_stages.py --ptxas                  # no GPU: sm_90 registers / spills / smem
    python scripts/bench/bench_santa_stages.py --smoke                  # CPU, interpreter, tiny shapes
    python scripts/bench/bench_santa_stages.py --model smollm2 --batches 32 --lengths 8192

Llama-3.1-8B shapes (Hq = 32, Hkv = 8, D = 128, bf16, tile 256), or ``--model smollm2``'s (Hq = 9, Hkv = 3,
D = 64: head_dim 64 and GQA group 3), prop S = 128, flash S = 2048. Stages
(``runtime_kernels.santa.triton.santa_stages``; each launch alone, on buffers a full run filled):

* prop: ``scores`` (K pass: scores + tile statistics), ``budgets`` (largest remainder per head),
  ``gather`` (counts from the stored scores, sampled V rows, output), ``full`` (the three).
* flash: ``stream`` (one pass per tile: pipelined K chunks, then its counts, V rows and partial),
  ``merge`` (the log-sum-exp merge of the partials), ``full`` (the two).

Times: ``benchutil.cuda_time``, eager launches (the gaps between launches of ``full`` are included;
bench_decode.py's graphed column removes the CPU part). Bytes are what each stage must move (upper bounds for
sampled rows); TB/s = bytes / time; ``floor_us``: the dense K+V floor at ``benchutil.HBM_TBPS``.

``--ptxas`` compiles every kernel launch of every stage for sm_90 offline (Triton + its bundled ptxas)
and prints registers, spill stack and shared memory: the occupancy half of the story without a GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
if "--ptxas" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import yaml  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchutil import cuda_time, floor_ms  # noqa: E402

from runtime_kernels.santa import triton as tk  # noqa: E402
from runtime_kernels.santa import triton_flash, triton_prop, triton_score  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hq: int = 32
    hkv: int = 8
    d: int = 128
    tile: int = 256
    s_prop: int = 128
    s_flash: int = 2048


def model_shape(model: str) -> Shape:
    """The attention shapes of ``conf/model/<model>.yaml``'s ``arch`` (heads, KV heads, head_dim)."""
    arch = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())["arch"]
    return Shape(hq=arch["num_heads"], hkv=arch["num_kv_heads"], d=arch["head_dim"])


def _inputs(sh: Shape, b: int, t: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, sh.hq, sh.d, generator=g, device=device).to(dtype)
    k = torch.randn(b, sh.hkv, t, sh.d, generator=g, device=device).to(dtype)
    v = torch.randn(b, sh.hkv, t, sh.d, generator=g, device=device).to(dtype)
    u = torch.rand(b, sh.hq, -(-t // sh.tile), generator=g, dtype=torch.float64, device=device)
    return q, k, v, u, torch.full((b,), t, dtype=torch.int64, device=device)


def stage_bytes(sh: Shape, tiling: str, s: int, b: int, t: int, elem: int) -> dict[str, float]:
    """Bytes each stage moves: K, float32 scores, V rows sampled (upper bounds), partials."""
    n_tiles = -(-t // sh.tile)
    k_bytes = b * sh.hkv * t * sh.d * elem
    score_bytes = b * sh.hq * t * 4
    stats = 2 * b * sh.hq * n_tiles * 4
    if tiling == "prop":
        read_tiles = min(s, n_tiles)  # only tiles with a budget re-read their scores
        gather = b * sh.hq * (read_tiles * sh.tile * 4 + s * sh.d * elem) + b * sh.hq * n_tiles * 4
        budgets = stats + b * sh.hq * n_tiles * 4
        return {"scores": k_bytes + score_bytes + stats, "budgets": budgets, "gather": gather,
                "full": k_bytes + score_bytes + stats + budgets + gather}
    s_tile = max(1, (2 * s + n_tiles) // (2 * n_tiles))
    v_rows = b * sh.hq * n_tiles * s_tile * sh.d * elem
    partials = b * sh.hq * n_tiles * (2 + sh.d) * 4
    stream = k_bytes + score_bytes + v_rows + partials  # scores stored, then re-read from L2 (not counted)
    return {"stream": stream, "merge": partials, "full": stream + partials}


def _wall_ms(fn: Callable[[], object]) -> float:
    """Smoke-test timer (CPU, interpreter): meaningless, only exercises the script."""
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench(batches: list[int], lengths: list[int], sh: Shape, smoke: bool,
          tilings: tuple[str, ...] = ("prop", "flash")) -> list[tuple]:
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    rows = []
    for b in batches:
        for t in lengths:
            q, k, v, u, lens = _inputs(sh, b, t, device, dtype)
            elem = k.element_size()
            floor_us = floor_ms(2 * k.numel() * elem) * 1e3
            for tiling, s in (("prop", sh.s_prop), ("flash", sh.s_flash)):
                if tiling not in tilings:
                    continue
                n_s = torch.full((b,), s, dtype=torch.int64, device=device)
                stages = tk.santa_stages(q, k, v, n_s, tiling=tiling, tile=sh.tile, scale=sh.d ** -0.5,
                                         uniforms=u, cache_len=lens)
                nbytes = stage_bytes(sh, tiling, s, b, t, elem)
                for stage, fn in stages.items():
                    ms = _wall_ms(fn) if smoke else cuda_time(fn, warmup=5, repeats=30).median_ms
                    rows.append((tiling, stage, b, t, s, ms * 1e3, nbytes[stage], floor_us))
            del q, k, v
            if not smoke:
                torch.cuda.empty_cache()
    return rows


def print_table(rows: list[tuple]) -> None:
    head = f"{'method':<6} {'stage':<8} {'B':>2} {'T':>7} {'S':>5} {'us':>9} {'MB':>8} {'TB/s':>5} {'floor_us':>9}"
    print(head)
    print("-" * len(head))
    for tiling, stage, b, t, s, us, nbytes, floor_us in rows:
        print(f"{tiling:<6} {stage:<8} {b:>2} {t:>7} {s:>5} {us:>9.1f} {nbytes / 1e6:>8.1f} "
              f"{nbytes / (us * 1e-6) / 1e12:>5.2f} {floor_us:>9.1f}")


# ------------------------------------------------------------------------------ offline sm_90 compile

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32"}


class _Recorder:
    """Stands in for a jitted kernel: records ``kernel[grid](*args, **kw)`` instead of launching."""

    def __init__(self, fn, log: list) -> None:
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.fn, args, kw))


def _compile_one(fn, args: tuple, kw: dict) -> str:
    """sm_90 cubin of one recorded launch, specialized like a launch (ints == 1 constexpr, % 16 aligned)."""
    opts = {o: kw.pop(o) for o in ("num_warps", "num_stages", "maxnreg") if o in kw}
    kw.pop("launch_pdl", None)
    names = fn.arg_names
    sig, consts, attrs = {}, dict(kw), {}
    for i, (name, val) in enumerate(zip(names, args)):
        if isinstance(val, torch.Tensor):
            sig[name] = "*" + _TYPES[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, bool) or (isinstance(val, int) and val == 1):
            consts[name] = val
        elif isinstance(val, int):
            sig[name] = "i64" if abs(val) >= 2**31 else "i32"
            if val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    for name in consts:
        sig[name] = "constexpr"
    sig = {n: sig[n] for n in names}
    kern = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 64),
                          options=opts)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln.strip() for ln in res.splitlines() if "REG:" in ln), "?")
    fields = dict(x.split(":") for x in line.split() if ":" in x)
    return f"regs {fields.get('REG', '?'):>3} stack {fields.get('STACK', '?'):>3} " \
           f"smem {kern.metadata.shared / 1024:6.1f} KB warps {opts.get('num_warps', 4)}"


_KERNELS = ((triton_score, "_score_kernel"), (triton_prop, "_prop_budget_kernel"), (triton_prop, "_prop_gather_kernel"),
            (triton_flash, "_flash_stream_kernel"), (triton_flash, "_flash_merge_kernel"))


def ptxas_report(sh: Shape) -> None:
    """Record every launch of every stage (CPU tensors, no GPU) and compile it for sm_90."""
    log: list = []
    originals = [(module, name, getattr(module, name)) for module, name in _KERNELS]
    for module, name, fn in originals:
        setattr(module, name, _Recorder(fn, log))
    try:
        for t in (8192, 32768):  # flash's stream kernel looks samples up whole-tile below 128 tiles
            q, k, v, u, lens = _inputs(sh, 1, t, "cpu", torch.bfloat16)
            for tiling, s in (("prop", sh.s_prop), ("flash", sh.s_flash)):
                n_s = torch.full((1,), s, dtype=torch.int64)
                stages = tk.santa_stages(q, k, v, n_s, tiling=tiling, tile=sh.tile, scale=sh.d ** -0.5,
                                         uniforms=u, cache_len=lens)
                for stage, fn in stages.items():
                    if stage != "full":
                        fn()
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    seen: set[str] = set()
    for fn, args, kw in log:
        key = f"{fn.fn.__name__} {sorted(kw.items())}"
        if key in seen:
            continue
        seen.add(key)
        flags = {x: kw[x] for x in ("BK", "TPG", "STAGES", "MAXS", "CHUNKED") if x in kw}
        print(f"{fn.fn.__name__:<20} {str(flags):<56} {_compile_one(fn, args, dict(kw))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--ptxas", action="store_true", help="compile for sm_90 offline; print registers / smem")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768, 131072])
    p.add_argument("--tilings", nargs="+", choices=["prop", "flash"], default=["prop", "flash"])
    p.add_argument("--model", choices=sorted(f.stem for f in (ROOT / "conf" / "model").glob("*.yaml")),
                   default="llama31", help="whose attention shapes (conf/model/<model>.yaml; default llama31)")
    args = p.parse_args()
    shape = model_shape(args.model)
    if args.ptxas:
        ptxas_report(shape)
        return
    if args.smoke:
        sh = Shape(hq=4, hkv=2, d=32, tile=64, s_prop=16, s_flash=64)
        rows = bench([1], [300], sh, smoke=True, tilings=tuple(args.tilings))
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --smoke / --ptxas)")
        print(f"{torch.cuda.get_device_name()}  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}")
        rows = bench(args.batches, args.lengths, shape, smoke=False, tilings=tuple(args.tilings))
    print_table(rows)


if __name__ == "__main__":
    main()
