"""MLflow tracking with an embedded default store (SPEC §6).

Default: a SQLite backend ``artifacts/mlflow.db`` and a local artifact store ``artifacts/mlruns``, both
absolute URIs, no server. ``MLFLOW_TRACKING_URI`` in the environment wins over the config, and the
config's ``tracking.uri`` wins over the default. A file lock serializes store initialization and
experiment creation so parallel runs (a Hydra multirun with a parallel launcher) never race on the
SQLite schema migration or on ``create_experiment``.

Never put the SQLite file on a network volume: SQLite's locking is unreliable there (on Kubernetes the
aggregator logs to a tracking server instead, see deploy/k8s).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from calib.errors import UserError
from calib.paths import artifacts_dir


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
    """Point mlflow at ``target`` and return the experiment id (created under a file lock if missing)."""
    import mlflow
    from filelock import FileLock
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
                exp_id = client.create_experiment(target.experiment, artifact_location=target.artifact_root)
            else:
                exp_id = exp.experiment_id
    except MlflowException as exc:
        raise UserError(f"cannot use tracking store {target.tracking_uri}: {exc.message.splitlines()[0]}") from None
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


@contextlib.contextmanager
def start_run(target: TrackingTarget, run_name: str, tags: Mapping[str, str] | None = None) -> Iterator[Any]:
    """Configure tracking and open a run; the run ends FAILED if the body raises."""
    import mlflow

    exp_id = configure(target)
    with mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=dict(tags or {})) as run:
        yield run


class StageTimer:
    """Wall time per pipeline stage, logged to MLflow as ``time_<stage>_s`` (SPEC §9)."""

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
