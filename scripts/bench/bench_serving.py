"""Serving speed of a real model with its calibrated artifacts, beside the same artifacts' held-out accuracy.

    python scripts/bench/bench_serving.py --model smollm2 --artifact saap=DIR --artifact santa=DIR \
        --artifact sale=DIR --artifact sampleattention=DIR --accuracy saap=EVAL.json ... --json serving.json
    python scripts/bench/bench_serving.py --smoke         # CPU, the embedded tiny model: checks the script

Every configuration (method x compiled) runs in its own process, which loads the model once and walks the
grid, warming each point up before timing it. Prompts are windows of the shipped novel, one per batch row.
All through :class:`runtime_kernels.generate.StaticGenerator` with ``hf.apply``'s serving default
(``serve="fastest"``: a method runs only in the layers and shapes where it times faster than dense):

* decode: median device ms of ``--steps`` graph replays at each ``B x T``; tokens/s = B / that;
* TTFT: the prompt's forward pass and first token at ``--ttft-batches``, the median of 15 or more (two seconds
  of calls), the garbage collector off, timed in ABBA pairs with dense in the same process; × dense is to that
  (the median of the per-pair ratios; for the ``dense`` row: dense against itself, the noise of a ratio at
  that point), beside it that median's 95 % interval (``paired.py``): a cell is below dense only where all
  of it is;
* second: first token to second (a kept graph's replay, or the method's per-request set-up: SAAP's index
  build, the step's warm-up and capture), host wall time, 3 or more (a quarter second of steps), paired likewise;
* ragged: ``--ragged`` rows of lengths spread over [T/4, T], prefilled in runs of close lengths and decoded
  together; tokens/s of the whole generation (prefill included), 15 or more (host-bound), paired likewise;
* traffic (``--prompts FILE``, JSONL as ``calib eval data=jsonl`` reads): your own prompts, ``--ragged`` rows
  at a time (the last batch filled from the file's start), ``--steps`` new tokens each; ms for the whole
  file and tokens/s of the new tokens, paired likewise, and how many prompts the method continues exactly as
  dense does (greedy, ``--steps`` tokens: no labels needed) and where its prefill layers went;
  ``--lengths ''`` for this row alone;
* beside every row: the KV-read floor (the dense K+V bytes of a step / the copy rate measured here),
  the ``no-attention`` step or prefill (everything but attention: the floor of any method), peak GPU memory,
  and the held-out accuracy of the same artifact given with ``--accuracy`` (a ``calib eval`` result JSON).

``--profile DIR`` also writes, per TTFT point and ragged row, ``torch.profiler`` tables of one prefill (one
generation) with the method and one with its prefill switched off: where the host and the device spend the time.

Methods: ``dense`` (the loop's default: flash-decoding on the valid length), ``sdpa`` (transformers' SDPA on
the masked cache view), ``no-attention``, and each ``--artifact``. Speed only, no held-out accuracy:
``--saap-top-l L`` serves the SAAP artifact with ℓ = L in every layer; ``--santa-samples S`` serves SANTA
without an artifact, S samples in every layer (what a sampled step costs where no artifact is at hand).
Results: docs/results/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "bench"):  # run from a checkout without `pip install -e .`
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import calib.config  # noqa: E402,F401  (registers the ${calib_root:} resolver the model files use)
from bench_generate import NoAttention  # noqa: E402  (the no-attention step: every decode method's floor)
from benchutil import measured_copy_tbps  # noqa: E402
from calib.data.rows import read_jsonl  # noqa: E402
from calib.errors import UserError  # noqa: E402
from calib.models import load_model  # noqa: E402
from calib.perplexity import real_text_path  # noqa: E402
from runtime_kernels import hf  # noqa: E402
from runtime_kernels.generate import StaticGenerator, StepTimes  # noqa: E402
from runtime_kernels.ragged import ragged_runs  # noqa: E402
from runtime_kernels.santa.runtime import SantaDecode  # noqa: E402
from paired import SECOND_MIN_S, Paired, dense_prefill, paired_ms  # noqa: E402
from traffic import batches, prompt_ids  # noqa: E402

PREFILL_METHODS = ("sale", "sampleattention")
TTFT_REPEATS = 15  # timed prefills per TTFT point and path (the medians are reported)
SECOND_REPEATS = 3  # timed first-to-second-token intervals per point and path (each with a prefill before it)
RAGGED_REPEATS = 15  # timed generations of the ragged batch per path (host-bound: its wall time moves with the host)


@dataclass
class Row:
    """One measurement: ``kind`` decode, ttft, second, ragged or traffic at (T, B)."""

    method: str
    kind: str
    length: int
    batch: int
    compiled: bool
    ms: float | None = None  # decode: ms per step; ttft: ms; second: first to second token; ragged: whole generation
    tokens_per_s: float | None = None
    kv_floor_ms: float | None = None
    peak_gb: float | None = None
    dense_layers: int | None = None  # decode: at the last view; ttft: in one prefill (layers not running the method)
    note: str = ""
    dense_ms: float | None = None  # ttft / second / ragged: dense's, timed alternately in this process (dense: itself)
    ratio: float | None = None  # paired rows: the median per-pair dense / method (× dense)
    ratio_ci: tuple[float, float] | None = None  # and its 95 % interval


@dataclass
class Setup:
    """What a child process needs (parsed from the command line)."""

    model: str
    artifacts: dict[str, str]
    lengths: list[int]
    batches: list[int]
    ttft_batches: list[int]
    ragged: int
    steps: int
    gguf: str | None
    smoke: bool
    profile: Path | None = None
    saap_top_l: int | None = None  # ℓ in every SAAP layer instead of the artifact's (speed only)
    santa_samples: int | None = None  # SANTA with this many samples in every layer, no artifact (speed only)
    unfused: bool = False  # the model's q/k/v and gate/up projections as separate GEMMs (the loop fuses them)
    prompts: Path | None = None  # a JSONL file of the user's own prompts: the traffic row
    copy_tbps: float | None = None
    rows: list[Row] = field(default_factory=list)


# ------------------------------------------------------------------------------------------- pieces
def load(setup: Setup):
    """The model (eval mode, bf16 on CUDA) and its tokenizer, as ``calib`` loads them."""
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{setup.model}.yaml")
    if setup.gguf:
        cfg.gguf.path = setup.gguf
    return load_model(cfg, device="cpu" if setup.smoke else "cuda")


def text_rows(tokenizer, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """``[batch, length]`` token windows of the shipped novel at seeded offsets (rows overlap only where
    the text is too short for all of them)."""
    ids = tokenizer(real_text_path().read_text(encoding="utf-8"), add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) <= length:
        raise SystemExit(f"the shipped text has {len(ids)} tokens, fewer than {length}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (batch,), generator=gen).tolist()
    return torch.tensor([ids[s:s + length] for s in starts])


def attach(model, method: str, setup: Setup) -> None:
    """Put ``method``'s serving configuration on ``model``."""
    hf.remove(model)
    if method in setup.artifacts:
        options = None
        if method == "saap" and setup.saap_top_l:
            options = {"saap": {"top_l": setup.saap_top_l, "top_l_layers": {}}}
        hf.apply(model, setup.artifacts[method], options=options)
    elif method == "santa" and setup.santa_samples:  # the flash tiling at its defaults, policy as hf.apply's
        schedule = [setup.santa_samples] * model.config.num_hidden_layers
        hf.attach(model, decode=SantaDecode(schedule), serve="fastest")
    elif method == "no-attention":  # the floor of a decode step and of a prefill
        floor = NoAttention()
        hf.attach(model, prefill=floor, decode=floor)
    elif method != "dense" and method != "sdpa":
        raise SystemExit(f"unknown method {method!r}: give its artifact with --artifact {method}=DIR")


def _peak_gb(cuda: bool) -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if cuda else None


def _event_ms(fn, cuda: bool) -> float:
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def kv_floor_ms(model, batch: int, length: int, tbps: float | None) -> float | None:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nbytes = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * length * head_dim * 2
    return nbytes / (tbps * 1e12) * 1e3 if tbps else None


# -------------------------------------------------------------------------------------------- cells
def generator(model, batch: int, max_len: int, compiled: bool, method: str, setup: Setup):
    gen = StaticGenerator(model, batch=batch, max_len=max_len, graphs=not setup.smoke, compile=compiled,
                          fuse_projections=not setup.unfused)
    if method == "sdpa":
        hf.remove(model)  # the loop then runs the model's own attention on the masked view
    return gen


def decode_row(model, tok, method: str, t: int, b: int, compiled: bool, setup: Setup) -> Row:
    cuda = not setup.smoke
    row = Row(method, "decode", t, b, compiled, kv_floor_ms=kv_floor_ms(model, b, t, setup.copy_tbps))
    prompts = text_rows(tok, b, t).to(model.device)
    gen = generator(model, b, t + 2 * setup.steps + 8, compiled, method, setup)
    gen.prefill(prompts)
    gen.decode(setup.steps // 2)  # warm-up: the first views' captures, compiles and serving timings
    times = StepTimes()
    gen.decode(setup.steps, times)
    if times.step_ms:
        row.ms = statistics.median(times.step_ms)
    elif times.host_ms or not cuda:
        row.ms = _event_ms(lambda: gen.decode(2), cuda) / 2
    row.tokens_per_s = b / row.ms * 1e3 if row.ms else None
    state = getattr(model, "calib_attention", None)
    row.dense_layers = len(state.serve_dense) if state is not None and state.decode is not None else None
    row.peak_gb = _peak_gb(cuda)
    return row


def _paired_fields(paired: Paired) -> dict:
    """A row's fields from a :func:`paired.paired_ms` measurement."""
    return {"ms": paired.ms, "dense_ms": paired.dense_ms, "ratio": paired.ratio,
            "ratio_ci": (paired.ratio_low, paired.ratio_high)}


def ttft_row(model, tok, method: str, t: int, b: int, setup: Setup) -> Row:
    """TTFT of ``method`` and dense's, timed alternately in this process (for dense: an A/A pair; a prefill
    of a small model is launch-bound, and its time moves more between processes than between the two paths)."""
    cuda = not setup.smoke
    prompts = text_rows(tok, b, t, seed=1).to(model.device)
    gen = generator(model, b, t + 8, False, method, setup)
    paired = paired_ms(model, lambda: _event_ms(lambda: gen.prefill(prompts), cuda), TTFT_REPEATS)
    if setup.profile is not None:
        profile_prefill(model, lambda: gen.prefill(prompts), setup.profile / f"ttft_{method}_T{t}_B{b}.txt")
    return Row(method, "ttft", t, b, False, tokens_per_s=b * t / paired.ms * 1e3, peak_gb=_peak_gb(cuda),
               dense_layers=prefill_dense_layers(model, lambda: gen.prefill(prompts)), **_paired_fields(paired))


def profile_prefill(model, prefill, path: Path) -> None:
    """Where a prefill's time goes: ``torch.profiler`` tables (ops by host time and by device time) of one
    ``prefill()`` with the attached method and, for a method, one with its prefill switched off
    (:func:`dense_prefill`), each after a warm-up, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    paths = {"method": contextlib.nullcontext}
    if getattr(getattr(model, "calib_attention", None), "prefill", None) is not None:
        paths["dense in this process"] = lambda: dense_prefill(model)
    parts = []
    for name, context in paths.items():
        with context():
            prefill()
            with profile(activities=activities) as prof:
                wall = _wall_ms(prefill, torch.cuda.is_available())
        table = prof.key_averages()
        parts.append(f"## {name}: {wall:.2f} ms host wall time\n\n"
                     f"{table.table(sort_by='self_cpu_time_total', row_limit=25)}\n"
                     + (f"{table.table(sort_by='self_cuda_time_total', row_limit=15)}\n" if len(activities) > 1 else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))


def prefill_dense_layers(model, prefill) -> int | None:
    """Layers of one more ``prefill()`` that did not run the attached prefill method (the serving policy's
    choice, or a dense layer of the artifact); None without a prefill method."""
    state = getattr(model, "calib_attention", None)
    if state is None or state.prefill is None or state.serve != "fastest":
        return None
    state.prefill_chooser.reset_counts()
    prefill()
    return int(model.config.num_hidden_layers) - state.prefill_chooser.method_calls


def ragged_prefill_layers(model, generate, lengths: list[list[int]]) -> str:
    """Where the prefill layers of one more ``generate()`` of ragged batches of ``lengths`` (one list per
    batch) went: ran the method, went dense (the layer's timing or the artifact), or never asked (the
    whole-prefill check switched the method off); '' without a prefill method."""
    state = getattr(model, "calib_attention", None)
    if state is None or state.prefill is None or state.serve != "fastest":
        return ""
    alone = not getattr(state.prefill, "ragged_prefill", False)
    calls = sum(len(ragged_runs(batch, alone)) if len(set(batch)) > 1 else 1 for batch in lengths)
    chooser = state.prefill_chooser
    chooser.reset_counts()
    generate()
    layers = int(model.config.num_hidden_layers) * calls
    return (f"prefill layers of {calls} calls: {chooser.method_calls} method, {chooser.dense_calls} dense, "
            f"{layers - chooser.method_calls - chooser.dense_calls} method off")


def _wall_ms(fn, cuda: bool) -> float:
    """Host wall time of ``fn`` from an idle device to its work done (host-side work such as a graph
    capture counts)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def second_row(model, tok, method: str, t: int, b: int, setup: Setup) -> Row:
    """Time from the first token to the second: after each prefill the loop brings the method's state to
    the step (SAAP builds its index from the cache), warms the step up and captures its graph, then
    replays it. A method's row also times dense alternately in this process (:func:`dense_prefill`
    switches the decode method off too)."""
    cuda = not setup.smoke
    prompts = text_rows(tok, b, t, seed=2).to(model.device)
    gen = generator(model, b, t + 8, False, method, setup)

    view_ms: list[float] = []  # the method's calls only (not those under dense_prefill)

    def second() -> float:
        gen.prefill(prompts)
        times = StepTimes()
        ms = _wall_ms(lambda: gen.decode(1, times), cuda)
        if getattr(getattr(model, "calib_attention", None), "decode", None) is not None:
            view_ms.append(times.view_ms)
        return ms

    paired = paired_ms(model, second, SECOND_REPEATS, SECOND_MIN_S)
    note = f"of which view upkeep {statistics.median(view_ms):.2f} ms" if view_ms else ""
    return Row(method, "second", t, b, False, peak_gb=_peak_gb(cuda), note=note, **_paired_fields(paired))


def ragged_row(model, tok, method: str, t: int, b: int, compiled: bool, setup: Setup) -> Row:
    cuda = not setup.smoke
    gen_lengths = torch.Generator().manual_seed(2)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=gen_lengths).tolist()
    rows = [text_rows(tok, 1, n, seed=3 + i)[0].tolist() for i, n in enumerate(lengths)]
    gen = generator(model, b, t + setup.steps + 8, compiled, method, setup)
    generate = lambda: gen.generate(rows, setup.steps)  # noqa: E731
    paired = paired_ms(model, lambda: _event_ms(generate, cuda), RAGGED_REPEATS)
    if setup.profile is not None:
        profile_prefill(model, generate, setup.profile / f"ragged_{method}_T{t}_B{b}.txt")
    return Row(method, "ragged", t, b, compiled, tokens_per_s=b * setup.steps / paired.ms * 1e3, peak_gb=_peak_gb(cuda),
               note=ragged_prefill_layers(model, generate, [lengths]), **_paired_fields(paired))


def traffic_row(model, tok, method: str, compiled: bool, setup: Setup) -> Row:
    """The user's prompts (``--prompts``), ``--ragged`` rows at a time, ``--steps`` new tokens each: ms for
    the whole file and tokens/s of the new tokens; ``T`` is the longest prompt."""
    cuda = not setup.smoke
    ids = prompt_ids(setup.prompts, tok, model.config.max_position_embeddings - setup.steps - 8)
    groups = batches(ids, setup.ragged)
    longest = max(len(row) for row in ids)
    gen = generator(model, setup.ragged, longest + setup.steps + 8, compiled, method, setup)
    whole = lambda: sum(_event_ms(lambda: gen.generate(g, setup.steps), cuda) for g in groups)  # noqa: E731
    paired = paired_ms(model, whole, RAGGED_REPEATS)
    new_tokens = setup.ragged * setup.steps * len(groups)
    same = continued_as_dense(model, gen, groups, setup.steps, len(ids))
    where = [ragged_prefill_layers(model, lambda: [gen.generate(g, setup.steps) for g in groups],
                                   [[len(row) for row in g] for g in groups]), decode_layers(model)]
    note = "; ".join([f"{len(ids)} prompts in {len(groups)} batches, {same} continued as dense does", *filter(None, where)])
    return Row(method, "traffic", longest, setup.ragged, compiled, tokens_per_s=new_tokens / paired.ms * 1e3,
               peak_gb=_peak_gb(cuda), note=note, **_paired_fields(paired))


def decode_layers(model) -> str:
    """How many layers the decode method ran in at the last step of the last generation (the serving policy
    serves a layer dense where the method timed slower); '' without a decode method."""
    state = getattr(model, "calib_attention", None)
    if state is None or state.decode is None:
        return ""
    layers = int(model.config.num_hidden_layers)
    return f"decode method in {layers - len(state.serve_dense)} of {layers} layers at the last step"


def continued_as_dense(model, gen, groups: list[list[list[int]]], steps: int, count: int) -> int:
    """How many of the first ``count`` prompts of ``groups`` (the file's own; later rows only fill the last
    batch) get the same ``steps`` greedy tokens with the method as with dense attention: on unlabelled
    traffic, the share of answers the artifact leaves as they were."""
    def continuations() -> list[list[int]]:
        return [row for g in groups for row in gen.generate(g, steps).tolist()][:count]

    method = continuations()
    with dense_prefill(model):
        dense = continuations()
    return sum(a == b for a, b in zip(method, dense))


def run_config(method: str, compiled: bool, setup: Setup) -> list[Row]:
    """Every point of the grid for one configuration, in this process."""
    cuda = not setup.smoke
    loaded = load(setup)
    model, tok = loaded.model, loaded.tokenizer
    if cuda:
        setup.copy_tbps = measured_copy_tbps()
    attach(model, method, setup)
    rows: list[Row] = []

    def guarded(fn, *a) -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            rows.append(fn(*a))
        except torch.cuda.OutOfMemoryError as exc:  # a failed point is a row, not a failed grid
            rows.append(Row(method, fn.__name__.removesuffix("_row"), a[3], a[4], compiled, note=f"OOM: {exc}"[:120]))
            torch.cuda.empty_cache()
        print(f"{method} {asdict(rows[-1])}", file=sys.stderr, flush=True)

    decodes = method not in PREFILL_METHODS
    for t in setup.lengths:
        if decodes:
            for b in setup.batches:
                guarded(decode_row, model, tok, method, t, b, compiled, setup)
        if not compiled and method != "santa":  # SANTA's prefill is dense; no-attention's is the TTFT floor
            for b in setup.ttft_batches:
                guarded(ttft_row, model, tok, method, t, b, setup)
        if not compiled and decodes and method != "no-attention":  # SAAP's index build lands here
            for b in setup.ttft_batches:
                guarded(second_row, model, tok, method, t, b, setup)
        if setup.ragged and method != "no-attention":
            guarded(ragged_row, model, tok, method, t, setup.ragged, compiled, setup)
    if setup.prompts is not None and method != "no-attention":
        guarded(traffic_row, model, tok, method, compiled, setup)
    speed_only = {"saap": setup.saap_top_l and f"ℓ = {setup.saap_top_l} in every layer: speed only",
                  "santa": setup.santa_samples and f"S = {setup.santa_samples} in every layer, no artifact: speed only"}
    if speed_only.get(method):
        for r in rows:
            r.note = "; ".join(x for x in (r.note, speed_only[method]) if x)
    return rows


# ------------------------------------------------------------------------------------------- driver
def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _interval(ci: Sequence[float] | None) -> str:
    return "-" if ci is None else f"{ci[0]:.2f}-{ci[1]:.2f}"


def accuracy_line(path: str) -> str:
    """The held-out figures of a ``calib eval`` result JSON: the paired difference and CI overall and
    per suite (``suite.<name>.diff`` metrics), and the method's sparsity."""
    metrics = json.loads(Path(path).read_text()).get("metrics", {})
    parts = []
    for prefix, label in [("", "all")] + [(f"suite.{s}.", s) for s in ("synthetic", "books")]:
        if f"{prefix}diff" in metrics:
            parts.append(f"{label} {metrics[f'{prefix}diff']:+.3f} ({metrics[f'{prefix}diff_ci_low']:+.3f}, "
                         f"{metrics[f'{prefix}diff_ci_high']:+.3f})")
    for name in ("sparsity", "selectivity", "sample_fraction"):
        if name in metrics:
            parts.append(f"{name} {metrics[name]:.2f}")
    return "; ".join(parts)


def print_tables(rows: list[Row], accuracy: dict[str, str]) -> None:
    dense = {(r.kind, r.length, r.batch, r.compiled): r for r in rows if r.method == "dense"}
    floor = {(r.kind, r.length, r.batch, r.compiled): r for r in rows if r.method == "no-attention"}
    print("| kind | T | B | method | compiled | ms | x dense | 95 % of pairs | tokens/s | KV floor ms "
          "| no-attention ms | dense layers | peak GB | held-out accuracy (sparse - dense) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r.kind, r.length, r.batch, r.compiled, r.method)):
        d = dense.get((r.kind, r.length, r.batch, r.compiled))
        reference = r.dense_ms or (d.ms if d else None)  # in-process dense (dense itself: A/A), else the dense row's
        ratio = r.ratio or (reference / r.ms if reference and r.ms else None)  # paired rows: the pairs' median
        none = floor.get((r.kind, r.length, r.batch, r.compiled))
        print(f"| {r.kind} | {r.length} | {r.batch} | {r.method}{f' ({r.note})' if r.note else ''} "
              f"| {'yes' if r.compiled else 'no'} | {_f(r.ms)} | {_f(ratio)} | {_interval(r.ratio_ci)} "
              f"| {_f(r.tokens_per_s, '.0f')} "
              f"| {_f(r.kv_floor_ms)} | {_f(none.ms if none else None)} | {_f(r.dense_layers, 'd')} "
              f"| {_f(r.peak_gb, '.1f')} | {accuracy.get(r.method, '')} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a conf/model/<name>.yaml")
    ap.add_argument("--gguf", default=None, help="the model's GGUF file, where its wheel is not installed")
    ap.add_argument("--artifact", action="append", default=[], help="METHOD=DIR, repeatable")
    ap.add_argument("--accuracy", action="append", default=[], help="METHOD=EVAL_RESULT.json, repeatable")
    ap.add_argument("--methods", default=None, help="comma list (default: dense, sdpa, no-attention, the artifacts)")
    ap.add_argument("--lengths", default="2048,4096,8000", help="prompt tokens T")
    ap.add_argument("--batches", default="1,8,32,64,128", help="decode batch sizes B")
    ap.add_argument("--ttft-batches", default="1,8", help="TTFT batch sizes")
    ap.add_argument("--ragged", type=int, default=16, help="rows of the ragged batch (0: none)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per point")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="a JSONL file of your own prompts (\"prompt\" or \"text\" per line): the traffic row, "
                         "generated --ragged rows at a time")
    ap.add_argument("--compile", default="both", choices=("off", "on", "both"))
    ap.add_argument("--config-timeout", type=float, default=900.0,
                    help="seconds one configuration may run; past it its stacks are printed and it is a failed row")
    ap.add_argument("--json", type=Path, default=None, help="write every row here (after each configuration)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="write torch.profiler tables of one prefill per TTFT point and one generation per ragged row here "
                         "(method and in-process dense)")
    ap.add_argument("--table", type=Path, nargs="+", default=None, help="print the tables of saved --json files")
    ap.add_argument("--saap-top-l", type=int, default=None,
                    help="serve SAAP with this ℓ in every layer instead of the artifact's (what a sparse step costs; "
                         "its accuracy is not the artifact's, so no --accuracy for saap)")
    ap.add_argument("--santa-samples", type=int, default=None,
                    help="serve SANTA with this many samples in every layer, without an artifact (what a sampled step "
                         "costs; no held-out accuracy, so no --accuracy for santa)")
    ap.add_argument("--unfused", action="store_true",
                    help="keep the q/k/v and gate/up projections separate GEMMs (what StaticGenerator's fusing gains)")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, short prompts: checks the script")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # METHOD:compiled in this process
    args = ap.parse_args(argv)
    if args.saap_top_l is not None and (args.saap_top_l < 1 or any(a.startswith("saap=") for a in args.accuracy)):
        ap.error("--saap-top-l takes an ℓ >= 1, and the artifact's held-out accuracy (--accuracy saap=) does not apply to it")
    if args.santa_samples is not None and (args.santa_samples < 1 or any(a.startswith("santa=") for a in args.accuracy)):
        ap.error("--santa-samples takes an S >= 1, and no held-out accuracy (--accuracy santa=) applies to it")
    if args.prompts is not None:
        if not args.prompts.is_file():
            ap.error(f"--prompts {args.prompts}: no such file")
        try:
            read_jsonl(args.prompts)  # a bad file fails here, in one line, before any model loads
        except UserError as exc:
            ap.error(str(exc))
        if args.ragged < 1:
            ap.error("--prompts generates --ragged rows at a time: give --ragged 1 or more")
    if args.smoke:
        args.model, args.lengths, args.batches, args.ttft_batches, args.ragged, args.steps, args.compile = (
            "tiny", "256", "1,2", "1", 2, 4, "off")
    return args


def setup_of(args: argparse.Namespace) -> Setup:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    artifacts = dict(a.split("=", 1) for a in args.artifact)
    return Setup(args.model, artifacts, ints(args.lengths), ints(args.batches), ints(args.ttft_batches),
                 args.ragged, args.steps, args.gguf, args.smoke, args.profile, args.saap_top_l,
                 santa_samples=args.santa_samples, unfused=args.unfused, prompts=args.prompts)


def run_child(method: str, compiled: bool, argv: list[str], timeout: float) -> list[Row]:
    """One configuration in its own process; a hung one prints its stacks (faulthandler) and fails."""
    try:
        proc = subprocess.run([sys.executable, __file__, *argv, "--one", f"{method}:{int(compiled)}"],
                              capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              timeout=timeout + 60)
    except subprocess.TimeoutExpired as exc:
        sys.stderr.write(str(exc.stderr or "")[-4000:])
        return [Row(method, "failed", 0, 0, compiled, note=f"no answer in {timeout + 60:.0f} s")]
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        return [Row(method, "failed", 0, 0, compiled, note=tail[:200])]
    return [Row(**r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    accuracy = {m: accuracy_line(p) for m, p in (a.split("=", 1) for a in args.accuracy)}
    if args.table:
        print_tables([Row(**r) for p in args.table for r in json.loads(p.read_text())], accuracy)
        return 0
    setup = setup_of(args)
    if args.one:
        faulthandler.dump_traceback_later(args.config_timeout, exit=True)  # a hang ends with its stacks
        method, compiled = args.one.split(":")
        print(json.dumps([asdict(r) for r in run_config(method, compiled == "1", setup)]))
        return 0
    extra = ["santa"] if setup.santa_samples and "santa" not in setup.artifacts else []
    methods = args.methods.split(",") if args.methods else ["dense", "sdpa", "no-attention", *setup.artifacts, *extra]
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    print(f"# bench_serving {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch "
          f"{torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", file=sys.stderr)
    rows: list[Row] = []
    for compiled in modes:
        for method in methods:
            rows += run_child(method, compiled, argv, args.config_timeout)
            if args.json:
                args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print_tables(rows, accuracy)
    return 0 if all(r.kind != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
