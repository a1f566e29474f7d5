"""``python -m calib run +method=sampleattention``: tune (alpha_c, alpha_s, chunk_n) per length bucket.

Steps (docs/methods.md, SampleAttention; Zhu et al., arXiv:2406.15486, §4.2.6; each a timed stage):

1. ``load`` / ``data``: the model; profiling prompts (``data.seed``, ``method.profiling``) grouped by the
   bucket that holds their token count (``bucket_edges``; the lookup the runtime makes).
2. ``dense``: each bucket's dense score per task (:mod:`calib.sampleattention.scoring`, ``method.score``);
   a point is feasible when every task keeps ``min_relative_score`` x its dense score, a prompt counting
   at most dense's score on it (the paper's multi-task tuning: a gain, on another task or another prompt,
   must not hide a loss).
3. ``tune``: per bucket :func:`calib.sampleattention.tuning.tune_length_bucket` over the grid
   ``alphas_c x alphas_s x chunk_ns``: maximize sparsity subject to the threshold; ties
   (:data:`SPARSITY_TIE_TOL`) go to the smaller chunk_n, then (GPU, ``measure_time``) to the shorter
   attention time. Dominated points are skipped.
4. ``table3`` (``method.report=full`` only): every chunk_n of ``table3_chunk_ns`` at each bucket's chosen
   alphas, on all prompts. ``report``: every point and the choice per bucket, heatmaps, Table 3.

Artifact: payload ``{"buckets": BucketTable.to_dict(), "tuning": per-bucket summary}`` and the tensor
``table`` ``[n_buckets, 3]`` float32 = (alpha_c, alpha_s, chunk_n) per bucket (checked against the
payload at load). A bucket with no feasible point runs dense; one with no profiling length takes the
nearest shorter tuned row (:func:`build_bucket_table`). Results: docs/results/sampleattention.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig
from tqdm.auto import tqdm

from calib.config import require
from calib.data import build_prompts, dataset_hash
from calib.errors import UserError
from calib.models import load_model
from calib.recipe_settings import Section, report_mode
from calib.run import MethodOutput
from calib.sampleattention.report import BucketReport, heatmap_figure, table3_markdown
from calib.sampleattention.scoring import SCORES, BucketEvaluator, PointEval
from calib.sampleattention.tuning import GridPoint, build_bucket_table, tune_length_bucket
from calib.tracking import log_figure
from runtime_kernels.manifest import DataRecord
from runtime_kernels.sampleattention.api import bucket_table_tensor
from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable

# mlflow is imported where used: the CLI imports this recipe for its checks of a run's settings and data,
# which must fail fast.

log = logging.getLogger(__name__)


SPARSITY_TIE_TOL = 0.005  # feasible sparsities within this of the best tie: the smaller chunk_n (less sampling) wins


@dataclass(frozen=True)
class ProfilingSettings:
    """``method.profiling``: the prompts each grid point is scored on and how they are answered."""

    lengths: list[int]
    prompts_per_length: int | dict[int, int]  # per task: one count for every length, or a count per length
    tasks: list[str] | None
    max_new_tokens: int
    loop: str  # auto | eager | static
    batch_tokens: int
    report_cra: bool

    def count(self, length: int) -> int:
        """Prompts per (book) task at ``length``."""
        c = self.prompts_per_length
        return c if isinstance(c, int) else c[length]

    @property
    def uniform(self) -> bool:
        """Every length gets the same count."""
        return len({self.count(n) for n in self.lengths}) == 1

    def recorded_counts(self) -> int | dict[str, int]:
        """``prompts_per_length`` as the manifest records it: the integer, or the mapping with its
        lengths as JSON keys (strings), in the order of ``lengths``."""
        c = self.prompts_per_length
        return c if isinstance(c, int) else {str(n): c[n] for n in self.lengths}


def _prompt_counts(p: Section, lengths: list[int]) -> int | dict[int, int]:
    """``profiling.prompts_per_length``: one integer for every length, or ``{length: count}`` naming each
    of ``lengths`` (counts >= 1; lengths not profiled are ignored, so a model's mapping serves a run on fewer
    of its lengths); anything else -> one-line UserError naming the key."""
    key, raw = p.key("prompts_per_length"), p.value("prompts_per_length")
    if not isinstance(raw, Mapping):
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise UserError(f"{key} must be an integer or a mapping {{length: count}} naming every profiled "
                            f"length (got {raw!r})")
        return p.integer("prompts_per_length", at_least=1)
    counts, out, seen = Section(raw, key), {}, set()
    for k in raw:
        length = k if isinstance(k, int) and not isinstance(k, bool) else int(k) if str(k).isdigit() else None
        if length is None:
            raise UserError(f"{key} has a count for {k!r}, which is not a length in tokens")
        if length in seen:
            raise UserError(f"{key} names length {length} twice")
        seen.add(length)
        if length in lengths:
            out[length] = counts.integer(k, at_least=1)
    missing = [n for n in lengths if n not in out]
    if missing:
        raise UserError(f"{key} has no count for length {missing[0]} of {p.key('lengths')} {lengths}: add "
                        f"'+{key}.{missing[0]}=<n>', or give one integer for all")
    return {n: out[n] for n in lengths}


@dataclass(frozen=True)
class Settings:
    """``cfg.method`` read and range-checked once (conf/method/sampleattention/default.yaml documents every key)."""

    blk: int
    alphas_c: list[float]  # sorted, distinct
    alphas_s: list[float]
    chunk_ns: list[int]
    table3_chunk_ns: list[int]
    min_relative_score: float
    measure_time: bool | str  # auto | True | False
    score: str
    report: str
    bucket_edges: list[int]
    profiling: ProfilingSettings

    @classmethod
    def from_cfg(cls, cfg: Any) -> "Settings":
        m = Section(cfg.method, "method")
        p = m.section("profiling")
        chunk_ns = sorted(set(m.integers("chunk_ns", at_least=1)))
        edges = m.integers("bucket_edges", at_least=1)
        require(all(a < b for a, b in zip(edges, edges[1:])),
                f"method.bucket_edges={edges} must be strictly increasing (lower edges of buckets 1..n)")
        lengths = p.integers("lengths", at_least=1)
        profiling = ProfilingSettings(
            lengths=lengths, prompts_per_length=_prompt_counts(p, lengths),
            tasks=p.names("tasks", optional=True), max_new_tokens=p.integer("max_new_tokens", at_least=1),
            loop=p.choice("loop", ("auto", "eager", "static")), batch_tokens=p.integer("batch_tokens", at_least=1),
            report_cra=p.flag("report_cra"))
        return cls(blk=m.integer("blk", at_least=1), alphas_c=sorted(set(m.numbers("alphas_c", above=0, at_most=1))),
                   alphas_s=sorted(set(m.numbers("alphas_s", above=0, at_most=1))), chunk_ns=chunk_ns,
                   table3_chunk_ns=sorted(set(m.integers("table3_chunk_ns", optional=True, at_least=1) or chunk_ns)),
                   min_relative_score=m.number("min_relative_score", above=0, at_most=1),
                   measure_time=m.choice("measure_time", ("auto", True, False)), score=m.choice("score", SCORES),
                   report=report_mode(m), bucket_edges=edges, profiling=profiling)

    @property
    def grid_points(self) -> int:
        return len(self.alphas_c) * len(self.alphas_s) * len(self.chunk_ns)

    def timed(self, device: Any) -> bool:
        """``measure_time``: ``auto`` times the attention per point on CUDA only."""
        return device.type == "cuda" if self.measure_time == "auto" else bool(self.measure_time)

    def loop_on(self, device: Any) -> str:
        """``profiling.loop``: ``auto`` = ``static`` on CUDA (exact-match answers batched through the serving
        loop, as ``calib eval`` answers them there), else ``eager``."""
        loop = self.profiling.loop
        return ("static" if device.type == "cuda" else "eager") if loop == "auto" else loop


def validate(cfg: DictConfig) -> None:
    """Range checks of ``cfg.method`` (one-line ``UserError`` naming the key)."""
    _check_counts_fit_source(cfg, Settings.from_cfg(cfg).profiling)


def _check_counts_fit_source(cfg: DictConfig, p: ProfilingSettings) -> None:
    """A count per length needs prompts built per length: file and hub rows are counted per task only."""
    source = str(cfg.data.get("source", "synthetic")) if cfg.get("data") is not None else "synthetic"
    require(p.uniform or source in ("synthetic", "books"),
            f"method.profiling.prompts_per_length gives the lengths different counts, but data.source={source} "
            f"takes rows per task, whatever their length: give one integer")


def data_needs(cfg: DictConfig) -> dict[str, str | None]:
    """Profiling rows only; every grid point is scored on their gold answers."""
    return {"calibration": "SampleAttention scores every grid point on the profiling prompts' answers"}


def _profiling_prompts(cfg: DictConfig, s: Settings, tokenizer: Any) -> list[Any]:
    """``profiling.count(n)`` prompts per (book) task at each length ``n``, the lengths that share a count
    built together (one count for all: one call). Synthetic and book prompts are each seeded by
    (``data.seed``, task, length, index): a length's prompts do not depend on the other lengths' counts,
    and a larger count keeps a smaller one's prompts and adds more."""
    p = s.profiling
    _check_counts_fit_source(cfg, p)
    by_count: dict[int, list[int]] = {}
    for n in p.lengths:
        by_count.setdefault(p.count(n), []).append(n)
    return [q for count, lengths in by_count.items()
            for q in build_prompts(cfg.data, tokenizer, seed=int(cfg.data.seed), lengths=lengths, tasks=p.tasks,
                                   num_prompts=count, purpose="calibration")]


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


def _tune_bucket(s: Settings, evaluator: BucketEvaluator, index: int, lengths: list[int]) -> BucketReport:
    """Dense score, search, Table-3 points of one bucket."""
    table3_ns = s.table3_chunk_ns if s.report == "full" else []
    bar = tqdm(total=1 + s.grid_points + len(table3_ns), desc=f"sampleattention bucket {index}", unit="point",
               leave=False)
    try:
        dense = evaluator.dense()
        bar.update(1)
        evaluator.threshold = s.min_relative_score  # the evaluator's scores are relative to dense, per task
        result = tune_length_bucket(evaluator, alphas_c=s.alphas_c, alphas_s=s.alphas_s, chunk_ns=s.chunk_ns,
                                    dense_score=1.0, min_relative_score=s.min_relative_score,
                                    sparsity_tol=SPARSITY_TIE_TOL, on_decided=lambda _: bar.update(1))
        point = result.chosen.point if result.chosen is not None else GridPoint(s.alphas_c[-1], s.alphas_s[-1],
                                                                                s.chunk_ns[0])
        table3 = {}
        for n in table3_ns:  # Table 3, a report extra: every chunk_n at the chosen alphas, on all prompts
            table3[n] = evaluator.full(GridPoint(point.alpha_c, point.alpha_s, n))
            bar.update(1)
    finally:
        bar.close()
    lower, upper = _bucket_bounds(s.bucket_edges, index)
    dense_exact = sum(p.exact for p in evaluator.dense_scores) / len(evaluator.dense_scores)
    return BucketReport(index, lower, upper, lengths, len(evaluator.prompts), dense, dense_exact, evaluator.threshold,
                        result, evaluator.cache, (point.alpha_c, point.alpha_s), table3, s.grid_points)


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


def _log_reports(reports: list[BucketReport], s: Settings) -> None:
    """The search to the active run: every evaluated and skipped point and the choice per bucket
    (``sampleattention/tuning.json``), per-bucket heatmaps (``plots/sampleattention/bucket<i>.png``) and,
    with ``method.report=full``, the Table-3 table (``sampleattention/table3.md``; metrics
    ``table3.b<i>.n<c>.*`` come from :func:`_metrics`)."""
    import mlflow

    mlflow.log_dict({"buckets": [r.to_dict() for r in reports]}, "sampleattention/tuning.json")
    for r in reports:
        log_figure(heatmap_figure(r, s.alphas_c, s.alphas_s), f"plots/sampleattention/bucket{r.index}.png")
    if any(r.table3 for r in reports):
        mlflow.log_text(table3_markdown(reports), "sampleattention/table3.md")
        log.info("SampleAttention Table 3 (score / sparsity per chunk_n at the chosen alphas):\n%s",
                 table3_markdown(reports))


def calibrate(cfg: DictConfig, ctx: Any) -> MethodOutput:
    """Tune every bucket, log the search, return the bucket table as the artifact."""
    import mlflow

    s = Settings.from_cfg(cfg)
    edges, p = s.bucket_edges, s.profiling
    with ctx.timer.stage("load"):
        loaded = load_model(cfg.model, device=str(ctx.device))
    with ctx.timer.stage("data"):
        prompts = _profiling_prompts(cfg, s, loaded.tokenizer)
    timing, loop = s.timed(ctx.device), s.loop_on(ctx.device)
    reports: list[BucketReport] = []
    results: list[Any] = []
    for index, bucket_prompts in enumerate(_by_bucket(edges, prompts)):
        if not bucket_prompts:
            results.append(None)
            continue
        lengths = sorted({q.length for q in bucket_prompts})
        evaluator = BucketEvaluator(loaded, bucket_prompts, s.blk, s.score, p.max_new_tokens, loop=loop,
                                    batch_tokens=p.batch_tokens, timing=timing, report_cra=p.report_cra)
        with ctx.timer.stage("tune"):
            report = _tune_bucket(s, evaluator, index, lengths)
        reports.append(report)
        results.append(report.result)
        chosen = report.chosen_eval()
        log.info("bucket %d %s: dense %.4f, chosen %s (sparsity %.4f), %d of %d points evaluated", index, report.label,
                 report.dense_score, chosen.point if chosen else "none -> dense", chosen.sparsity if chosen else 0.0,
                 len(report.result.evaluated_points), report.grid_points)
    table = build_bucket_table(edges, results, blk=s.blk, max_length=max(p.lengths))
    with ctx.timer.stage("report"):
        if mlflow.active_run() is not None:
            _log_reports(reports, s)
    hyper = {**dataclasses.asdict(s), "measure_time": timing, "sparsity_tie_tol": SPARSITY_TIE_TOL}
    hyper["profiling"]["prompts_per_length"] = p.recorded_counts()
    summary = [{"bucket": r.index, "range": r.label, "lengths": r.lengths, "num_prompts": r.num_prompts,
                "dense_score": r.dense_score, "threshold": r.threshold,
                "chosen": None if r.chosen_eval() is None else r.chosen_eval().record()} for r in reports]
    data = DataRecord(source=str(cfg.data.source), seed=int(cfg.data.seed), count=len(prompts),
                      lengths=p.lengths, content_hash=dataset_hash(prompts),
                      tasks=sorted({q.task for q in prompts}),
                      details={"purpose": "profiling", "prompts_per_length": p.recorded_counts(),
                               "prompts_per_bucket": {str(r.index): r.num_prompts for r in reports}})
    return MethodOutput(tensors={"buckets": {"table": bucket_table_tensor(table)}}, hyperparameters=hyper,
                        model=loaded.facts.to_dict(), data=data, metrics=_metrics(reports),
                        payload={"buckets": table.to_dict(), "tuning": summary})
