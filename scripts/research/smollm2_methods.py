"""Every method's default artifact calibrated and held out on a real model, close cells confirmed on more prompts.

    python scripts/research/smollm2_methods.py --home /tmp/h --out smollm2_methods.json --gpus 0,1,2,3
    python scripts/research/smollm2_methods.py --methods sale --eval-prompts 4 --confirm-prompts 0 \
        --home /tmp/h --out x.json -- device=cpu

Per method, in fresh processes: ``python -m calib run +method=<m> model=<model> <overrides>``, then ``python -m calib
eval model=<model> artifact=<its dir> eval.num_prompts=<n>`` on the model's kept cells. A cell whose paired-bootstrap
95 % lower bound of (sparse - dense) accuracy is below ``--bound`` is answered again on ``--confirm-prompts`` prompts
(``eval.cells=[...]``, the method's ``confirm`` step), and that figure decides it; so is every cell
``--confirm-cells`` names. A method holds on a suite
(books: the ``book_*`` cells; synthetic: the rest) when every kept cell does. ``--santa-sweep 1,2,4,8`` (for a model
whose conf sets no ``rl.budget_per_layer``) first sweeps SANTA's uniform budgets and trains at a starved one.
``--gpus`` runs one lane per GPU named (``0,0,0``: three on one GPU), a queue when methods outnumber lanes. A lane's processes see only its GPU, get
``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = cores // lanes (each torch process would start a thread per core: several
oversubscribe the CPU and stall their GPU launch loops) and their own ``CALIB_HOME`` ``<home>/lane<gpu>``: MLflow's
SQLite store is not safe for concurrent writers. Without ``--gpus`` one lane runs in ``--home``. Only this process
writes ``--out``, after every step; a step recorded without an error is skipped, so a stopped call resumes. The
tables go to stdout and ``<out stem>.md``; the exit code is 1 only when a step errored (a failing cell is a result).
Standard library only: the runs need Hydra, OmegaConf and MLflow (see ``scripts/bench/bench_calibration_scale.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # scripts/bench/: the runner helpers
from bench_calibration_scale import (METHODS, calib_env, parse_sets, run_logged, run_method,  # noqa: E402
                                     split_overrides)

STARVED_BAND = (0.3, 0.7)
BOUND_SLACK = 1e-9  # a lower bound equal to the bound up to float rounding holds
CELL_LOW = ".diff_ci_low"  # metrics key suffix of a cell's lower bound: "<task>@<length>.diff_ci_low"


@dataclass(frozen=True)
class Lane:
    """Where a queue of methods runs one step at a time: its ``CALIB_HOME`` and its processes' environment."""

    name: str
    home: Path
    env: dict[str, str]


def usable_cpus() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def make_lanes(home: Path, gpus: list[str], methods: int) -> list[Lane]:
    """One lane in ``home`` without ``gpus``; else one per entry of ``gpus`` (no more than ``methods``), each
    seeing only its GPU, with the cores shared out between the lanes. A GPU named again gets another lane
    (a small model leaves most of a GPU idle): lane ``gpu<id>`` in ``home/lane<id>``, its k-th repeat
    ``gpu<id>.<k>`` in ``home/lane<id>.<k>``."""
    if not gpus:
        return [Lane("", home, calib_env(home))]
    used = gpus[:max(1, methods)]
    threads = str(max(1, usable_cpus() // len(used)))
    lanes = []
    for i, gpu in enumerate(used):
        repeat = used[:i].count(gpu)
        tag = gpu if repeat == 0 else f"{gpu}.{repeat}"
        lanes.append(Lane(f"gpu{tag}", home / f"lane{tag}",
                          {**calib_env(home / f"lane{tag}"), "CUDA_VISIBLE_DEVICES": gpu,
                           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}))
    return lanes


class Record:
    """The rows of ``--out`` (method -> step -> result), shared by the lanes: a step is stored and the
    whole file rewritten under one lock."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: dict[str, dict] = json.loads(out.read_text()) if out.is_file() else {}
        self._lock = threading.Lock()

    def row(self, method: str) -> dict:
        """A copy of ``method``'s steps so far (only its own lane changes them)."""
        with self._lock:
            return dict(self.rows.get(method, {}))

    def put(self, method: str, step: str, result: dict) -> dict:
        with self._lock:
            self.rows.setdefault(method, {})[step] = result
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.rows, indent=1, default=str))
            tmp.replace(self.out)
        return result


def json_step(cmd: list[str], lane: Lane, log_name: str, timeout_s: float) -> dict:
    """A sweep's or an eval's row: its result JSON with ``cmd``, ``wall_s`` and ``log``, or ``error``."""
    done = run_logged(cmd, lane.env, lane.home / log_name, timeout_s)
    row = {"cmd": shlex.join(cmd), "wall_s": done["wall_s"], "log": done["log"]}
    return {**done["result"], **row} if "result" in done else {**row, "error": done["error"]}


def calib_run(method: str, model: str, overrides: list[str], lane: Lane, timeout_s: float) -> dict:
    """One ``calib run`` on the model's real weights in ``lane`` (:func:`bench_calibration_scale.run_method`):
    exit code, wall time, peak RSS, stage times, artifact size and dir, metrics; on failure the stages that
    finished."""
    return run_method(method, model, overrides, lane.home, timeout_s, init="pretrained", env=lane.env)


def pick_starved_budget(uniform: dict[str, dict], band: tuple[float, float] = STARVED_BAND) -> dict:
    """The budget per layer whose uniform reward is inside ``band`` and nearest its middle; when none is,
    the one nearest the band (``in_band`` False says so). ``uniform``: the sweep's ``uniform_reward``."""
    rows = [(int(k), v["reward"]) for k, v in uniform.items() if k.isdigit()]
    if not rows:
        raise ValueError("the sweep scored no budget per layer")
    mid = sum(band) / 2
    inside = [r for r in rows if band[0] <= r[1] <= band[1]]
    if inside:
        b, reward = min(inside, key=lambda r: (abs(r[1] - mid), r[0]))
    else:
        b, reward = min(rows, key=lambda r: (min(abs(r[1] - band[0]), abs(r[1] - band[1])), r[0]))
    return {"budget_per_layer": b, "uniform_reward": reward, "in_band": bool(inside)}


def cell_names(metrics: dict) -> list[str]:
    """The ``task@length`` cells an eval's ``metrics`` give a lower bound for."""
    return sorted(k[:-len(CELL_LOW)] for k in metrics if k.endswith(CELL_LOW) and "@" in k)


def holds(low: float, bound: float) -> bool:
    return low >= bound - BOUND_SLACK


def failing_cells(metrics: dict, bound: float) -> list[str]:
    """The cells whose paired-bootstrap 95 % lower bound of (sparse - dense) is below ``bound``."""
    return [c for c in cell_names(metrics) if not holds(metrics[c + CELL_LOW], bound)]


def confirm_cells(metrics: dict, args: argparse.Namespace) -> list[str]:
    """The kept cells to answer again: those below ``--bound``, and those ``--confirm-cells`` names (where an
    earlier artifact lost on more prompts than a clean 100-prompt interval can show)."""
    chosen = set(args.confirm_cells) | set(failing_cells(metrics, args.bound))
    return [c for c in cell_names(metrics) if c in chosen]


def suite_of(cell: str) -> str:
    return "books" if cell.split("@")[0].startswith("book_") else "synthetic"


def suites_for(cells: list[str]) -> list[str]:
    """The eval suites that hold ``cells``: ``eval.cells`` restricts a suite with some of its tasks among
    them, while a suite with none answers its whole default grid, so a rerun of some cells names only
    the suites they are in."""
    named = {suite_of(c) for c in cells}
    return [s for s in ("synthetic", "books") if s in named]


def eval_command(args: argparse.Namespace, artifact_dir: str, cells: list[str] | None = None) -> list[str]:
    """``calib eval`` of the artifact on the kept cells, or on ``cells`` only with ``--confirm-prompts``
    prompts each and no real-text NLL (the confirmation re-answers cells, nothing else)."""
    cmd = [sys.executable, "-m", "calib", "eval", f"model={args.model}", f"artifact={artifact_dir}"]
    if cells is None:
        return [*cmd, f"eval.num_prompts={args.eval_prompts}", f"eval.batch_tokens={args.batch_tokens}",
                *args.eval_set]
    replaced = ("eval.num_prompts=", "eval.cells=", "eval.nll.chunks=", "eval.suites=")
    return [*cmd, f"eval.num_prompts={args.confirm_prompts}", f"eval.batch_tokens={args.batch_tokens}",
            *[s for s in args.eval_set if not s.startswith(replaced)], "eval.nll.chunks=0",
            f"eval.suites=[{','.join(suites_for(cells))}]", f"eval.cells=[{','.join(cells)}]"]


def finished(row: dict, step: str) -> bool:
    return step in row and "error" not in row[step]


def progress(method: str, lane: Lane, what: str) -> None:
    print(f"[{method}{' on ' + lane.name if lane.name else ''}] {what} ...", file=sys.stderr, flush=True)


def santa_budget(lane: Lane, args: argparse.Namespace, overrides: list[str], record: Record) -> int | None:
    """SANTA's starved budget per layer from its uniform sweep (run unless recorded); None if it failed."""
    row = record.row("santa")
    if not finished(row, "sweep") or "starved" not in row:
        progress("santa", lane, "santa sweep")
        cmd = [sys.executable, "-m", "calib.santa.sweep", f"model={args.model}", f"sweep={args.santa_sweep}",
               *overrides, f"rl.heldout_questions={args.sweep_questions}"]
        sweep = json_step(cmd, lane, "santa_sweep.log", args.timeout)
        try:
            starved = None if "error" in sweep else pick_starved_budget(sweep.get("uniform_reward", {}))
        except ValueError as err:
            starved, sweep = None, {**sweep, "error": str(err)}
        record.put("santa", "sweep", sweep)
        if starved is None:
            return None
        row["starved"] = record.put("santa", "starved", starved)
    return int(row["starved"]["budget_per_layer"])


def run_one(method: str, lane: Lane, args: argparse.Namespace, overrides: list[str], record: Record) -> None:
    """Sweep (SANTA, with ``--santa-sweep``), calibrate, evaluate and confirm ``method`` in ``lane``; each
    step recorded when it ends, a step recorded without an error not run again."""
    if method == "santa" and args.santa_sweep:
        budget = santa_budget(lane, args, overrides, record)
        if budget is None:
            return
        overrides = [*overrides, f"rl.budget_per_layer={budget}"]
    row = record.row(method)
    if not finished(row, "run"):
        progress(method, lane, "calib run")
        row["run"] = record.put(method, "run", calib_run(method, args.model, overrides, lane, args.timeout))
        if "error" in row["run"]:
            return
    artifact = row["run"]["artifact_dir"]
    if not finished(row, "eval"):
        progress(method, lane, "calib eval")
        result = json_step(eval_command(args, artifact), lane, f"{method}_eval.log", args.timeout)
        row["eval"] = record.put(method, "eval", {**result, "prompts": args.eval_prompts})
        if "error" in row["eval"]:
            return
    cells = confirm_cells(row["eval"].get("metrics", {}), args) if args.confirm_prompts else []
    wanted = {"cells": cells, "prompts": args.confirm_prompts}
    if cells and not (finished(row, "confirm") and {k: row["confirm"].get(k) for k in wanted} == wanted):
        progress(method, lane, f"calib eval of {len(cells)} cells on {args.confirm_prompts} prompts")
        result = json_step(eval_command(args, artifact, cells), lane, f"{method}_confirm.log", args.timeout)
        record.put(method, "confirm", {**result, **wanted})


def run_all(methods: list[str], lanes: list[Lane], args: argparse.Namespace, overrides: dict[str, list[str]],
            record: Record) -> None:
    """Every method through :func:`run_one`, as many at once as there are lanes, each on a free lane."""
    free: queue.SimpleQueue[Lane] = queue.SimpleQueue()
    for lane in lanes:
        free.put(lane)

    def job(method: str) -> None:
        lane = free.get()
        try:
            run_one(method, lane, args, overrides.get(method, []), record)
        finally:
            free.put(lane)

    pool = ThreadPoolExecutor(max_workers=len(lanes))
    futures = [pool.submit(job, m) for m in methods]
    try:
        for future in futures:
            future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # stopped: no queued method starts


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def ci(diff: float | None, low: float | None, high: float | None) -> str:
    return f"{fmt(diff, '+.3f')} [{fmt(low, '+.3f')}, {fmt(high, '+.3f')}]"


def summary_table(rows: dict) -> str:
    """One line per method: held-out accuracy dense / sparse, difference and CI, worst cell's CI lower
    bound, the method's sparsity figure, NLL increase, calibration wall time."""
    head = ["method", "dense", "sparse", "diff [95% CI]", "worst cell CI low", "sparsity", "NLL +%", "calib s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, row in rows.items():
        ev, run = row.get("eval", {}), row.get("run", {})
        m = ev.get("metrics", {})
        lows = [v for k, v in m.items() if k.endswith(CELL_LOW) and "@" in k]
        sparsity = ev.get("summary", {}).get("summary/sparsity")
        nll = m.get("nll_increase")
        lines.append("| " + " | ".join([
            method, fmt(m.get("dense_acc")), fmt(m.get("sparse_acc")),
            ci(m.get("diff"), m.get("diff_ci_low"), m.get("diff_ci_high")),
            fmt(min(lows) if lows else None, "+.3f"), fmt(sparsity), fmt(None if nll is None else 100 * nll, "+.2f"),
            fmt(run.get("wall_s"), ".0f")]) + " |")
    return "\n".join(lines)


def step_prompts(step: dict) -> int | None:
    """Prompts per cell of an eval step: as requested, else its prompts shared out over its cells."""
    if "prompts" in step:
        return int(step["prompts"])
    total, cells = step.get("metrics", {}).get("num_prompts"), len(step.get("tasks", {}))
    return round(total / cells) if total and cells else None


def cell_results(row: dict, bound: float) -> list[dict]:
    """Per kept cell of ``row``'s eval, the figure that decides it (the confirmation's where that
    answered the cell, else the eval's) and whether its lower bound holds ``bound``."""
    ev, confirm = row.get("eval", {}), row.get("confirm", {})
    out = []
    for cell in cell_names(ev.get("metrics", {})):
        step = confirm if cell + CELL_LOW in confirm.get("metrics", {}) else ev
        m, task = step["metrics"], step.get("tasks", {}).get(cell, {})
        out.append({"cell": cell, "suite": suite_of(cell), "prompts": step_prompts(step),
                    "dense": task.get("dense"), "sparse": task.get("sparse"), "diff": m.get(f"{cell}.diff"),
                    "low": m[cell + CELL_LOW], "high": m.get(f"{cell}.diff_ci_high"),
                    "holds": holds(m[cell + CELL_LOW], bound)})
    return out


def cell_table(rows: dict, bound: float) -> str:
    """One line per method and kept cell: prompts, dense -> sparse, diff (CI), holds / fails ``bound``."""
    head = ["method", "cell", "prompts", "dense → sparse", "diff [95% CI]", f"CI low ≥ {bound:+.3f}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, row in rows.items():
        lines += [f"| {method} | {c['cell']} | {fmt(c['prompts'], 'd')} | {fmt(c['dense'])} → {fmt(c['sparse'])} | "
                  f"{ci(c['diff'], c['low'], c['high'])} | {'holds' if c['holds'] else 'fails'} |"
                  for c in cell_results(row, bound)]
    return "\n".join(lines)


def suite_verdicts(rows: dict, bound: float) -> list[tuple[str, str, int, list[str]]]:
    """``(method, suite, kept cells, failing cells)`` per method and suite of its kept cells."""
    out = []
    for method, row in rows.items():
        cells = cell_results(row, bound)
        for suite in sorted({c["suite"] for c in cells}, key=lambda s: s != "synthetic"):
            mine = [c for c in cells if c["suite"] == suite]
            out.append((method, suite, len(mine), [c["cell"] for c in mine if not c["holds"]]))
    return out


def verdict_table(rows: dict, bound: float) -> str:
    """One line per method and suite: ``holds`` when every kept cell holds, else the failing cells."""
    lines = ["| method | suite | kept cells | verdict |", "|---|---|---|---|"]
    lines += [f"| {m} | {s} | {n} | {'fails: ' + ', '.join(bad) if bad else 'holds'} |"
              for m, s, n, bad in suite_verdicts(rows, bound)]
    return "\n".join(lines)


def summary_markdown(rows: dict, bound: float) -> str:
    return "\n\n".join([summary_table(rows), cell_table(rows, bound), verdict_table(rows, bound)]) + "\n"


def step_errors(rows: dict, methods: list[str], args: argparse.Namespace) -> list[str]:
    """One line per method whose steps (those this call runs) ended in an error or never ran."""
    out = []
    for method in methods:
        row = rows.get(method, {})
        steps = [*(["sweep"] if method == "santa" and args.santa_sweep else []), "run", "eval",
                 *(["confirm"] if args.confirm_prompts else [])]
        bad = [f"{method} {s}: {row[s]['error']}" for s in steps if "error" in row.get(s, {})]
        out += bad or ([] if "eval" in row else [f"{method}: no eval"])
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: all four)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--home", type=Path, required=True, help="CALIB_HOME (with --gpus: the lanes' parent)")
    parser.add_argument("--out", type=Path, required=True, help="JSON of every step (resumed when it exists)")
    parser.add_argument("--gpus", default="", help="comma-separated GPU ids, one lane each; an id named again gets another lane on that GPU "
                        "(default: one lane)")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                        help="a calib run override for one method (repeatable)")
    parser.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a calib eval override (repeatable)")
    parser.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts per kept cell")
    parser.add_argument("--confirm-prompts", type=int, default=1000,
                        help="prompts per cell of the confirmation of the cells below --bound (0: none)")
    parser.add_argument("--confirm-cells", type=lambda v: [c for c in v.split(",") if c], default=[],
                        metavar="CELLS", help="comma-separated task@length cells always confirmed, e.g. niah_single@8192")
    parser.add_argument("--bound", type=float, default=-0.02, help="least 95 %% lower bound of sparse - dense")
    parser.add_argument("--batch-tokens", type=int, default=65536, help="eval.batch_tokens")
    parser.add_argument("--santa-sweep", default="", help="SANTA's uniform sweep budgets per layer, e.g. 1,2,4,8 "
                        "(default none: the model's configured rl.budget_per_layer)")
    parser.add_argument("--sweep-questions", type=int, default=200, help="held-out questions of the sweep")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    if args.confirm_prompts and args.confirm_prompts <= args.eval_prompts:
        parser.error("--confirm-prompts must exceed --eval-prompts (or be 0: no confirmation)")
    if args.out.suffix == ".md":
        parser.error("--out is the JSON; the summary goes beside it as <out stem>.md")
    return args


def main(argv: list[str] | None = None) -> int:
    argv, common = split_overrides(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    per_method = parse_sets(args.set)
    lanes = make_lanes(args.home, args.gpus, len(args.methods))
    for lane in lanes:
        lane.home.mkdir(parents=True, exist_ok=True)
    record = Record(args.out)
    run_all(args.methods, lanes, args, {m: [*common, *per_method.get(m, [])] for m in args.methods}, record)
    rows = {m: record.rows[m] for m in args.methods if m in record.rows}
    text = summary_markdown(rows, args.bound)
    args.out.with_suffix(".md").write_text(text)
    print(text, end="")
    errors = step_errors(record.rows, args.methods, args)
    for line in errors:
        print(line, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
