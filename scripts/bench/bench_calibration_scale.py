"""Cost of calibrating each method at a model's full size, on random weights (``model.init=random``).

    python scripts/bench/bench_calibration_scale.py                              # all four methods, llama31
    python scripts/bench/bench_calibration_scale.py --methods saap,sale -- data.lengths=[32768]
    python scripts/bench/bench_calibration_scale.py --methods saap --set saap:method.prompts=8 --json saap.json

Each method runs as ``python -m calib run +method=<m> model=<model> model.init=random <overrides>`` in a
fresh process with its own ``CALIB_HOME`` (a new MLflow store and an empty collection cache, unless
``--home`` names a shared one), so one method's cache or memory never helps another's figures. Printed
per method: wall time, every ``time_<stage>_s`` of the result JSON, ``peak_gpu_mem_gb`` (logged by
``calib.run``), the process's peak host RSS (``wait4``'s ``ru_maxrss``) and the artifact's size on disk. The
figures measure cost only: the weights are random, and the run and its artifact are marked as a dry run.
Overrides after ``--`` go to every method; ``--set <method>:<key>=<value>`` to one. A method that fails is
reported with its exit code and the last line of its stderr (the full log is kept in the home).

On a GPU box without network (no Hydra, OmegaConf, MLflow or Faiss there: SAAP's k-means then runs in torch):
build their wheels with ``scripts/offline_wheels.sh``, install them with ``pip install --no-index --no-deps
--target /tmp/site .whl/*.whl`` and ``export PYTHONPATH=/tmp/site``; this script, which imports only the
standard library, passes ``PYTHONPATH`` on. Results: docs/results/scale.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("saap", "sale", "sampleattention", "santa")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(options, overrides)``: the arguments before ``--`` and the calib overrides after it."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def parse_sets(items: list[str]) -> dict[str, list[str]]:
    """``["saap:method.prompts=8", ...]`` -> ``{"saap": ["method.prompts=8"], ...}``."""
    out: dict[str, list[str]] = {}
    for item in items:
        method, sep, override = item.partition(":")
        if not sep or "=" not in override:
            raise SystemExit(f"error: --set takes <method>:<key>=<value>, got {item!r}")
        out.setdefault(method, []).append(override)
    return out


def directory_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def logged_stage_times(db: Path) -> dict[str, float]:
    """The ``time_<stage>_s`` metrics the newest run in the MLflow SQLite store ``db`` logged (each stage
    logs its time when it ends), so a run killed in a long stage still reports the stages before it.
    Read with the standard library's sqlite3; ``{}`` when there is no store or no run."""
    if not db.is_file():
        return {}
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        try:
            rows = con.execute(
                "SELECT key, value FROM latest_metrics WHERE key LIKE 'time\\_%' ESCAPE '\\' AND run_uuid = "
                "(SELECT run_uuid FROM runs ORDER BY start_time DESC, rowid DESC LIMIT 1)").fetchall()
        except sqlite3.Error:
            return {}
    return {key: float(value) for key, value in rows}


def calib_env(home: Path) -> dict[str, str]:
    """The environment of a calib process on the store in ``home``: ``CALIB_HOME``, the checkout on
    ``PYTHONPATH`` (before what was there), no inherited MLflow URIs (the store is the home's)."""
    env = {**os.environ, "CALIB_HOME": str(home),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        env.pop(var, None)
    return env


def run_logged(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> dict:
    """Run ``cmd``, a calib command printing its result JSON as the last stdout line, stderr into
    ``log_path`` and stdout (Hydra's log lines: the recipes' INFO and warnings) into ``<log>.stdout.log``:
    ``exit_code``, ``wall_s``, ``peak_host_rss_gb`` (``wait4``'s ``ru_maxrss``), ``log`` and either ``result``
    (that JSON) or ``error`` (the timeout, or the log's last line)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=log, text=True)
        timed_out = False
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        while not pid:
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
                timed_out = True
                pid, status, usage = os.wait4(proc.pid, 0)
            else:
                time.sleep(0.2)
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: tell Popen
        out.seek(0)
        text = out.read()
        log_path.with_suffix(".stdout.log").write_text(text)
        lines = text.strip().splitlines()
    row = {"exit_code": proc.returncode, "wall_s": time.perf_counter() - t0,
           "peak_host_rss_gb": usage.ru_maxrss * 1024 / 1e9, "log": str(log_path)}
    if timed_out:
        return {**row, "error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode == 0 and lines:
        try:
            return {**row, "result": json.loads(lines[-1])}
        except json.JSONDecodeError:
            return {**row, "error": f"last stdout line is not JSON: {lines[-1][:200]}"}
    tail = log_path.read_text().strip().splitlines()
    return {**row, "error": tail[-1] if tail else f"exit {proc.returncode}"}


def run_method(method: str, model: str, overrides: list[str], home: Path, timeout_s: float,
               init: str = "random", env: dict[str, str] | None = None) -> dict:
    """One ``calib run`` in a fresh process; its result JSON's figures plus wall time and peak RSS.
    ``init="pretrained"`` runs the model's real weights, not a dry run. ``env``: the process's environment
    (default :func:`calib_env` of ``home``). The row keeps the run's whole ``metrics`` and its
    ``artifact_dir``."""
    home.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "calib", "run", f"+method={method}", f"model={model}", f"model.init={init}",
           *overrides]
    done = run_logged(cmd, env if env is not None else calib_env(home), home / f"{method}.log", timeout_s)
    row: dict = {"method": method, "cmd": shlex.join(cmd), **{k: v for k, v in done.items() if k != "result"}}
    if "error" in done or "artifact_dir" not in done.get("result", {}):
        row.setdefault("error", "the result names no artifact_dir")
        row.update(logged_stage_times(home / "artifacts" / "mlflow.db"))  # the stages that finished
        return row
    result = done["result"]
    metrics = result.get("metrics", {})
    row.update({k: v for k, v in metrics.items() if k.startswith("time_") or k == "peak_gpu_mem_gb"})
    row["artifact_mb"] = directory_bytes(Path(result["artifact_dir"])) / 1e6
    row["model_uri"] = result.get("model_uri")
    row["artifact_dir"] = result["artifact_dir"]
    row["metrics"] = metrics
    return row


def format_rows(rows: list[dict]) -> str:
    """A Markdown table: method, wall, every stage time any method reported, memory, artifact size."""
    stages = sorted({k for r in rows for k in r if k.startswith("time_")})
    head = ["method", "exit", "wall_s", *stages, "peak_gpu_mem_gb", "peak_host_rss_gb", "artifact_mb"]

    def cell(value: object) -> str:
        return f"{value:.1f}" if isinstance(value, float) else ("-" if value is None else str(value))

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r.get(k, r.get("exit_code") if k == "exit" else None)) for k in head) + " |"
              for r in rows]
    errors = [f"{r['method']}: {r['error']} (log: {r['log']})" for r in rows if "error" in r]
    return "\n".join(lines + errors)


def main(argv: list[str] | None = None) -> int:
    argv, common = split_overrides(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: all four)")
    parser.add_argument("--model", default="llama31", help="a conf/model name (default llama31)")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                        help="an override for one method (repeatable)")
    parser.add_argument("--home", type=Path, default=None,
                        help="one CALIB_HOME for all methods (default: a fresh directory per method)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per method (default 3600)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--init", choices=("random", "pretrained"), default="random",
                        help="model.init: random (a dry run, the default) or pretrained (real weights)")
    args = parser.parse_args(argv)
    per_method = parse_sets(args.set)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"error: unknown methods {unknown}: choose from {', '.join(METHODS)}")
    base = Path(tempfile.mkdtemp(prefix="calib-scale-"))
    rows = []
    for method in methods:
        home = args.home or base / method
        print(f"[{method}] running in {home} ...", file=sys.stderr, flush=True)
        rows.append(run_method(method, args.model, [*common, *per_method.get(method, [])], home, args.timeout,
                               init=args.init))
        print(f"[{method}] exit {rows[-1]['exit_code']} after {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
