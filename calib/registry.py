"""The model registry: publish an artifact directory, move aliases, list versions (SPEC §6).

MLflow 3 registers only ``runs:/`` URIs of *logged models* through ``mlflow.register_model``; a plain
artifact directory is registered with ``MlflowClient.create_model_version(name, source=<artifact
uri>, run_id=...)``, which is what :func:`publish` does after logging the directory to the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib.errors import UserError
from runtime_kernels.manifest import artifact_sha256, read_artifact

ARTIFACT_PATH = "artifact"  # where the directory is logged inside the run's artifacts
CANDIDATE = "candidate"
CHAMPION = "champion"


def model_name(method: str, model: str) -> str:
    """Registered model name: ``<method>-<model>``."""
    return f"{method}-{model}"


@dataclass(frozen=True)
class Published:
    name: str
    version: str
    model_uri: str
    source: str
    artifact_sha256: str


def publish(artifact_dir: str | Path, run_id: str, *, alias: str = CANDIDATE) -> Published:
    """Log ``artifact_dir`` to run ``run_id``, register a new version, tag it and set ``alias``.

    The directory is verified first (every sha256), so a half-written or tampered artifact is never
    registered. Tags: schema version, method, method ABI, artifact sha256, model name and hash.
    """
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    art = read_artifact(artifact_dir)
    m = art.manifest
    name = model_name(m.method, m.model.name)
    digest = artifact_sha256(artifact_dir)
    client = MlflowClient()
    run_root = client.get_run(run_id).info.artifact_uri.rstrip("/")
    source = f"{run_root}/{ARTIFACT_PATH}"
    if not _is_logged_copy(Path(artifact_dir), source):
        client.log_artifacts(run_id, str(artifact_dir), artifact_path=ARTIFACT_PATH)
    try:
        client.create_registered_model(name, description=f"calib {m.method} artifacts for model {m.model.name}")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code) and "already exists" not in str(exc):
            raise
    tags = {
        "schema_version": str(m.schema_version),
        "method": m.method,
        "abi_version": str(m.abi_version),
        "artifact_sha256": digest,
        "model": m.model.name,
        "model_hash": m.model.model_hash or "",
        "metrics": metrics_tag(m.metrics),
    }
    mv = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
    _wait_ready(client, name, mv.version)
    client.set_registered_model_alias(name, alias, mv.version)
    mlflow.set_tags({"registered_model": name, "registered_version": mv.version})
    return Published(name, str(mv.version), f"models:/{name}/{mv.version}", source, digest)


def metrics_tag(metrics: dict[str, Any], limit: int = 4000) -> str:
    """The manifest's metrics as the version's ``metrics`` tag: valid JSON of at most ``limit`` characters
    (MLflow caps tag values). When all of them do not fit, the shortest-named first (the headline
    ``recall_at_sel*`` / ``at_top_l.*`` before the nested diagnostics), then by name, until the next one
    would not fit — never a JSON string cut in the middle, which ``calib ls`` could not read."""
    full = json.dumps(metrics, sort_keys=True)
    if len(full) <= limit:
        return full
    kept: dict[str, Any] = {}
    for key in sorted(metrics, key=lambda k: (k.count("."), len(k), k)):
        trial = {**kept, key: metrics[key]}
        if len(json.dumps(trial, sort_keys=True)) > limit:
            break
        kept = trial
    return json.dumps(kept, sort_keys=True)


def _is_logged_copy(artifact_dir: Path, source: str) -> bool:
    """True when ``artifact_dir`` already IS the run's ``artifact/`` folder (a local file store)."""
    from runtime_kernels.artifact import local_path

    local = local_path(source)
    return local is not None and local.exists() and local.resolve() == artifact_dir.resolve()


def _wait_ready(client: Any, name: str, version: str, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = client.get_model_version(name, version).status
        if status == "READY":
            return
        if status == "FAILED_REGISTRATION":
            raise UserError(f"registering {name} v{version} failed")
        time.sleep(0.2)


def promote(name: str, version: str, alias: str = CHAMPION) -> str:
    """Point ``alias`` of registered model ``name`` at ``version``; returns the model URI."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    try:
        client.get_model_version(name, str(version))
        client.set_registered_model_alias(name, alias, str(version))
    except MlflowException as exc:
        raise UserError(f"cannot promote {name} v{version}: {exc.message.splitlines()[0]} (see `python -m calib ls`)") from None
    return f"models:/{name}@{alias}"


@dataclass
class VersionRow:
    name: str
    version: str
    aliases: list[str]
    method: str
    model: str
    created: str
    metrics: dict[str, Any]


def list_versions(name_filter: str | None = None) -> list[VersionRow]:
    """Every registered version (newest first per model), with aliases, tags and headline metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    rows: list[VersionRow] = []
    for rm in client.search_registered_models(max_results=1000):
        if name_filter and name_filter not in rm.name:
            continue
        aliases: dict[str, list[str]] = {}
        for alias, version in (rm.aliases or {}).items():
            aliases.setdefault(str(version), []).append(alias)
        for mv in client.search_model_versions(f"name='{rm.name}'", max_results=1000):
            tags = mv.tags or {}
            try:
                metrics = json.loads(tags.get("metrics", "{}"))
            except json.JSONDecodeError:
                metrics = {}
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mv.creation_timestamp / 1000))
            rows.append(VersionRow(rm.name, str(mv.version), sorted(aliases.get(str(mv.version), [])),
                                   tags.get("method", ""), tags.get("model", ""), created, metrics))
    rows.sort(key=lambda r: (r.name, -int(r.version)))
    return rows


def format_table(rows: list[VersionRow], max_metrics: int = 4) -> str:
    """A plain-text table of :func:`list_versions` rows."""
    header = ["name", "version", "aliases", "method", "model", "created", "metrics"]
    body = []
    for r in rows:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in list(r.metrics.items())[:max_metrics])
        body.append([r.name, r.version, ",".join(r.aliases) or "-", r.method, r.model, r.created, shown])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
