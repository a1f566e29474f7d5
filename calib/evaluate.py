"""``eval``: held-out task accuracy, dense and with an artifact applied.

The prompts come from each *suite* (a data source: :func:`eval_suites`; a real model's default is the
synthetic tasks and the natural-text book suite side by side) with ``eval.seed`` (never the calibration
seed: checked against ``data.seed`` and the artifact's recorded seed), or the held-out rows of a JSONL
file or HF dataset (``calib.data.rows``); results are reported per suite too (``suite.<name>.*``).
Each prompt is answered greedily, first densely, then — with ``artifact=...`` — with the artifact's
method plugged in through ``runtime_kernels.hf.apply``.
Accuracy follows each task's rule (``data.scoring``: exact match or contains); the difference is
reported with a paired bootstrap 95% CI overall and per task and length. Method statistics (sparsity,
selectivity, ...) come from the runtime's ``pop_stats()`` after every prompt and are averaged per
task and length.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from calib import dense_cache, registry, tracking
from calib.config import available, layer_map, to_container, validate_common
from calib.data import EVAL_NEEDS, check_data, evaluation_prompts, is_correct
from calib.data.rows import cfg_get
from calib.errors import UserError
from calib.generation import equal_length_batches, equal_length_greedy_generate, static_greedy_generate
from calib.generation import greedy_generate, stop_token_ids  # noqa: F401 (recipes import them from here)
from calib.models import load_model, resolve_device
from calib.paths import config_dir
from calib.perplexity import real_text_nll
from calib.stats import paired_bootstrap_diff
from runtime_kernels import hf
from runtime_kernels.artifact import load_artifact

# mlflow is imported where used, in evaluate: the answer path (answer_prompts and its helpers) runs in
# scripts on GPU machines without mlflow.


@dataclass
class PromptResult:
    task: str
    length: int
    prediction: str
    correct: bool
    stats: dict[str, float]


def answer_prompts(loaded: Any, prompts: Sequence[Any], max_new_tokens: int, runtime: Any = None,
                   desc: str = "dense", batch_tokens: int = 0, loop: str = "eager") -> list[PromptResult]:
    """Answer every prompt, scored by its task's rule; ``runtime`` (a CalibAttention) supplies method stats.

    ``batch_tokens > 0``: prompts of one token count (and one scoring rule) are answered together, up to
    that many prompt tokens per batch (:func:`calib.generation.equal_length_batches`; no padding, so a
    sparse method sees each prompt as it would alone). A batch's method stats (the runtime's means
    since the last ``pop_stats``) are given to each of its prompts. Results are in ``prompts`` order.
    ``loop``: ``eager`` (transformers' own cache, one Python pass per step), ``static`` (the serving
    loop, :func:`calib.generation.static_greedy_generate`; see :func:`eval_loop`) or ``static-ragged``
    (the same, batching prompts of one nominal length whatever their token counts: each row prefilled
    alone and decoded at its own position, so a cell is one or two batches instead of one per count).
    """
    generate = static_greedy_generate if loop.startswith("static") else equal_length_greedy_generate

    # an exact-match answer ends at the first newline; a contained one may come after a line break
    stops = {rule: stop_token_ids(loaded.tokenizer, newline=rule == "exact_match") for rule in ("exact_match", "contains")}
    rules = [getattr(p, "scoring", "exact_match") for p in prompts]
    ragged = loop == "static-ragged"
    keys = [(rule, p.length) for rule, p in zip(rules, prompts)] if ragged else rules
    batches = equal_length_batches([len(p.input_ids) for p in prompts], batch_tokens, keys, ragged=ragged)
    results: list[PromptResult | None] = [None] * len(prompts)
    with tqdm(total=len(prompts), desc=f"eval {desc}", unit="prompt", leave=False) as bar:
        for idx in batches:
            gen = generate(loaded.model, [prompts[i].input_ids for i in idx], max_new_tokens, stops[rules[idx[0]]])
            stats: dict[str, float] = {}
            if runtime is not None:
                for rt in (runtime.prefill, runtime.decode):
                    if rt is not None and hasattr(rt, "pop_stats"):
                        stats.update(rt.pop_stats())
            for i, tokens in zip(idx, gen):
                text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
                p = prompts[i]
                results[i] = PromptResult(p.task, p.length, text, is_correct(text, p), dict(stats))
            bar.update(len(idx))
    return [r for r in results if r is not None]


PREFILL_METHODS = ("sale", "sampleattention")  # their decode steps are dense attention


def eval_loop(cfg: Any, device: Any, method: str) -> str:
    """``eval.loop``: ``eager``, ``static``, or ``auto`` = ``static`` on CUDA for dense, the prefill methods
    (their stats come from the eager prefill; the decode steps are dense and graph-captured), SAAP and
    SANTA (their selectivity / sample fraction is summed on the device inside the graphs,
    ``SaapDecode._record``, ``SantaDecode._record_static``), else ``eager``. ``static`` comes back as
    ``static-ragged`` (:func:`answer_prompts`): a cell's prompts, whose token counts differ by less than a
    sentence, are one or two batches (SAAP indexes the shortest row's keys, the others' few more are dense).
    Dense and sparse answers of one eval go through the same loop and batches, so the paired difference
    is the method's."""
    loop = str(cfg.eval.get("loop") or "auto")
    if loop not in ("auto", "eager", "static"):
        raise UserError(f"eval.loop must be auto, eager or static (got {loop!r})")
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    if loop == "auto":
        loop = "static" if on_cuda and method in ("dense", "saap", "santa", *PREFILL_METHODS) else "eager"
    return "static-ragged" if loop == "static" else loop


def dense_cache_key(loaded: Any, prompts: Sequence[Any], max_new_tokens: int, batch_tokens: int,
                    loop: str = "eager") -> str | None:
    """What dense greedy answers depend on (:func:`calib.dense_cache.cache_key`): the weights, the decoding
    budget, the batching, the loop and every prompt's tokens, answer and scoring rule."""
    return dense_cache.cache_key(loaded, [int(max_new_tokens), int(batch_tokens), str(loop)],
                                 ([list(p.input_ids), str(p.answer), getattr(p, "scoring", "exact_match")]
                                  for p in prompts))


def cached_dense_answers(loaded: Any, prompts: Sequence[Any], max_new_tokens: int,
                         batch_tokens: int, loop: str = "eager") -> list[PromptResult]:
    """Dense answers, read from ``artifacts/cache/eval_dense/<key>.json`` when the same model answered
    the same prompts with the same settings before (:func:`dense_cache_key`)."""
    key = dense_cache_key(loaded, prompts, max_new_tokens, batch_tokens, loop)
    rows = dense_cache.read("eval_dense", key)
    if rows is not None and len(rows) == len(prompts):
        print(f"dense answers: reused cache/eval_dense/{key}.json", file=sys.stderr)
        return [PromptResult(p.task, p.length, r["prediction"], bool(r["correct"]), {}) for p, r in zip(prompts, rows)]
    results = answer_prompts(loaded, prompts, max_new_tokens, batch_tokens=batch_tokens, loop=loop)
    dense_cache.write("eval_dense", key, [{"prediction": r.prediction, "correct": r.correct} for r in results])
    return results


def _group_metrics(key: str, idx: list[int], d_all: np.ndarray, s_all: np.ndarray,
                   sparse: list[PromptResult], resamples: int, seed: int) -> dict[str, float]:
    """Accuracy difference CI and mean method stats of one group of prompts (``key.`` prefixed)."""
    ci = paired_bootstrap_diff(d_all[idx], s_all[idx], resamples=resamples, seed=seed)
    out = {f"{key}.diff": ci.mean, f"{key}.diff_ci_low": ci.low, f"{key}.diff_ci_high": ci.high}
    for name in sorted({k for i in idx for k in sparse[i].stats}):
        out[f"{key}.{name}"] = float(np.mean([sparse[i].stats[name] for i in idx if name in sparse[i].stats]))
    return out


def summarize(dense: list[PromptResult], sparse: list[PromptResult] | None, resamples: int,
              seed: int, suites: dict[str, list[int]] | None = None) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per ``task@length`` accuracies, and flat metrics: overall, per suite (``suite.<name>.``, the
    prompt indexes ``suites`` gives) and per length (``len<L>.``, all tasks pooled — the unit of
    SampleAttention's buckets) and per ``task@length`` paired-bootstrap CIs of (sparse - dense) with the
    method's mean stats (sparsity, selectivity, CRA, ...)."""
    by_task: dict[str, list[int]] = defaultdict(list)
    by_length: dict[str, list[int]] = {f"suite.{name}": idx for name, idx in (suites or {}).items() if idx}
    for i, r in enumerate(dense):
        by_task[f"{r.task}@{r.length}"].append(i)
    for i, r in enumerate(dense):
        by_length.setdefault(f"len{r.length}", []).append(i)
    d_all = np.array([r.correct for r in dense], dtype=float)
    s_all = np.array([r.correct for r in sparse], dtype=float) if sparse is not None else None
    tasks: dict[str, dict[str, float]] = {}
    metrics: dict[str, float] = {"dense_acc": float(d_all.mean()), "num_prompts": float(len(dense))}
    for key, idx in sorted(by_task.items()):
        tasks[key] = {"dense": float(d_all[idx].mean())}
        if s_all is not None:
            tasks[key]["sparse"] = float(s_all[idx].mean())
            metrics.update(_group_metrics(key, idx, d_all, s_all, sparse, resamples, seed))
    for key, idx in sorted(by_length.items()):
        metrics[f"{key}.dense_acc"] = float(d_all[idx].mean())
        if s_all is not None:
            metrics[f"{key}.sparse_acc"] = float(s_all[idx].mean())
            metrics.update(_group_metrics(key, idx, d_all, s_all, sparse, resamples, seed))
    if s_all is not None:
        ci = paired_bootstrap_diff(d_all, s_all, resamples=resamples, seed=seed)
        metrics.update(sparse_acc=float(s_all.mean()), diff=ci.mean, diff_ci_low=ci.low, diff_ci_high=ci.high)
    return tasks, metrics


def runtime_settings(runtime: Any) -> dict[str, Any]:
    """The settings the attached runtime actually uses (the artifact's defaults after the ``eval.*``
    overrides): SAAP's ``top_l`` and per-layer ``top_l_layers``; SANTA's per-layer
    ``schedule`` and its total ``budget``; ``{}`` for other methods. Logged with every evaluation, so a
    held-out result names the operating point it measured."""
    dec = getattr(runtime, "decode", None)
    if dec is not None and hasattr(dec, "schedule") and hasattr(dec, "budget"):
        schedule = [int(x) for x in dec.schedule]
        return {"schedule": schedule, "budget": sum(schedule)}
    if dec is None or not hasattr(dec, "layer_top_l"):
        return {}
    return {"top_l": int(dec.top_l), "top_l_layers": {int(k): int(v) for k, v in sorted(dec.top_l_layers.items())}}


def with_statistics(options: dict[str, dict[str, Any]], method: str) -> dict[str, dict[str, Any]]:
    """``options`` plus what eval needs that serving does not: the runtime's statistics (``hf.apply``
    serves without them: SAAP's selectivity ranks the buckets a second time per step, SANTA's adds small
    kernels to every step, SALE's and SampleAttention's sync with the host in every prefill layer). Eval
    also applies with ``serve="method"``: the method at every step, where serving falls back to dense."""
    return {**options, method: {**options.get(method, {}), "stats": True}}


def runtime_options(cfg: Any, method: str) -> dict[str, dict[str, Any]]:
    """Runtime overrides from the config: SAAP's ``eval.top_l`` (buckets visited instead of the
    artifact's ℓ, for an ℓ sweep without recalibrating), ``eval.top_l_layers`` (``{layer: ℓ}`` for some
    layers, e.g. a larger ℓ where the retrieval heads are); SANTA's ``eval.budget`` (total samples N over
    all layers instead of the artifact's deployed budget: its learned share p scaled to N). Other methods
    refuse them."""
    budget = cfg.eval.get("budget")
    if budget is not None:
        if method != "santa":
            raise UserError(f"eval.budget is a SANTA setting; this artifact is {method!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise UserError(f"eval.budget must be a positive integer (got {budget!r})")
        return {"santa": {"budget": int(budget)}}
    return _saap_options(cfg, method)


def _saap_options(cfg: Any, method: str) -> dict[str, dict[str, Any]]:
    """SAAP's ``eval.top_l`` / ``eval.top_l_layers`` (see :func:`runtime_options`)."""
    top_l, per_layer = cfg.eval.get("top_l"), cfg.eval.get("top_l_layers")
    if top_l is None and not per_layer:
        return {}
    if method != "saap":
        name = "eval.top_l" if top_l is not None else "eval.top_l_layers"
        raise UserError(f"{name} is a SAAP setting; this artifact is {method!r}")
    opts: dict[str, Any] = {}
    if top_l is not None:
        if int(top_l) < 1:
            raise UserError(f"eval.top_l must be >= 1 (got {top_l})")
        opts["top_l"] = int(top_l)
    if per_layer:
        layers = layer_map(per_layer, "eval.top_l_layers")
        opts["top_l_layers"] = layers
    return {"saap": opts}


SUITE_HEADLINES = {"diff": "acc_delta", "diff_ci_low": "acc_delta_ci_low", "diff_ci_high": "acc_delta_ci_high",
                   "dense_acc": "acc_dense", "sparse_acc": "acc_sparse"}  # suite metric -> summary name


def suite_headlines(metrics: dict[str, float], suites: list[str]) -> dict[str, float]:
    """``summary/<suite>.acc_delta`` (and its CI, dense and sparse accuracy) per suite, beside the
    pooled ``summary/*``: what ``calib eval`` writes on a registered version per distribution."""
    return {f"summary/{s}.{name}": metrics[f"suite.{s}.{src}"] for s in suites
            for src, name in SUITE_HEADLINES.items() if f"suite.{s}.{src}" in metrics}


def eval_suites(cfg: Any) -> list[str]:
    """The data sources ``eval`` answers side by side: ``eval.suites``; else the model's ``eval_suites``
    when the run's ``data`` is one of them (``data=synthetic``, the default, on a real model gives the
    synthetic tasks and the natural-text books); else the run's ``data`` alone."""
    own = str(cfg_get(cfg.data, "source", "synthetic"))
    named = cfg.eval.get("suites")
    suites = [str(s) for s in named] if named else [str(s) for s in (cfg.model.get("eval_suites") or [])]
    if not named and own not in suites:
        return [own]
    unknown = [s for s in suites if s not in available("data")]
    if unknown:
        raise UserError(f"eval.suites names {unknown[0]!r}; data sources: {', '.join(available('data'))}")
    return suites


def suite_config(cfg: Any, name: str) -> Any:
    """``cfg`` with ``data`` = suite ``name``: the run's own ``data`` when it is that source (overrides
    kept), else ``conf/data/<name>.yaml`` (interpolations such as ``eval.tasks: ${data.tasks}`` then
    follow the suite's own tasks)."""
    if str(cfg_get(cfg.data, "source", "synthetic")) == name:
        return cfg
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    out.data = OmegaConf.load(config_dir() / "data" / f"{name}.yaml")
    return out


def suite_prompts(cfg: Any, tokenizer: Any, suites: list[str]) -> tuple[list[Any], dict[str, list[int]]]:
    """Every suite's held-out prompts, concatenated, and the indexes of each suite's prompts."""
    prompts: list[Any] = []
    index: dict[str, list[int]] = {}
    for name in suites:
        part = evaluation_prompts(suite_config(cfg, name), tokenizer)
        index[name] = list(range(len(prompts), len(prompts) + len(part)))
        prompts += part
    return prompts, index


def real_text_metrics(cfg: Any, loaded: Any, artifact: Any, method: str) -> dict[str, float]:
    """``eval.nll``: mean next-token NLL on the shipped real text, dense and with the artifact
    (``calib.perplexity``); ``{}`` when ``eval.nll.chunks`` is 0."""
    nll = cfg.eval.get("nll")
    if nll is None or int(nll.chunks) < 1:
        return {}
    t0 = time.perf_counter()
    out = real_text_nll(loaded, chunk_tokens=int(nll.chunk_tokens), chunks=int(nll.chunks),
                        decode_tokens=int(nll.decode_tokens), artifact=artifact,
                        options=runtime_options(cfg, method) if artifact is not None else None,
                        batch_tokens=int(cfg.eval.get("batch_tokens") or 0))
    out["time_nll_s"] = time.perf_counter() - t0
    line = f"real-text NLL: dense {out['nll_dense']:.4f}"
    if "nll_sparse" in out:
        line += f"  sparse {out['nll_sparse']:.4f}  ({100 * out['nll_increase']:+.2f} %)"
    print(f"{line}  over {int(out['nll_tokens'])} tokens", file=sys.stderr)
    return out


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run the held-out evaluation; returns the result JSON ``calib eval`` prints last."""
    import mlflow

    validate_common(cfg)
    suites = eval_suites(cfg)
    for name in suites:
        check_data(suite_config(cfg, name).data, EVAL_NEEDS)  # bad data fails before the model loads
    device = resolve_device(str(cfg.get("device", "auto")))
    target = tracking.resolve_target(cfg.get("tracking"))
    tracking.configure(target)  # before resolving models:/ URIs, so they resolve in the project's store
    loaded = load_model(cfg.model, device=str(device))
    artifact = None
    if cfg.get("artifact"):
        artifact = load_artifact(str(cfg.artifact), model=hf.model_facts(loaded.model),
                                 tracking_uri=target.tracking_uri)
        if artifact.manifest.data.seed is not None and int(artifact.manifest.data.seed) == int(cfg.eval.seed):
            raise UserError(f"eval.seed={cfg.eval.seed} is the artifact's calibration seed: pick another eval.seed")
    registry.check_eval_method(cfg.get("method"), cfg.get("artifact"), artifact.method if artifact else None)
    runtime_options(cfg, artifact.method if artifact else "dense")  # a bad override fails before any work
    prompts, suite_index = suite_prompts(cfg, loaded.tokenizer, suites)
    if not prompts:
        raise UserError("no evaluation prompts: check eval.tasks / eval.lengths / eval.num_prompts")
    method = artifact.method if artifact else "dense"
    loop = eval_loop(cfg, device, method)  # a bad eval.loop fails before any answer
    run_name = registry.eval_run_name(cfg.get("artifact"), method, str(cfg.model.name))
    with tracking.start_run(target, run_name, tags={"kind": "eval", "method": method}) as run:
        mlflow.log_params({"artifact": str(cfg.get("artifact")), "model": str(cfg.model.name),
                           "eval.seed": int(cfg.eval.seed), "eval.num_prompts": int(cfg.eval.num_prompts),
                           "eval.max_new_tokens": int(cfg.eval.max_new_tokens),
                           "eval.batch_tokens": int(cfg.eval.get("batch_tokens") or 0),
                           "eval.loop": loop, "eval.suites": ",".join(suites),
                           "eval.top_l": cfg.eval.get("top_l"),
                           "eval.top_l_layers": str(cfg.eval.get("top_l_layers")), "eval.budget": cfg.eval.get("budget")})
        for name, idx in suite_index.items():
            tracking.log_eval_prompts(suite_config(cfg, name).data, [prompts[i] for i in idx], int(cfg.eval.seed))
        t0 = time.perf_counter()
        batch_tokens = int(cfg.eval.get("batch_tokens") or 0)
        dense = cached_dense_answers(loaded, prompts, int(cfg.eval.max_new_tokens), batch_tokens, loop)
        timings = {"time_dense_s": time.perf_counter() - t0}
        sparse, settings = None, {}
        if artifact is not None:
            runtime = hf.apply(loaded.model, artifact, options=with_statistics(runtime_options(cfg, method), method),
                               serve="method")
            settings = runtime_settings(runtime)
            mlflow.log_params({f"runtime.{k}": str(v) for k, v in settings.items()})
            try:
                t0 = time.perf_counter()
                sparse = answer_prompts(loaded, prompts, int(cfg.eval.max_new_tokens), runtime, desc=method,
                                        batch_tokens=batch_tokens, loop=loop)
                timings["time_sparse_s"] = time.perf_counter() - t0
            finally:
                hf.remove(loaded.model)
        tasks, metrics = summarize(dense, sparse, int(cfg.eval.bootstrap), int(cfg.seed), suite_index)
        metrics.update(timings)
        metrics.update(real_text_metrics(cfg, loaded, artifact, method))
        mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in metrics.items()})
        summary = tracking.log_eval_summary(method, metrics, [r.stats for r in sparse or []])
        summary.update(suite_headlines(metrics, suites))
        mlflow.log_metrics(suite_headlines(metrics, suites))
        if artifact is not None and not runtime_options(cfg, method):  # the artifact's own operating point
            registry.record_eval(cfg.artifact, artifact.path, summary, seed=int(cfg.eval.seed),
                                 num_prompts=len(prompts), run_id=run.info.run_id)
        mlflow.log_dict({"tasks": tasks, "metrics": metrics, "config": to_container(cfg), "runtime": settings,
                         "dense_predictions": [r.__dict__ for r in dense],
                         "sparse_predictions": [r.__dict__ for r in sparse] if sparse else None}, "eval.json")
    result: dict[str, Any] = {"artifact": str(cfg.artifact) if cfg.get("artifact") else None, "tasks": tasks,
                              "metrics": metrics, "summary": summary, "run_id": run.info.run_id}
    for key, entry in tasks.items():
        print(f"{key:>28}: dense {entry['dense']:.3f}" + (f"  sparse {entry['sparse']:.3f}" if "sparse" in entry else ""),
              file=sys.stderr)
    return result
