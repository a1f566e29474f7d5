"""Time to first artifact: each method's default ``python -m calib run +method=<m>``, wall time per stage.

Every job runs in a fresh Python process (as a new user runs it) with a private ``CALIB_HOME`` temporary
directory, so the user's MLflow store, registry and collector cache are never touched, and every job
starts cold (no cached collection). Per stage the times are the run's own ``time_<stage>_s`` metrics:
those of the result JSON (the last stdout line) and, for stages a recipe does not copy there (``publish``),
the metrics logged to the run's MLflow store. ``wall`` is the whole process, imports included; ``CPU`` its
user + system time (on a shared machine, CPU / cores is a closer guess of the idle wall time than wall).

    python scripts/bench/bench_cli.py                       # saap, sale, sampleattention, santa on `tiny`
    python scripts/bench/bench_cli.py --methods sale santa  # a subset
    python scripts/bench/bench_cli.py --methods sale -- method.report=full   # extra Hydra overrides per job

Prints a markdown table with the machine's core count and load average (a shared machine's timings are
upper bounds); ``--json PATH`` also writes the rows with each run's result metrics. Exit code 1 if a
job failed (its stderr tail printed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

# mlflow and calib.tracking are imported where a run's store is read: a script under scripts/bench imports no
# mlflow, Hydra or Faiss when it loads (a GPU box may have none of them).

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("saap", "sale", "sampleattention", "santa")


@dataclass
class JobTiming:
    """One default job: its stage times (seconds, in the order the run logged them) and its wall time."""

    method: str
    wall_s: float
    stages: dict[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0  # user + system CPU time of the job's process tree (busy cores x wall on a loaded box)
    ok: bool = True
    error: str = ""
    model_uri: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)  # the result JSON's metrics (for --json)


# the order the recipes run their stages in (a stage not listed goes after these, by name)
STAGE_ORDER = ("load", "data", "collect", "kmeans", "targets", "classifier", "calibrate", "tune", "reinforce",
               "heldout", "deploy", "eval", "report", "plots", "publish")


def in_stage_order(stages: dict[str, float]) -> dict[str, float]:
    """``stages`` ordered as the recipes run them (the MLflow store returns metrics in no fixed order)."""
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    return dict(sorted(stages.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def stage_times(metrics: dict[str, Any]) -> dict[str, float]:
    """``{stage: seconds}`` from flat metrics named ``time_<stage>_s`` (other keys ignored), in stage order."""
    return in_stage_order({k[len("time_"):-len("_s")]: float(v) for k, v in metrics.items()
                           if k.startswith("time_") and k.endswith("_s") and len(k) > len("time__s")})


def last_json_line(stdout: str) -> dict[str, Any]:
    """The CLI contract: ``run`` prints one JSON object as its last stdout line."""
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    if not lines:
        raise ValueError("the job printed nothing on stdout")
    return json.loads(lines[-1])


def mlflow_stage_times(home: Path, run_id: str) -> dict[str, float]:
    """The ``time_*_s`` metrics the run logged to the MLflow store under ``home`` (its CALIB_HOME)."""
    import mlflow

    from calib import tracking

    saved = os.environ.get("CALIB_HOME")
    os.environ["CALIB_HOME"] = str(home)
    try:
        target = tracking.resolve_target()
        client = mlflow.MlflowClient(tracking_uri=target.tracking_uri, registry_uri=target.registry_uri)
        return stage_times(client.get_run(run_id).data.metrics)
    finally:
        if saved is None:
            os.environ.pop("CALIB_HOME", None)
        else:
            os.environ["CALIB_HOME"] = saved


def _children_cpu_s() -> float:
    """User + system CPU seconds of every finished child process so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(method: str, overrides: Sequence[str], home: Path, timeout_s: float) -> JobTiming:
    """``python -m calib run +method=<method> [overrides]`` in a fresh process under ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(CALIB_HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "calib", "run", f"+method={method}", *overrides]
    print(f"+ {' '.join(cmd)}  (CALIB_HOME={home})", file=sys.stderr, flush=True)
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return JobTiming(method, time.perf_counter() - t0, ok=False, error=f"timed out after {timeout_s:g} s")
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        return JobTiming(method, wall, cpu_s=cpu, ok=False,
                         error=f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    try:
        result = last_json_line(proc.stdout)
    except ValueError as exc:
        return JobTiming(method, wall, cpu_s=cpu, ok=False, error=f"no result JSON: {exc}")
    stages = stage_times(result.get("metrics", {}))
    try:
        stages = in_stage_order({**mlflow_stage_times(home, result["run_id"]), **stages})
    except Exception as exc:  # noqa: BLE001 - the result JSON's stages still stand; say what is missing
        print(f"note: {method}: MLflow stage times unreadable ({exc}); result JSON stages only", file=sys.stderr)
    return JobTiming(method, wall, stages, cpu_s=cpu, model_uri=str(result.get("model_uri", "")),
                     metrics=dict(result.get("metrics", {})))


def markdown_table(rows: Sequence[JobTiming], cores: int | None, load: tuple[float, float, float] | None) -> str:
    """The report: one row per job (stages in seconds, their sum, the process wall time)."""
    head = f"CPU cores (os.cpu_count()): {cores}"
    if load is not None:
        head += f"; load average at start (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    lines = [head, "", "| method | stages (s) | sum of stages (s) | wall (s) | CPU (s) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        if not r.ok:
            reason = r.error.splitlines()[-1] if r.error else ""
            lines.append(f"| {r.method} | FAILED: {reason} | | {r.wall_s:.1f} | {r.cpu_s:.1f} |")
            continue
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r.stages.items()) or "(none logged)"
        lines.append(f"| {r.method} | {stages} | {sum(r.stages.values()):.1f} | {r.wall_s:.1f} | {r.cpu_s:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help=f"jobs to run (default: {' '.join(METHODS)})")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before a job is killed (default 3600)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    ns = ap.parse_args(argv)
    unknown = [m for m in ns.methods if m not in METHODS]
    if unknown:
        print(f"error: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows = []
    for method in ns.methods:
        with tempfile.TemporaryDirectory(prefix=f"bench_cli_{method}_") as home:
            rows.append(run_job(method, overrides, Path(home), ns.timeout))
        r = rows[-1]
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r.stages.items())
        print(f"{method}: {'ok' if r.ok else 'FAILED'} in {r.wall_s:.1f} s ({stages})", file=sys.stderr, flush=True)
        if not r.ok:
            print(r.error, file=sys.stderr)
    print(markdown_table(rows, os.cpu_count(), load))
    if ns.json is not None:
        ns.json.write_text(json.dumps({"cpu_count": os.cpu_count(), "load_average": load,
                                       "overrides": overrides, "jobs": [asdict(r) for r in rows]}, indent=2))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
