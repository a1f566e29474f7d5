"""SALE: theta controls sparsity monotonically — a Hydra multirun over theta, summarized and plotted.

    python scripts/research/sale_theta_sweep.py                                  # tiny: theta = 0.025, 0.05, 0.1
    python scripts/research/sale_theta_sweep.py --thetas 0.2 0.4 0.8 -- model=llama31 device=cuda
    python scripts/research/sale_theta_sweep.py --from multirun/<date>/<time>       # only summarize a finished sweep

Runs ``python -m calib run -m +method=sale method.theta=a,b,c hydra.sweep.dir=<dir> [overrides]`` (each
job registers a ``sale-<model>`` version and writes ``<dir>/<job>/result.json``), then reads every job's
result and prints a table (theta, mean block sparsity on the calibration samples, sparsity per data length,
worst per-head Err, model URI), writes ``sale_theta_sweep.png`` and ``sale_theta_sweep.json`` into the sweep
dir, and logs both to an MLflow run ``sale-theta-sweep-<model>`` in the same tracking store (skip with
``--no-mlflow``). Exit status 1 when sparsity is not non-decreasing in theta. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from matplotlib.figure import Figure  # noqa: E402

from calib import tracking  # noqa: E402
from calib.config import compose  # noqa: E402

# mlflow is imported in log_to_mlflow only: a --no-mlflow summary needs none.

DEFAULT_THETAS = (0.025, 0.05, 0.1)  # around tiny's theta (conf/model/tiny.yaml method_defaults.sale.theta)


def run_sweep(thetas: Sequence[float], sweep_dir: Path, overrides: Sequence[str]) -> None:
    """The Hydra multirun itself (one job per theta, sequential)."""
    cmd = [sys.executable, "-m", "calib", "run", "-m", "+method=sale",
           "method.theta=" + ",".join(f"{t:g}" for t in thetas), f"hydra.sweep.dir={sweep_dir}",
           "method.report=full", *overrides]  # full: the sparsity-by-length rows this sweep plots
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def read_results(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's ``result.json`` under ``sweep_dir``, sorted by theta."""
    rows = []
    for path in sorted(sweep_dir.glob("*/result.json")):
        result = json.loads(path.read_text())
        m = result["metrics"]
        rows.append({"theta": m["theta"], "sparsity": m["sparsity"], "err_worst": m["err_worst"],
                     "dense_head_fraction": m.get("dense_head_fraction"),
                     "by_length": {int(k.rsplit("_", 1)[1]): v for k, v in m.items() if k.startswith("sparsity_at_")},
                     "model_uri": result.get("model_uri"), "run_id": result.get("run_id")})
    if not rows:
        raise SystemExit(f"no */result.json under {sweep_dir}: did the multirun finish?")
    return sorted(rows, key=lambda r: r["theta"])


def is_monotone(rows: Sequence[dict[str, Any]]) -> bool:
    """Mean sparsity non-decreasing in theta."""
    s = [r["sparsity"] for r in rows]
    return all(a <= b + 1e-12 for a, b in zip(s, s[1:]))


def plot(rows: Sequence[dict[str, Any]], title: str) -> Any:
    """Left: mean sparsity vs theta; right: sparsity vs prompt length, one line per theta."""
    fig = Figure(figsize=(10, 3.8))
    ax, bx = fig.subplots(1, 2)
    ax.plot([r["theta"] for r in rows], [r["sparsity"] for r in rows], marker="o")
    ax.set_xscale("log")
    ax.set(xlabel="error bound theta", ylabel="mean block sparsity (calibration samples)", ylim=(0, 1), title=title)
    ax.grid(True, alpha=0.3)
    for r in rows:
        lengths = sorted(r["by_length"])
        bx.plot(lengths, [r["by_length"][n] for n in lengths], marker="o", label=f"theta={r['theta']:g}")
    bx.set_xscale("log", base=2)
    all_lengths = sorted({n for r in rows for n in r["by_length"]})
    bx.set_xticks(all_lengths, [str(n) for n in all_lengths])
    bx.minorticks_off()
    bx.set(xlabel="prompt length (tokens)", ylabel="block sparsity (held-out prompts)", ylim=(0, 1),
           title="sparsity vs length")
    bx.grid(True, alpha=0.3)
    bx.legend()
    fig.tight_layout()
    return fig


def log_to_mlflow(rows: Sequence[dict[str, Any]], fig: Any, summary: dict[str, Any], overrides: Sequence[str]) -> str:
    """One MLflow run holding the sweep's plot and numbers; returns its run id."""
    import mlflow

    cfg = compose(["+method=sale", *[o for o in overrides if not o.startswith("hydra")]])
    target = tracking.resolve_target(cfg.get("tracking"))
    tags = {"kind": "sweep", "method": "sale"}
    with tracking.start_run(target, f"sale-theta-sweep-{cfg.model.name}", tags=tags) as run:
        for step, r in enumerate(rows):
            mlflow.log_metric("sparsity", r["sparsity"], step=step)
            mlflow.log_metric("theta", r["theta"], step=step)
        mlflow.log_metric("monotone", float(summary["monotone"]))
        mlflow.log_dict(summary, "sale_theta_sweep.json")
        tracking.log_figure(fig, "plots/sale_theta_sweep.png")
        return run.info.run_id


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thetas", type=float, nargs="+", default=list(DEFAULT_THETAS))
    parser.add_argument("--from", dest="from_dir", type=Path, default=None, help="summarize this finished sweep dir")
    parser.add_argument("--dir", type=Path, default=None, help="sweep dir (default multirun/sale-theta-<time>)")
    parser.add_argument("--no-mlflow", action="store_true")
    ns = parser.parse_args(own)
    if len(set(ns.thetas)) < 2 and ns.from_dir is None:
        parser.error("give at least two distinct --thetas")
    sweep_dir = ns.from_dir or ns.dir or ROOT / "multirun" / time.strftime("sale-theta-%Y-%m-%d_%H-%M-%S")
    if ns.from_dir is None:
        run_sweep(ns.thetas, sweep_dir.resolve(), overrides)
    rows = read_results(sweep_dir)
    summary = {"sweep_dir": str(sweep_dir), "monotone": is_monotone(rows), "rows": rows}
    print(f"{'theta':>8} {'sparsity':>9} {'err_worst':>10} {'dense':>6}  per length", file=sys.stderr)
    for r in rows:
        per_len = " ".join(f"{n}:{v:.3f}" for n, v in sorted(r["by_length"].items()))
        print(f"{r['theta']:>8g} {r['sparsity']:>9.4f} {r['err_worst']:>10.4g} {r['dense_head_fraction'] or 0:>6.2f}  "
              f"{per_len}  {r['model_uri']}", file=sys.stderr)
    fig = plot(rows, "SALE: sparsity vs theta")
    fig.savefig(sweep_dir / "sale_theta_sweep.png", dpi=120)
    (sweep_dir / "sale_theta_sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not ns.no_mlflow:
        summary["mlflow_run_id"] = log_to_mlflow(rows, fig, summary, overrides)
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["monotone"] else 1


if __name__ == "__main__":
    sys.exit(main())
