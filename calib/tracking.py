"""MLflow tracking with an embedded default store (docs/mlflow.md).

Default: a SQLite backend ``artifacts/mlflow.db`` and a local artifact store ``artifacts/mlruns``, both
absolute URIs, no server. ``MLFLOW_TRACKING_URI`` in the environment wins over the config, and the
config's ``tracking.uri`` wins over the default. A file lock serializes store initialization and
experiment creation so parallel runs (a Hydra multirun with a parallel launcher) never race on the
SQLite schema migration or on ``create_experiment``.

Never put the SQLite file on a network volume: SQLite's locking is unreliable there (on Kubernetes the
aggregator logs to a tracking server instead, see deploy/k8s).

What a user sees in the MLflow UI is shaped here too (docs/mlflow.md):

* every experiment calib uses is tagged ``mlflow.experimentKind = custom_model_development``, so the
  UI opens it on the runs table instead of the GenAI overview;
* every ``run`` and ``eval`` logs a few ``summary/*`` metrics with the same names for all four methods
  (:data:`RUN_HEADLINES`, :data:`EVAL_HEADLINES`), beside the method-specific ones;
* calibration and evaluation prompts are logged as MLflow dataset inputs (:func:`log_prompt_set`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

from filelock import FileLock

from calib.data import dataset_hash
from calib.data.sources import cfg_get
from calib.errors import UserError
from calib.paths import artifacts_dir

# mlflow, matplotlib and the manifest (torch) are imported where used: calib.evaluate imports this module
# and its answer path (scripts on GPU machines) must import without mlflow, and the CLI resolves the
# tracking target in checks that must fail fast.

# MLflow 3's UI picks an experiment's landing page from this tag: without it, it guesses (often the
# GenAI overview); model development opens on the runs table.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_DEVELOPMENT = "custom_model_development"


@dataclass(frozen=True)
class TrackingTarget:
    tracking_uri: str
    registry_uri: str
    artifact_root: str | None  # for new experiments; None = the server's default
    experiment: str


def default_tracking_uri() -> str:
    return f"sqlite:///{(artifacts_dir() / 'mlflow.db').resolve()}"


def default_artifact_root() -> str:
    return (artifacts_dir() / "mlruns").resolve().as_uri()


def resolve_target(tracking_cfg: Mapping[str, Any] | None = None) -> TrackingTarget:
    """Decide where to log: env ``MLFLOW_TRACKING_URI`` > ``tracking.uri`` > embedded SQLite."""
    cfg = dict(tracking_cfg or {})
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.get("uri") or default_tracking_uri()
    local = uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri
    root = cfg.get("artifact_root") or (default_artifact_root() if local else None)
    registry = os.environ.get("MLFLOW_REGISTRY_URI") or cfg.get("registry_uri") or uri
    return TrackingTarget(uri, registry, root, cfg.get("experiment") or "calib")


def _lock_path(target: TrackingTarget) -> Path:
    if target.tracking_uri.startswith("sqlite:///"):
        return Path(target.tracking_uri[len("sqlite:///"):] + ".lock")
    return artifacts_dir() / ".mlflow-experiment.lock"


def configure(target: TrackingTarget) -> str:
    """Point mlflow at ``target`` and return the experiment id (created under a file lock if missing).

    The experiment is tagged as model development (:data:`EXPERIMENT_KIND_TAG`); an existing experiment
    without that tag (or with another kind) gets it here, so every command fixes an older store."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if target.tracking_uri.startswith("sqlite:///"):
        Path(target.tracking_uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    lock = _lock_path(target)
    lock.parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(target.tracking_uri)
    mlflow.set_registry_uri(target.registry_uri)
    try:
        with FileLock(str(lock), timeout=300):
            client = mlflow.MlflowClient()
            exp = client.get_experiment_by_name(target.experiment)
            if exp is None:
                exp_id = client.create_experiment(target.experiment, artifact_location=target.artifact_root,
                                                  tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT})
            else:
                exp_id = exp.experiment_id
                if exp.tags.get(EXPERIMENT_KIND_TAG) != MODEL_DEVELOPMENT:
                    client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT)
    except MlflowException as exc:
        raise UserError(f"cannot use tracking store {target.tracking_uri}: {exc.message.splitlines()[0]}") from None
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


DRY_RUN_TAG = "calib.dry_run"  # "true" on runs of model.init=random (random weights: cost only)


@contextlib.contextmanager
def start_run(target: TrackingTarget, run_name: str, tags: Mapping[str, str] | None = None) -> Iterator[Any]:
    """Configure tracking and open a run; the run ends FAILED if the body raises."""
    import mlflow

    exp_id = configure(target)
    with mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=dict(tags or {})) as run:
        yield run


class StageTimer:
    """Wall time per pipeline stage, logged to MLflow as ``time_<stage>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            try:
                import mlflow

                if mlflow.active_run() is not None:
                    mlflow.log_metric(f"time_{name}_s", self.seconds[name])
            except ImportError:
                pass


def log_figure(fig: Any, artifact_file: str) -> None:
    """Log a matplotlib figure to the active run (PNG) and close it."""
    import matplotlib.pyplot as plt
    import mlflow

    mlflow.log_figure(fig, artifact_file)
    plt.close(fig)


def flat_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Flatten nested metric dicts into ``a.b.c`` keys, keeping only finite numbers."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_metrics(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            out[name] = float(value)
    return out


# ----------------------------------------------------------------------------- headline metrics
SUMMARY_PREFIX = "summary/"


class Headline(NamedTuple):
    """Where a ``summary/*`` metric comes from: a metric the run already logs, maybe as ``1 - value``."""

    source: str  # the metric's name in the run's flattened metrics (or a runtime statistic, for eval)
    complement: bool = False  # report 1 - value: a kept fraction (selectivity, sample fraction) as sparsity


# One name per concept for all four methods (docs/mlflow.md):
#   summary/sparsity   fraction of attention work skipped: 1 - (keys, blocks or value rows attended) / all
#   summary/rel_error  relative error of the attention output against dense, as calibration measures it
#   summary/recall     share of the dense attention mass that the selected keys hold
#   summary/acc_dense, summary/acc_sparse   held-out task accuracy dense / with the method, where the
#                      recipe measures it (the names `calib eval` logs for the same figures)
#   summary/wall_s     wall time of the whole MLflow run (logged for every method, not in this table)
# A method that does not measure a concept leaves it out ("where defined").
RUN_HEADLINES: dict[str, dict[str, Headline]] = {
    "saap": {  # each layer at the artifact's default ℓ, averaged over layers and heads (calib.saap.report)
        "sparsity": Headline("at_top_l.selectivity.saap", complement=True),  # keys outside sink + window
        "rel_error": Headline("at_top_l.rel_error.saap"),
        "recall": Headline("at_top_l.recall.saap"),
    },
    "sale": {  # the per-head tau on the calibration samples (calib.sale.recipe)
        "sparsity": Headline("sparsity"),
        "rel_error": Headline("err_worst"),  # the worst head: the bound theta applies to every head
        "acc_dense": Headline("ablation.acc_dense"),  # held-out accuracy (compare_shared_tau, ablation_prompts > 0)
        "acc_sparse": Headline("ablation.acc_per_head"),
    },
    "sampleattention": {  # the tuned row of the longest length bucket (calib.sampleattention.recipe)
        "sparsity": Headline("sparsity_longest_bucket"),
    },
    "santa": {  # held-out task accuracy of the learned schedule (calib.santa.heldout)
        "acc_dense": Headline("reward_dense"),
        "acc_sparse": Headline("reward_learned"),
    },
}

# ``calib eval``'s overall figures (calib.evaluate.summarize): accuracy dense and sparse, and the paired
# bootstrap 95% CI of (sparse - dense).
EVAL_HEADLINES: dict[str, Headline] = {
    "acc_dense": Headline("dense_acc"),
    "acc_sparse": Headline("sparse_acc"),
    "acc_delta": Headline("diff"),
    "acc_delta_ci_low": Headline("diff_ci_low"),
    "acc_delta_ci_high": Headline("diff_ci_high"),
}

# The runtime statistic (``pop_stats()`` per prompt) that gives an evaluation's summary/sparsity.
EVAL_SPARSITY_STATS: dict[str, Headline] = {
    "saap": Headline("selectivity", complement=True),
    "sale": Headline("sparsity"),
    "sampleattention": Headline("sparsity"),
    "santa": Headline("sample_fraction", complement=True),
}


def headline_metrics(table: Mapping[str, Headline], metrics: Mapping[str, float]) -> dict[str, float]:
    """``summary/<name>`` for every entry of ``table`` whose source metric is in ``metrics``."""
    out: dict[str, float] = {}
    for name, headline in table.items():
        if headline.source in metrics:
            value = float(metrics[headline.source])
            out[SUMMARY_PREFIX + name] = 1.0 - value if headline.complement else value
    return out


def eval_sparsity(method: str, per_prompt_stats: Sequence[Mapping[str, float]]) -> float | None:
    """Mean over prompts of ``method``'s sparsity statistic (:data:`EVAL_SPARSITY_STATS`); ``None`` when
    the method has none or no prompt reported it."""
    headline = EVAL_SPARSITY_STATS.get(method)
    if headline is None:
        return None
    values = [float(s[headline.source]) for s in per_prompt_stats if headline.source in s]
    if not values:
        return None
    mean = sum(values) / len(values)
    return 1.0 - mean if headline.complement else mean


# Every summary/* name, in the order the UI's headline view and run descriptions show them.
SUMMARY_NAMES = ("sparsity", "acc_delta", "acc_delta_ci_low", "acc_delta_ci_high", "acc_sparse", "acc_dense",
                 "rel_error", "recall", "wall_s")
SUMMARY_DIGITS = 4  # significant digits of a logged summary figure (the method's own metrics keep all)
RUN_DESCRIPTION_TAG = "mlflow.note.content"  # the run page's Description (markdown)


def summary_line(summary: Mapping[str, float]) -> str:
    """``sparsity 0.613 · rel_error 0.0481 · wall_s 85``: the summary figures in :data:`SUMMARY_NAMES`
    order (3 significant digits), for a run's description."""
    parts = []
    for name in SUMMARY_NAMES:
        value = summary.get(SUMMARY_PREFIX + name)
        if value is not None:
            parts.append(f"{name} {value:.0f}" if name == "wall_s" else f"{name} {value:.3g}")
    return " · ".join(parts)


def _log_summary(summary: dict[str, float]) -> dict[str, float]:
    """Log ``summary`` (plus wall time), rounded to :data:`SUMMARY_DIGITS` significant digits so the runs
    table shows readable figures, to the active run and put it in the run's description."""
    import mlflow

    summary[SUMMARY_PREFIX + "wall_s"] = _active_run_wall_s()
    summary = {name: float(f"{value:.{SUMMARY_DIGITS}g}") for name, value in summary.items()}
    mlflow.log_metrics(summary)
    mlflow.set_tag(RUN_DESCRIPTION_TAG, summary_line(summary))
    return summary


def _active_run_wall_s() -> float:
    import mlflow

    run = mlflow.active_run()
    return max(0.0, time.time() - run.info.start_time / 1000.0) if run is not None else 0.0


def log_run_summary(method: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """Log the ``summary/*`` metrics of a ``run`` (:data:`RUN_HEADLINES` + wall time) and a description
    line with them; returns them."""
    return _log_summary(headline_metrics(RUN_HEADLINES.get(method, {}), metrics))


def log_eval_summary(method: str, metrics: Mapping[str, float], sparse_stats: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Log the ``summary/*`` metrics of an ``eval`` (:data:`EVAL_HEADLINES`, the runtime's mean sparsity
    over ``sparse_stats`` — one dict per prompt — and wall time) and a description line; returns them."""
    summary = headline_metrics(EVAL_HEADLINES, metrics)
    sparsity = eval_sparsity(method, sparse_stats)
    if sparsity is not None:
        summary[SUMMARY_PREFIX + "sparsity"] = sparsity
    return _log_summary(summary)


# ---------------------------------------------------------------------------- dataset inputs
DIGEST_CHARS = 12  # MLflow caps a dataset digest at 36 characters and shows it inline in the runs table
CALIBRATION, EVALUATION = "calibration", "evaluation"  # the dataset inputs' contexts


def describe_data(data_cfg: Any, purpose: str, record: Any) -> tuple[str, dict[str, Any]]:
    """A readable dataset name and the fields that locate the prompts, from the ``data`` config node
    and the prompt set's ``DataRecord``.

    Synthetic prompts are identified by their tasks, lengths and seed (as the record states them); a
    JSONL file by its path (``eval_path`` for evaluation when set, else the hash split); an HF dataset
    by name, config, revision and split (``eval_split`` for evaluation when set)."""
    source = str(cfg_get(data_cfg, "source", "synthetic"))
    held_out = purpose == EVALUATION
    if source in ("jsonl", "hf"):  # held-out rows: their own file / split, else a hash of each row's text
        held_out_part = cfg_get(data_cfg, "eval_path" if source == "jsonl" else "eval_split")
        hashed = "" if held_out_part else f" ({purpose} hash split)"
        own = held_out_part if held_out else None
    if source == "jsonl":
        path = str(own or cfg_get(data_cfg, "path"))
        return Path(path).name + hashed, {"source": source, "path": path}
    if source == "hf":
        fields = {"source": source, "name": str(cfg_get(data_cfg, "name")), "config": cfg_get(data_cfg, "config"),
                  "revision": cfg_get(data_cfg, "revision"), "split": str(own or cfg_get(data_cfg, "split"))}
        return f"{fields['name']}:{fields['split']}{hashed}", fields
    seed = record.seed
    fields = {"source": source, "tasks": list(record.tasks), "lengths": [int(x) for x in record.lengths], "seed": seed}
    return (f"{source} seed={seed}" if seed is not None else source), fields


def _dataset_source(fields: Mapping[str, Any]) -> Any:
    """MLflow's own source type where one fits (a Hugging Face dataset, a local file), else ``code``
    (prompts generated by calib) with the fields as its tags."""
    if fields["source"] == "hf":
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        return HuggingFaceDatasetSource(path=fields["name"], config_name=fields.get("config"),
                                        split=fields["split"], revision=fields.get("revision"))
    if fields["source"] == "jsonl":
        from mlflow.data.dataset_source_registry import get_dataset_source_from_json

        uri = Path(fields["path"]).resolve().as_uri()
        return get_dataset_source_from_json(json.dumps({"uri": uri}), source_type="local")
    from mlflow.data.code_dataset_source import CodeDatasetSource

    return CodeDatasetSource(tags={k: json.dumps(v) if not isinstance(v, str) else v for k, v in fields.items()})


@functools.cache
def _prompt_set_class() -> type:
    """``PromptSet``: an MLflow ``MetaDataset`` (no rows logged) that also carries a profile."""
    from mlflow.data.meta_dataset import MetaDataset

    class PromptSet(MetaDataset):
        def __init__(self, source: Any, name: str, digest: str, profile: dict[str, Any]) -> None:
            self._profile = profile
            super().__init__(source=source, name=name, digest=digest)

        @property
        def profile(self) -> dict[str, Any]:
            return self._profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self._profile, sort_keys=True)}

    return PromptSet


def log_prompt_set(record: Any, data_cfg: Any, context: str) -> None:
    """Log a prompt set as a dataset input of the active run.

    ``record`` is a :class:`runtime_kernels.manifest.DataRecord` (the manifest's ``data``): the digest is
    the first :data:`DIGEST_CHARS` hex digits of its ``content_hash`` and the profile holds the whole
    hash, the prompt count, tasks, lengths and seed. ``context``: ``calibration`` or ``evaluation``."""
    import mlflow

    name, fields = describe_data(data_cfg, context, record)
    profile = {"content_hash": record.content_hash, "num_prompts": int(record.count),
               "tasks": list(record.tasks), "lengths": [int(x) for x in record.lengths], "seed": record.seed}
    dataset = _prompt_set_class()(_dataset_source(fields), name, record.content_hash[:DIGEST_CHARS], profile)
    mlflow.log_input(dataset, context=context)


def log_eval_prompts(data_cfg: Any, prompts: Sequence[Any], seed: int) -> None:
    """Log ``calib eval``'s held-out prompts (drawn with ``seed``) as the run's ``evaluation`` dataset."""
    from runtime_kernels.manifest import DataRecord

    record = DataRecord(source=str(cfg_get(data_cfg, "source", "synthetic")), seed=seed, count=len(prompts),
                        lengths=sorted({int(p.length) for p in prompts}), content_hash=dataset_hash(prompts),
                        tasks=sorted({str(p.task) for p in prompts}))
    log_prompt_set(record, data_cfg, EVALUATION)
