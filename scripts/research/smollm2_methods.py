"""The four methods calibrated and held out on a real model: ``calib run`` then ``calib eval`` per method.

    python scripts/research/smollm2_methods.py --home /tmp/h --out smollm2_methods.json        # GPU, all four
    python scripts/research/smollm2_methods.py --methods sale --eval-prompts 4 --home /tmp/h --out x.json -- device=cpu

Per method, in fresh processes sharing one ``CALIB_HOME`` (``--home``; the converted checkpoint and the
MLflow store live there): ``python -m calib run +method=<m> model=<model> <overrides>`` (wall time per
stage, peak memory, artifact size: :func:`bench_calibration_scale.run_method`), then ``python -m calib
eval model=<model> artifact=<its artifact dir> eval.num_prompts=<n>`` on the model's default eval set (its
kept cells), with the real-text NLL. SANTA first runs ``python -m calib.santa.sweep`` over
``--santa-sweep`` budgets per layer and trains at a starved budget picked the way the tiny model's was:
the uniform schedule's held-out reward inside 0.3-0.7, nearest 0.5 (:func:`pick_starved_budget`).

``--out`` is rewritten after every step, and a method whose run and eval are already in it is skipped,
so a call stopped by a time limit continues where it stopped. The script imports only the standard
library (the runs need Hydra, OmegaConf and MLflow: on the GPU box carry their wheels, see
``scripts/bench/bench_calibration_scale.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # scripts/bench/: the runner
from bench_calibration_scale import (METHODS, ROOT, calib_env, parse_sets, run_method,  # noqa: E402
                                     split_overrides)

STARVED_BAND = (0.3, 0.7)


def last_json_line(cmd: list[str], home: Path, log_name: str, timeout_s: float) -> dict:
    """Run ``cmd`` (a calib command printing its result JSON as the last stdout line); the JSON plus
    ``wall_s``, or ``error`` with the log's last line."""
    log_path = home / log_name
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=calib_env(home), stdout=subprocess.PIPE, stderr=log,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s", "log": str(log_path)}
    wall = time.perf_counter() - t0
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text().strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {proc.returncode}", "log": str(log_path), "wall_s": wall}
    return {**json.loads(lines[-1]), "wall_s": wall, "log": str(log_path)}


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


def save(out: Path, rows: dict) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1, default=str))
    tmp.replace(out)


def run_one(method: str, args: argparse.Namespace, run_overrides: list[str], rows: dict, out: Path) -> None:
    """Sweep (SANTA), calibrate, evaluate ``method``; each finished step saved into ``rows[method]``."""
    row = rows.setdefault(method, {})
    if method == "santa" and "sweep" not in row:
        cmd = [sys.executable, "-m", "calib.santa.sweep", f"model={args.model}", f"sweep={args.santa_sweep}",
               *run_overrides, f"rl.heldout_questions={args.sweep_questions}"]
        row["sweep"] = last_json_line(cmd, args.home, "santa_sweep.log", args.timeout)
        if "uniform_reward" in row["sweep"]:
            row["starved"] = pick_starved_budget(row["sweep"]["uniform_reward"])
        save(out, rows)
    if method == "santa" and "starved" in row:
        run_overrides = [*run_overrides, f"rl.budget_per_layer={row['starved']['budget_per_layer']}"]
    if row.get("run", {}).get("exit_code") != 0:
        print(f"[{method}] calib run ...", file=sys.stderr, flush=True)
        row["run"] = run_method(method, args.model, run_overrides, args.home, args.timeout, init="pretrained")
        save(out, rows)
        if row["run"]["exit_code"] != 0:
            return
    if "error" in row.get("eval", {"error": "not run"}):
        print(f"[{method}] calib eval ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "calib", "eval", f"model={args.model}", f"artifact={row['run']['artifact_dir']}",
               f"eval.num_prompts={args.eval_prompts}", f"eval.batch_tokens={args.batch_tokens}", *args.eval_set]
        row["eval"] = last_json_line(cmd, args.home, f"{method}_eval.log", args.timeout)
        save(out, rows)


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def summary_table(rows: dict) -> str:
    """One line per method: held-out accuracy dense / sparse, difference and CI, worst cell's CI lower
    bound, the method's sparsity figure, NLL increase, calibration wall time."""
    head = ["method", "dense", "sparse", "diff [95% CI]", "worst cell CI low", "sparsity", "NLL +%", "calib s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, row in rows.items():
        ev, run = row.get("eval", {}), row.get("run", {})
        m = ev.get("metrics", {})
        lows = [v for k, v in m.items() if k.endswith(".diff_ci_low") and "@" in k]
        sparsity = ev.get("summary", {}).get("summary/sparsity")
        nll = m.get("nll_increase")
        lines.append("| " + " | ".join([
            method, fmt(m.get("dense_acc")), fmt(m.get("sparse_acc")),
            f"{fmt(m.get('diff'), '+.3f')} [{fmt(m.get('diff_ci_low'), '+.3f')}, {fmt(m.get('diff_ci_high'), '+.3f')}]",
            fmt(min(lows) if lows else None, "+.3f"), fmt(sparsity), fmt(None if nll is None else 100 * nll, "+.2f"),
            fmt(run.get("wall_s"), ".0f")]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv, common = split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: all four)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--home", type=Path, required=True, help="CALIB_HOME shared by every run and eval")
    parser.add_argument("--out", type=Path, required=True, help="JSON of every step (resumed when it exists)")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                        help="a calib run override for one method (repeatable)")
    parser.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a calib eval override (repeatable)")
    parser.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts per kept cell")
    parser.add_argument("--batch-tokens", type=int, default=65536, help="eval.batch_tokens")
    parser.add_argument("--santa-sweep", default="1,2,4,8", help="budgets per layer of SANTA's uniform sweep")
    parser.add_argument("--sweep-questions", type=int, default=200, help="held-out questions of the sweep")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"error: unknown methods {unknown}: choose from {', '.join(METHODS)}")
    args.home.mkdir(parents=True, exist_ok=True)
    rows = json.loads(args.out.read_text()) if args.out.is_file() else {}
    per_method = parse_sets(args.set)
    for method in methods:
        run_one(method, args, [*common, *per_method.get(method, [])], rows, args.out)
    print(summary_table({m: rows[m] for m in methods if m in rows}))
    failed = [m for m in methods if "error" in rows.get(m, {}).get("eval", {"error": 1})]
    for m in failed:
        bad = rows.get(m, {})
        print(f"{m}: {bad.get('run', {}).get('error') or bad.get('eval', {}).get('error')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
