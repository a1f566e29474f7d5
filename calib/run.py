"""``run``: calibrate one method, write its artifact, log everything and register a version.

Each method is a recipe module ``calib.<method>.recipe`` with

* ``validate(cfg) -> None`` — range checks of the method's keys (raise ``UserError``),
* ``data_needs(cfg) -> {purpose: reason | None}`` — the data it reads and why rows need answers
  (:mod:`calib.data.checks`), checked before the model loads, and
* ``calibrate(cfg, ctx: RunContext) -> MethodOutput`` — the work, logging plots/metrics as it goes.

Everything shared (tracking, the manifest, the atomic write, the registry) happens here, so a recipe
never touches the artifact format or MLflow's registry. Recipes do not inherit from each other.
"""

from __future__ import annotations

import importlib
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from calib import __version__, registry, tracking
from calib.config import available_methods, to_container, validate_common
from calib.data import check_data
from calib.errors import UserError
from calib.models import resolve_device
from calib.paths import artifacts_dir, project_root
from runtime_kernels.artifact import ABI_VERSIONS, local_path
from runtime_kernels.manifest import DataRecord, Manifest, ModelRecord, ProducerRecord, write_artifact

# mlflow is imported where used: every recipe imports this module (MethodOutput), and the CLI imports the
# recipe for its checks of a run's settings and data, which must fail fast.


@dataclass
class MethodOutput:
    """What a recipe returns: the artifact's contents and its headline metrics."""

    tensors: dict[str, dict[str, torch.Tensor]]  # file stem -> {tensor name -> tensor}
    hyperparameters: dict[str, Any]
    model: dict[str, Any]  # ModelRecord fields (calib.models.ModelFacts.to_dict())
    data: DataRecord
    metrics: dict[str, float]
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunContext:
    """Handed to recipes: the run id, the stage timer and the resolved device."""

    run_id: str
    timer: tracking.StageTimer
    device: torch.device


def method_name(cfg: DictConfig) -> str:
    method = cfg.get("method")
    if method is None or "name" not in method:
        raise UserError(f"no method given: add +method=<name>, one of: {', '.join(available_methods())}")
    return str(method.name)


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project_root(), capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def load_recipe(method: str) -> Any:
    try:
        return importlib.import_module(f"calib.{method}.recipe")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith(f"calib.{method}"):
            raise UserError(f"method {method!r} has a config but no recipe (calib/{method}/recipe.py)") from None
        raise


def build_manifest(method: str, cfg: DictConfig, out: MethodOutput) -> Manifest:
    model = ModelRecord(**{k: v for k, v in out.model.items() if k in ModelRecord.__dataclass_fields__})
    producer = ProducerRecord(
        package="calib", version=__version__, git_sha=git_sha(),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), config=to_container(cfg),
    )
    return Manifest(method=method, abi_version=ABI_VERSIONS[method], model=model,
                    hyperparameters=out.hyperparameters, data=out.data, producer=producer,
                    metrics=tracking.flat_metrics(out.metrics), payload=out.payload)


def _run_artifact_dir(run_id: str) -> Path | None:
    """The local directory of the run's artifact store, when the store is a local file store."""
    import mlflow

    uri = mlflow.get_run(run_id).info.artifact_uri
    return local_path(uri)


def write_and_publish(method: str, cfg: DictConfig, out: MethodOutput, run_id: str, scratch: Path) -> tuple[Path, registry.Published]:
    """Write the artifact atomically (into the run's local store when there is one) and register it."""
    manifest = build_manifest(method, cfg, out)
    local_root = _run_artifact_dir(run_id)
    target = (local_root / registry.ARTIFACT_PATH) if local_root is not None else scratch / f"{method}-{run_id}"
    artifact_dir = write_artifact(target, manifest, out.tensors)
    return artifact_dir, registry.publish(artifact_dir, run_id)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Calibrate ``cfg.method`` on ``cfg.model`` and register the artifact; returns the result JSON."""
    import mlflow

    validate_common(cfg)
    method = method_name(cfg)
    recipe = load_recipe(method)
    recipe.validate(cfg)
    check_data(cfg.data, recipe.data_needs(cfg))  # bad data fails before the model loads
    device = resolve_device(str(cfg.get("device", "auto")))
    target = tracking.resolve_target(cfg.get("tracking"))
    run_name = f"{method}-{cfg.model.name}"
    tags = {"method": method, "model": str(cfg.model.name)}
    if is_dry_run(cfg):
        tags[tracking.DRY_RUN_TAG] = "true"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tracking.start_run(target, run_name, tags=tags) as active:
        run_id = active.info.run_id
        mlflow.log_params(_params(cfg))
        ctx = RunContext(run_id=run_id, timer=tracking.StageTimer(), device=device)
        out = recipe.calibrate(cfg, ctx)
        tracking.log_prompt_set(out.data, cfg.data, tracking.CALIBRATION)
        with ctx.timer.stage("publish"):
            artifact_dir, pub = write_and_publish(method, cfg, out, run_id, artifacts_dir() / "scratch")
        out.metrics.update(peak_memory_metrics(device))
        for stage, seconds in ctx.timer.seconds.items():  # every method's result JSON has its stage times
            out.metrics.setdefault(f"time_{stage}_s", seconds)
        mlflow.log_metrics(tracking.flat_metrics(out.metrics))
        tracking.log_run_summary(method, tracking.flat_metrics(out.metrics))
    return {"model_uri": pub.model_uri, "run_id": run_id, "artifact_dir": str(artifact_dir),
            "metrics": tracking.flat_metrics(out.metrics)}


def is_dry_run(cfg: DictConfig) -> bool:
    """True for ``model.init=random``: random weights, a run for measuring cost only."""
    return str(cfg.model.get("init") or "pretrained") == "random"


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """``peak_host_rss_gb`` of this process (ru_maxrss) and, on CUDA, ``peak_gpu_mem_gb`` since the run began."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"peak_host_rss_gb": rss * (1 if sys.platform == "darwin" else 1024) / 1e9}
    if device.type == "cuda":
        out["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out


def _params(cfg: DictConfig) -> dict[str, str]:
    """Flattened config for ``mlflow.log_params`` (values cut to MLflow's 6000-char limit)."""
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = str(node)[:6000]

    walk(to_container(cfg), "")
    return flat
