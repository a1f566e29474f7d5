"""SAAP's accuracy–selectivity curve: one calibrated artifact held out at several uniform ℓ.

    python scripts/research/saap_selectivity_curve.py --artifact <saap dir> --home /tmp/h --out curve.json
    python scripts/research/saap_selectivity_curve.py --artifact <saap dir> --top-l 8,32 --prompts 20 \
        --cells book_needle@1024,2048 --eval-set model.gguf.path=<file.gguf> --home /tmp/h --out curve.json

One point per ℓ of ``--top-l`` plus the artifact's own setting ("artifact"), each ``python -m calib eval
model=<model> artifact=<dir> eval.num_prompts=<n> eval.cells=[...]`` in a fresh process (eval caches the dense
answers in the home: they are computed once). ``eval.top_l`` alone keeps the artifact's per-layer ℓ
(``top_l_layers``, e.g. from its layer profile), so a uniform point also passes ``eval.top_l_layers`` naming every
non-dense layer of the artifact's manifest. ``eval.suites`` follows the cells (``book_*``: books, others:
synthetic) and ``eval.nll.chunks=0``; ``--eval-set`` overrides both. Recorded per point and cell: dense and sparse
accuracy, the paired-bootstrap 95 % CI of (sparse - dense), the selectivity (keys read / keys outside sink and
window) and with the window (keys read / all keys); per point the selectivity over every prompt. Only this
process writes ``--out``, after every point; a point recorded without an error for the same settings is not run
again. Then ``<out stem>.md`` (points by selectivity) and ``<out stem>.png`` (difference vs selectivity, one line
per cell, CI as error bars). Exit 1 when a point errored. Standard library, matplotlib and the runtime's manifest
reader; the evals need Hydra and MLflow (see ``scripts/bench/bench_calibration_scale.py``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/research/: the runner helpers
from smollm2_methods import Lane, Record, ci, finished, fmt, json_step, progress, suites_for  # noqa: E402

from bench_calibration_scale import ROOT, calib_env  # noqa: E402  (on sys.path through smollm2_methods)

ARTIFACT = "artifact"  # the label of the artifact's own operating point
DEFAULT_CELLS = "book_needle@1024,2048,4096,8192,niah_single@4096,8192"
OWNED = ("eval.num_prompts=", "eval.cells=", "eval.top_l=", "eval.top_l_layers=")  # set per point by this script


class CurveError(Exception):
    """A bad argument or artifact: ``main`` prints ``error: <message>`` and exits 2."""


@dataclass(frozen=True)
class SaapSettings:
    """What the points need from the artifact's manifest: its layers and its own ℓ."""

    num_layers: int
    dense_layers: tuple[int, ...]
    top_l: int
    top_l_layers: dict[int, int]

    def sparse_layers(self) -> list[int]:
        return [layer for layer in range(self.num_layers) if layer not in self.dense_layers]


@dataclass(frozen=True)
class Point:
    """One operating point: ``top_l`` None is the artifact's own setting."""

    label: str
    top_l: int | None


def read_settings(artifact: Path) -> SaapSettings:
    """The SAAP settings of the artifact directory's ``manifest.json`` (the runtime's type-checked reader)."""
    if str(ROOT) not in sys.path:  # run on a box where the checkout is not installed
        sys.path.append(str(ROOT))
    from runtime_kernels.errors import ArtifactError
    from runtime_kernels.manifest import read_manifest

    try:
        manifest = read_manifest(artifact)
    except ArtifactError as err:
        raise CurveError(str(err)) from None
    if manifest.method != "saap":
        raise CurveError(f"{artifact} is a {manifest.method!r} artifact; the curve sweeps SAAP's ℓ")
    hp = manifest.hyperparameters
    try:
        settings = SaapSettings(int(manifest.model.num_layers), tuple(int(x) for x in hp.get("dense_layers", [0])),
                                int(hp["top_l"]), {int(k): int(v) for k, v in (hp.get("top_l_layers") or {}).items()})
    except (KeyError, TypeError, ValueError) as err:
        raise CurveError(f"{artifact}: the SAAP hyper-parameters top_l / top_l_layers / dense_layers are malformed "
                         f"({type(err).__name__}: {err})") from None
    if not settings.sparse_layers():
        raise CurveError(f"{artifact}: every layer is dense ({list(settings.dense_layers)}): no ℓ to sweep")
    return settings


def parse_top_l(text: str) -> list[int]:
    """``"16,32,64"`` -> ``[16, 32, 64]``: distinct integers >= 1, sorted."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(s.isdigit() and int(s) >= 1 for s in items):
        raise CurveError(f"--top-l takes comma-separated integers >= 1, e.g. 16,32,64 (got {text!r})")
    return sorted({int(s) for s in items})


def parse_cells(text: str) -> list[str]:
    """``"book_needle@1024,2048,niah_single@4096"`` -> ``task@length`` cells; a bare length takes the task before it."""
    cells: list[str] = []
    task = ""
    for item in (s.strip() for s in text.split(",") if s.strip()):
        name, sep, length = item.rpartition("@") if "@" in item else ("", "", item)
        task = name if sep else task
        if not task or not length.isdigit() or int(length) < 1:
            raise CurveError(f"--cells takes task@length entries (a bare length repeats the task before it), "
                             f"e.g. book_needle@1024,2048 (got {item!r} in {text!r})")
        cell = f"{task}@{int(length)}"
        if cell not in cells:
            cells.append(cell)
    if not cells:
        raise CurveError("--cells names no cell")
    return cells


def plan_points(top_ls: list[int], settings: SaapSettings) -> list[Point]:
    """The artifact's own point, then one per ℓ; an ℓ equal to an artifact with one ℓ everywhere is that point."""
    same = not settings.top_l_layers
    return [Point(ARTIFACT, None)] + [Point(f"l{l}", l) for l in top_ls if not (same and l == settings.top_l)]


def point_overrides(point: Point, settings: SaapSettings) -> list[str]:
    """``eval.top_l=ℓ`` and the same ℓ on every non-dense layer (over the artifact's ``top_l_layers``)."""
    if point.top_l is None:
        return []
    per_layer = ",".join(f"{layer}:{point.top_l}" for layer in settings.sparse_layers())
    return [f"eval.top_l={point.top_l}", f"eval.top_l_layers={{{per_layer}}}"]


def eval_command(args: argparse.Namespace, point: Point, settings: SaapSettings) -> list[str]:
    """``calib eval`` of the artifact at ``point`` on ``--cells``: this script's defaults, then ``--eval-set``,
    then what the point sets."""
    return [sys.executable, "-m", "calib", "eval", f"model={args.model}", f"artifact={args.artifact}",
            f"eval.batch_tokens={args.batch_tokens}", "eval.nll.chunks=0",
            f"eval.suites=[{','.join(suites_for(args.cells))}]", *args.eval_set,
            f"eval.num_prompts={args.prompts}", f"eval.cells=[{','.join(args.cells)}]",
            *point_overrides(point, settings)]


def run_settings(args: argparse.Namespace) -> dict:
    """What a recorded point must have been run with to be reused."""
    return {"artifact": str(args.artifact), "model": args.model, "prompts": args.prompts, "cells": args.cells,
            "batch_tokens": args.batch_tokens, "eval_set": args.eval_set}


def cell_figures(result: dict, cell: str) -> dict:
    """One cell of a ``calib eval`` result JSON: dense, sparse, diff and its CI, selectivity (with window)."""
    m, task = result.get("metrics", {}), result.get("tasks", {}).get(cell, {})
    if f"{cell}.diff" not in m or "sparse" not in task:
        raise KeyError(f"the eval reported no sparse figures for {cell}")
    return {"dense": task["dense"], "sparse": task["sparse"], "diff": m[f"{cell}.diff"],
            "low": m[f"{cell}.diff_ci_low"], "high": m[f"{cell}.diff_ci_high"],
            "selectivity": m.get(f"{cell}.selectivity"),
            "selectivity_with_window": m.get(f"{cell}.selectivity_with_window")}


def point_figures(result: dict, cells: list[str]) -> dict:
    """Per cell :func:`cell_figures`; the selectivity over every prompt (1 - ``summary/sparsity``, SAAP's
    sparsity being 1 - selectivity), else the mean of the cells'."""
    figures = {cell: cell_figures(result, cell) for cell in cells}
    sparsity = result.get("summary", {}).get("summary/sparsity")
    per_cell = [f["selectivity"] for f in figures.values() if f["selectivity"] is not None]
    overall = 1.0 - sparsity if sparsity is not None else (sum(per_cell) / len(per_cell) if per_cell else None)
    return {"cells": figures, "selectivity": overall}


def run_points(points: list[Point], args: argparse.Namespace, settings: SaapSettings, lane: Lane,
               record: Record) -> None:
    """Every point's eval, recorded when it ends; a point recorded without an error for these settings is skipped."""
    wanted = run_settings(args)
    for point in points:
        row = record.row(point.label)
        if finished(row, "eval") and row["eval"].get("settings") == wanted:
            continue
        progress(point.label, lane, "calib eval")
        result = json_step(eval_command(args, point, settings), lane, f"curve_{point.label}.log", args.timeout)
        own = {"top_l": settings.top_l, "top_l_layers": settings.top_l_layers} if point.top_l is None else {
            "top_l": point.top_l, "top_l_layers": dict.fromkeys(settings.sparse_layers(), point.top_l)}
        result = {**result, "label": point.label, **own, "settings": wanted}
        if "error" not in result:
            try:
                result.update(point_figures(result, args.cells))
            except KeyError as err:
                result["error"] = str(err.args[0])
        record.put(point.label, "eval", result)


def layers_text(top_l: int, per_layer: dict) -> str:
    """``32`` or ``32; 256 on 16-20``: ℓ and the layers whose ℓ differs, runs of layers joined."""
    by_l: dict[int, list[int]] = {}
    for layer, value in sorted((int(k), int(v)) for k, v in per_layer.items()):
        if value != top_l:
            by_l.setdefault(value, []).append(layer)
    parts = [str(top_l)]
    for value, layers in sorted(by_l.items()):
        runs: list[list[int]] = []
        for layer in layers:
            if runs and layer == runs[-1][-1] + 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        parts.append(f"{value} on " + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs))
    return "; ".join(parts)


def sorted_rows(rows: dict[str, dict]) -> list[dict]:
    """The finished points, least selective first (a point without a selectivity last)."""
    done = [r for r in rows.values() if "error" not in r and "cells" in r]
    return sorted(done, key=lambda r: (r["selectivity"] is None, r["selectivity"] or 0.0, r["label"]))


def markdown(rows: dict[str, dict], cells: list[str]) -> str:
    """The dense accuracy per cell, then one line per finished point by selectivity: ℓ, selectivity, and per
    cell the difference [95 % CI] and the selectivity (with the window); errored points below."""
    done = sorted_rows(rows)
    lines = []
    if done:
        dense = done[0]["cells"]
        lines.append("dense accuracy: " + ", ".join(f"{c} {fmt(dense[c]['dense'])}" for c in cells))
        lines.append(f"prompts per cell: {done[0]['settings']['prompts']}\n")
    head = ["point", "ℓ", "selectivity", *[h for c in cells for h in (f"{c} diff [95% CI]", f"{c} sel. (w/ window)")]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in done:
        per_cell = [x for c in cells for x in (ci(r["cells"][c]["diff"], r["cells"][c]["low"], r["cells"][c]["high"]),
                                               f"{fmt(r['cells'][c]['selectivity'])} "
                                               f"({fmt(r['cells'][c]['selectivity_with_window'])})")]
        lines.append("| " + " | ".join([r["label"], layers_text(r["top_l"], r["top_l_layers"]),
                                        fmt(r["selectivity"]), *per_cell]) + " |")
    errors = [f"{r['label']}: {r['error']} (log: {r.get('log')})" for r in rows.values() if "error" in r]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def plot(rows: dict[str, dict], cells: list[str], path: Path) -> bool:
    """Sparse - dense accuracy against selectivity, one line per cell with its 95 % CI as error bars, the
    artifact's own point starred; False (no file) when matplotlib is missing or no cell has a selectivity."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for cell in cells:
        pts = sorted(((r["cells"][cell]["selectivity"], r["cells"][cell], r["label"]) for r in sorted_rows(rows)
                      if r["cells"][cell]["selectivity"] is not None), key=lambda p: p[0])
        if not pts:
            continue
        x, y = [p[0] for p in pts], [p[1]["diff"] for p in pts]
        err = [[p[1]["diff"] - p[1]["low"] for p in pts], [p[1]["high"] - p[1]["diff"] for p in pts]]
        line = ax.errorbar(x, y, yerr=err, marker="o", markersize=4, capsize=3, label=cell)
        own = [(s, f["diff"]) for s, f, label in pts if label == ARTIFACT]
        if own:
            ax.plot(*own[0], marker="*", markersize=13, color=line[0].get_color(), zorder=3)
        drawn = True
    if not drawn:
        return False
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set(xlabel="selectivity (keys read / keys outside sink and window)", ylabel="sparse − dense accuracy",
           title="SAAP at uniform ℓ (★ the artifact's own setting), 95 % paired-bootstrap CI")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True, help="a SAAP artifact directory")
    parser.add_argument("--model", default="smollm2", help="a conf/model name (default smollm2)")
    parser.add_argument("--top-l", default="16,32,64,128", help="uniform ℓ values, comma-separated")
    parser.add_argument("--cells", default=DEFAULT_CELLS,
                        help="task@length cells, a bare length repeating the task before it (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=100, help="held-out prompts per cell")
    parser.add_argument("--batch-tokens", type=int, default=65536, help="eval.batch_tokens")
    parser.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a calib eval override for every point (repeatable)")
    parser.add_argument("--home", type=Path, required=True, help="CALIB_HOME of the evals")
    parser.add_argument("--out", type=Path, required=True, help="JSON of every point (resumed when it exists)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per eval")
    args = parser.parse_args(argv)
    args.top_l, args.cells = parse_top_l(args.top_l), parse_cells(args.cells)
    if args.prompts < 1:
        raise CurveError(f"--prompts must be >= 1 (got {args.prompts})")
    bad = [s for s in args.eval_set if "=" not in s or s.startswith(OWNED)]
    if bad:
        raise CurveError(f"--eval-set takes KEY=VALUE and not {', '.join(k.rstrip('=') for k in OWNED)} "
                         f"(the script's own options set them): got {bad[0]!r}")
    if args.out.suffix in (".md", ".png"):
        raise CurveError("--out is the JSON; the table and the plot go beside it as <out stem>.md / .png")
    args.artifact = args.artifact.resolve()  # the evals run in the checkout
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        settings = read_settings(args.artifact)
    except CurveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.home.mkdir(parents=True, exist_ok=True)
    points = plan_points(args.top_l, settings)
    for top_l in sorted(set(args.top_l) - {p.top_l for p in points}):
        print(f"ℓ = {top_l} is the artifact's own setting: the point {ARTIFACT!r}", file=sys.stderr)
    record = Record(args.out)
    run_points(points, args, settings, Lane("", args.home, calib_env(args.home)), record)
    rows = {p.label: record.rows[p.label]["eval"] for p in points if "eval" in record.rows.get(p.label, {})}
    text = markdown(rows, args.cells)
    args.out.with_suffix(".md").write_text(text)
    print(text, end="")
    if not plot(rows, args.cells, args.out.with_suffix(".png")):
        print("no plot: matplotlib is not importable or no point reported a selectivity", file=sys.stderr)
    errors = [p.label for p in points if "error" in rows.get(p.label, {"error": ""})]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
