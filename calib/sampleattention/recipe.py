"""``python -m calib run +method=sampleattention``: tune (alpha_c, alpha_s, chunk_n) per length bucket.

Steps (docs/methods.md, SampleAttention; Zhu et al., arXiv:2406.15486, §4.2.6; each a timed stage):

1. ``load``: the model. ``data``: profiling prompts from ``cfg.data`` with the calibration seed
   (``data.seed``), ``method.profiling.prompts_per_length`` per task and length for the lengths
   ``method.profiling.lengths``, grouped by the bucket that holds their token count (``bucket_edges``;
   the lookup the runtime makes).
2. ``dense``: each bucket's dense score (:mod:`calib.sampleattention.scoring`: ``method.score`` is
   ``answer_prob`` by default, ``exact_match`` on SmolLM2); threshold = ``min_relative_score`` x dense.
3. ``tune``: per bucket :func:`calib.sampleattention.tuning.tune_length_bucket` over the grid
   ``alphas_c x alphas_s x chunk_ns``; each point is scored by attaching ``SampleAttentionPrefill`` with
   that fixed row. Maximize sparsity subject to the threshold; ties (``sparsity_tie_tol``) go to the
   smaller chunk_n, then (GPU, ``measure_time``) to the faster attention. Dominated points are skipped.
4. ``table3`` (``method.report=full`` only; the default ``artifact`` skips it): at each bucket's chosen
   alphas, every chunk_n of ``table3_chunk_ns`` (default: ``chunk_ns``) scored on all prompts
   (evaluating what the search skipped or stopped early).
5. ``report``: every evaluated point, skipped point and the choice per bucket
   (``sampleattention/tuning.json``), per-bucket heatmaps (``plots/sampleattention/bucket<i>.png``),
   the Table-3 table with ``method.report=full`` (``sampleattention/table3.md`` + metrics
   ``table3.b<i>.n<c>.*``).

Artifact: payload ``{"buckets": BucketTable.to_dict(), "tuning": per-bucket summary}`` and the tensor
``table`` ``[n_buckets, 3]`` float32 = (alpha_c, alpha_s, chunk_n) per bucket (checked against the
payload at load). A bucket with no feasible point runs dense; one with no profiling length takes
the nearest shorter tuned row (:func:`build_bucket_table`).
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig
from tqdm.auto import tqdm

from calib.config import require, to_container
from calib.sampleattention.report import BucketReport, heatmap_figure, table3_markdown
from calib.sampleattention.scoring import SCORES, BucketEvaluator, PointEval
from calib.sampleattention.tuning import GridPoint, build_bucket_table, tune_length_bucket
from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable

log = logging.getLogger(__name__)


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values]


def _floats(values: Any) -> list[float]:
    return [float(v) for v in values]


def validate(cfg: DictConfig) -> None:
    """Range checks of ``cfg.method`` (one-line ``UserError`` naming the key and the fix)."""
    m = cfg.method
    require(int(m.blk) >= 1, f"method.blk={m.blk} must be >= 1 (64 in the paper)")
    for key in ("alphas_c", "alphas_s"):
        vals = list(m[key] or [])
        require(bool(vals) and all(0.0 < float(a) <= 1.0 for a in vals),
                f"method.{key}={vals} must be a non-empty list of CRA thresholds in (0, 1], e.g. [0.8, 0.9, 0.95]")
    chunk_ns = list(m.chunk_ns or [])
    require(bool(chunk_ns) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in chunk_ns),
            f"method.chunk_ns={chunk_ns} must be a non-empty list of integers >= 1, e.g. [1, 2, 4, 6]")
    table3_ns = m.get("table3_chunk_ns")
    require(table3_ns is None or (not isinstance(table3_ns, str) and bool(list(table3_ns)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in table3_ns)),
            f"method.table3_chunk_ns={table3_ns} must be null (= chunk_ns) or a non-empty list of integers >= 1")
    require(0.0 < float(m.min_relative_score) <= 1.0,
            f"method.min_relative_score={m.min_relative_score} must be in (0, 1]")
    require(float(m.sparsity_tie_tol) >= 0.0, f"method.sparsity_tie_tol={m.sparsity_tie_tol} must be >= 0")
    require(str(m.measure_time) in ("auto", "True", "False", "true", "false"),
            f"method.measure_time={m.measure_time!r} must be auto, true or false")
    require(str(m.get("report") or "artifact") in ("artifact", "full"),
            f"method.report={m.get('report')!r} must be one of artifact, full")
    require(str(m.score) in SCORES, f"method.score={m.score!r} must be one of {', '.join(SCORES)}")
    edges = list(m.bucket_edges or [])
    require(all(int(e) > 0 for e in edges) and all(int(a) < int(b) for a, b in zip(edges, edges[1:])),
            f"method.bucket_edges={edges} must be positive and strictly increasing (lower edges of buckets 1..n)")
    p = m.profiling
    lengths = list(p.lengths or [])
    require(bool(lengths) and all(int(n) >= 1 for n in lengths),
            f"method.profiling.lengths={lengths} must be a non-empty list of prompt lengths")
    require(int(p.prompts_per_length) >= 1, f"method.profiling.prompts_per_length={p.prompts_per_length} must be >= 1")
    require(int(p.max_new_tokens) >= 1, f"method.profiling.max_new_tokens={p.max_new_tokens} must be >= 1")
    require(str(p.get("loop", "auto")) in ("auto", "eager", "static"),
            f"method.profiling.loop={p.get('loop')!r} must be auto, eager or static")
    require(int(p.get("batch_tokens", 16384)) >= 1,
            f"method.profiling.batch_tokens={p.get('batch_tokens')} must be >= 1")


def data_needs(cfg: DictConfig) -> dict[str, str | None]:
    """Profiling rows only; every grid point is scored on their gold answers."""
    return {"calibration": "SampleAttention scores every grid point on the profiling prompts' answers"}


def _measure_time(cfg: DictConfig, device: Any) -> bool:
    flag = str(cfg.method.measure_time).lower()
    return device.type == "cuda" if flag == "auto" else flag == "true"


def _profiling_loop(cfg: DictConfig, device: Any) -> str:
    """``method.profiling.loop``: ``auto`` = ``static`` on CUDA (exact-match answers batched through the
    serving loop, as ``calib eval`` answers them there), else ``eager``."""
    loop = str(cfg.method.profiling.get("loop", "auto"))
    return ("static" if device.type == "cuda" else "eager") if loop == "auto" else loop


def _profiling_prompts(cfg: DictConfig, tokenizer: Any) -> list[Any]:
    from calib.data import build_prompts

    p = cfg.method.profiling
    tasks = list(p.tasks) if p.get("tasks") else None
    return build_prompts(cfg.data, tokenizer, seed=int(cfg.data.seed), lengths=_ints(p.lengths), tasks=tasks,
                         num_prompts=int(p.prompts_per_length), purpose="calibration")


def _by_bucket(edges: list[int], prompts: list[Any]) -> list[list[Any]]:
    """Prompts grouped by the bucket of their token count, as the runtime will look them up."""
    lookup = BucketTable(edges, [BucketRow(1.0, 1.0, 1)] * (len(edges) + 1))
    groups: list[list[Any]] = [[] for _ in range(len(edges) + 1)]
    for p in prompts:
        groups[lookup.bucket_index(len(p.input_ids))].append(p)
    return groups


def _bucket_bounds(edges: list[int], index: int) -> tuple[int, int | None]:
    lower = 0 if index == 0 else edges[index - 1]
    return lower, edges[index] if index < len(edges) else None


def _tune_bucket(cfg: DictConfig, evaluator: BucketEvaluator, index: int, lengths: list[int]) -> BucketReport:
    """Dense score, search, Table-3 points of one bucket."""
    m = cfg.method
    alphas_c, alphas_s = sorted(set(_floats(m.alphas_c))), sorted(set(_floats(m.alphas_s)))
    chunk_ns = sorted(set(_ints(m.chunk_ns)))
    grid = len(alphas_c) * len(alphas_s) * len(chunk_ns)
    full = str(m.get("report") or "artifact") == "full"
    table3_ns = sorted(set(_ints(m.get("table3_chunk_ns") or chunk_ns))) if full else []
    bar = tqdm(total=1 + grid + len(table3_ns), desc=f"sampleattention bucket {index}", unit="point", leave=False)
    try:
        dense = evaluator.dense()
        bar.update(1)
        mrs = float(m.min_relative_score)
        evaluator.threshold = mrs * dense
        result = tune_length_bucket(evaluator, alphas_c=alphas_c, alphas_s=alphas_s, chunk_ns=chunk_ns,
                                    dense_score=dense, min_relative_score=mrs, sparsity_tol=float(m.sparsity_tie_tol),
                                    probe_min_corner=bool(m.get("probe_min_corner", True)),
                                    on_decided=lambda _: bar.update(1))
        point = result.chosen.point if result.chosen is not None else GridPoint(alphas_c[-1], alphas_s[-1], chunk_ns[0])
        table3 = {}
        for n in table3_ns:  # Table 3, a report extra: every chunk_n at the chosen alphas, on all prompts
            table3[n] = evaluator.full(GridPoint(point.alpha_c, point.alpha_s, n))
            bar.update(1)
    finally:
        bar.close()
    lower, upper = _bucket_bounds(_ints(m.bucket_edges), index)
    dense_exact = sum(s.exact for s in evaluator.dense_scores) / len(evaluator.dense_scores)
    return BucketReport(index, lower, upper, lengths, len(evaluator.prompts), dense, dense_exact, evaluator.threshold,
                        result, evaluator.cache, (point.alpha_c, point.alpha_s), table3, grid)


def _row_metrics(point: GridPoint) -> dict[str, float]:
    return {"alpha_c": point.alpha_c, "alpha_s": point.alpha_s, "chunk_n": float(point.chunk_n)}


def _metrics(reports: list[BucketReport]) -> dict[str, Any]:
    out: dict[str, Any] = {"evaluated_points": sum(len(r.result.evaluated_points) for r in reports),
                           "grid_points": sum(r.grid_points for r in reports)}
    for r in reports:
        chosen: PointEval | None = r.chosen_eval()
        out[f"bucket{r.index}"] = {
            "dense_score": r.dense_score, "dense_exact": r.dense_exact, "threshold": r.threshold,
            "score": chosen.score if chosen else r.dense_score, "sparsity": chosen.sparsity if chosen else 0.0,
            "evaluated_points": len(r.result.evaluated_points), "grid_points": r.grid_points,
            "feasible_found": float(chosen is not None),
            **(_row_metrics(chosen.point) if chosen else {})}
        if not r.table3:
            continue
        out.setdefault("table3", {})[f"b{r.index}"] = {
            f"n{n}": {"score": e.score, "sparsity": e.sparsity, "time_s": e.result().time_s}
            for n, e in r.table3.items()}
    if reports:
        longest = max(reports, key=lambda r: r.index)
        out["sparsity_longest_bucket"] = out[f"bucket{longest.index}"]["sparsity"]
    return out


def _log_reports(reports: list[BucketReport], cfg: DictConfig) -> None:
    import mlflow

    from calib.tracking import log_figure

    alphas_c, alphas_s = sorted(set(_floats(cfg.method.alphas_c))), sorted(set(_floats(cfg.method.alphas_s)))
    mlflow.log_dict({"buckets": [r.to_dict() for r in reports]}, "sampleattention/tuning.json")
    for r in reports:
        log_figure(heatmap_figure(r, alphas_c, alphas_s), f"plots/sampleattention/bucket{r.index}.png")
    if any(r.table3 for r in reports):
        mlflow.log_text(table3_markdown(reports), "sampleattention/table3.md")
        log.info("SampleAttention Table 3 (score / sparsity per chunk_n at the chosen alphas):\n%s",
                 table3_markdown(reports))


def calibrate(cfg: DictConfig, ctx: Any) -> Any:
    """Tune every bucket, log the search, return the bucket table as the artifact."""
    import mlflow

    from calib.data import dataset_hash
    from calib.models import load_model
    from calib.run import MethodOutput
    from runtime_kernels.manifest import DataRecord
    from runtime_kernels.sampleattention.api import bucket_table_tensor

    m = cfg.method
    edges = _ints(m.bucket_edges)
    with ctx.timer.stage("load"):
        loaded = load_model(cfg.model, device=str(ctx.device))
    with ctx.timer.stage("data"):
        prompts = _profiling_prompts(cfg, loaded.tokenizer)
    timing = _measure_time(cfg, ctx.device)
    loop = _profiling_loop(cfg, ctx.device)
    reports: list[BucketReport] = []
    results: list[Any] = []
    for index, bucket_prompts in enumerate(_by_bucket(edges, prompts)):
        if not bucket_prompts:
            results.append(None)
            continue
        lengths = sorted({p.length for p in bucket_prompts})
        evaluator = BucketEvaluator(loaded, bucket_prompts, int(m.blk), str(m.score), int(m.profiling.max_new_tokens),
                                    loop=loop, batch_tokens=int(m.profiling.batch_tokens), timing=timing,
                                    report_cra=bool(m.profiling.report_cra), early_stop=bool(m.early_stop))
        with ctx.timer.stage("tune"):
            report = _tune_bucket(cfg, evaluator, index, lengths)
        reports.append(report)
        results.append(report.result)
        chosen = report.chosen_eval()
        log.info("bucket %d %s: dense %.4f, chosen %s (sparsity %.4f), %d of %d points evaluated", index, report.label,
                 report.dense_score, chosen.point if chosen else "none -> dense", chosen.sparsity if chosen else 0.0,
                 len(report.result.evaluated_points), report.grid_points)
    table = build_bucket_table(edges, results, blk=int(m.blk), max_length=max(_ints(m.profiling.lengths)))
    with ctx.timer.stage("report"):
        if mlflow.active_run() is not None:
            _log_reports(reports, cfg)
    hyper = {k: v for k, v in to_container(m).items() if k not in ("name", "abi_version")}
    hyper["measure_time"] = timing
    summary = [{"bucket": r.index, "range": r.label, "lengths": r.lengths, "num_prompts": r.num_prompts,
                "dense_score": r.dense_score, "threshold": r.threshold,
                "chosen": None if r.chosen_eval() is None else r.chosen_eval().record()} for r in reports]
    data = DataRecord(source=str(cfg.data.source), seed=int(cfg.data.seed), count=len(prompts),
                      lengths=_ints(m.profiling.lengths), content_hash=dataset_hash(prompts),
                      tasks=sorted({p.task for p in prompts}),
                      details={"purpose": "profiling", "prompts_per_length": int(m.profiling.prompts_per_length),
                               "prompts_per_bucket": {str(r.index): r.num_prompts for r in reports}})
    return MethodOutput(tensors={"buckets": {"table": bucket_table_tensor(table)}}, hyperparameters=hyper,
                        model=loaded.facts.to_dict(), data=data, metrics=_metrics(reports),
                        payload={"buckets": table.to_dict(), "tuning": summary})
