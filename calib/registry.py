"""The model registry: publish an artifact directory, move aliases, list versions (docs/mlflow.md).

MLflow 3 registers only ``runs:/`` URIs of *logged models* through ``mlflow.register_model``; a plain
artifact directory is registered with ``MlflowClient.create_model_version(name, source=<artifact
uri>, run_id=...)``, which is what :func:`publish` does after logging the directory to the run.

A version carries readable tags: what it is (schema, method, ABI, artifact and model hashes) and, once
``calib eval`` has evaluated it through a ``models:/`` URI, its held-out figures (:data:`EVAL_TAGS`,
written by :func:`record_eval`). ``calib ls`` shows both; ``calib promote`` warns when a version has no
eval or its CI lower bound is below a threshold (:func:`promotion_warning`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import OmegaConf

from calib.errors import UserError
from calib.paths import config_dir
from calib.tracking import DRY_RUN_TAG
from runtime_kernels.artifact import local_path
from runtime_kernels.manifest import artifact_sha256, read_artifact

# mlflow is imported where used: calib.evaluate imports this module, and its answer path (scripts on GPU
# machines) must import without it.

ARTIFACT_PATH = "artifact"  # where the directory is logged inside the run's artifacts
CANDIDATE = "candidate"
CHAMPION = "champion"
MIN_CI_LOW = -0.05  # promote warns below this CI lower bound of (sparse - dense) held-out accuracy


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
    registered. Tags: schema version, method, method ABI, artifact sha256, model name and hash. The run
    is renamed ``<name>-v<version>`` (``saap-tiny-v3``), so the runs table says what each run produced.
    """
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
    }
    if m.model.dry_run:
        tags[DRY_RUN_TAG] = "true"
    mv = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
    _wait_ready(client, name, mv.version)
    client.set_registered_model_alias(name, alias, mv.version)
    client.set_tag(run_id, "registered_model", name)
    client.set_tag(run_id, "registered_version", str(mv.version))
    client.update_run(run_id, name=f"{name}-v{mv.version}")
    return Published(name, str(mv.version), f"models:/{name}/{mv.version}", source, digest)


def _is_logged_copy(artifact_dir: Path, source: str) -> bool:
    """True when ``artifact_dir`` already IS the run's ``artifact/`` folder (a local file store)."""
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
    """Point ``alias`` of registered model ``name`` at ``version``; returns the model URI.

    A dry-run version (random weights, :func:`is_dry_run_version`) never becomes ``champion``.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    try:
        mv = client.get_model_version(name, str(version))
        if alias == CHAMPION and is_dry_run_version(client, mv):
            raise UserError(f"{name} v{version} is a dry run (calibrated on random weights, model.init=random): "
                            f"it cannot be {CHAMPION}; calibrate the real model and promote that")
        client.set_registered_model_alias(name, alias, str(version))
    except MlflowException as exc:
        raise UserError(f"cannot promote {name} v{version}: {exc.message.splitlines()[0]} (see `python -m calib ls`)") from None
    return f"models:/{name}@{alias}"


def is_dry_run_version(client: Any, mv: Any) -> bool:
    """True when model version ``mv`` or the run that produced it carries the dry-run tag."""
    if (mv.tags or {}).get(DRY_RUN_TAG) == "true":
        return True
    if not mv.run_id:
        return False
    try:
        return client.get_run(mv.run_id).data.tags.get(DRY_RUN_TAG) == "true"
    except Exception:  # noqa: BLE001 - a deleted run: the version's own tags decide
        return False


def promotion_warning(name: str, version: str, tags: Mapping[str, str], min_ci_low: float = MIN_CI_LOW,
                      suites: Sequence[str] = ()) -> str | None:
    """One line when version ``tags`` show no held-out eval, or a CI lower bound of (sparse - dense)
    accuracy below ``min_ci_low`` — pooled, and per suite of ``suites`` (the model's held-out data
    sources, :func:`model_eval_suites`: a real model must hold accuracy on natural text too);
    ``None`` when the version passes."""
    how = f"python -m calib eval artifact=models:/{name}/{version}"
    for prefix, label in [("", "held-out"), *((f"{s}.", f"{s} held-out") for s in suites)]:
        ci_low = tags.get(f"{EVAL_TAG_PREFIX}{prefix}ci_low")
        if ci_low is None:
            return f"{name} v{version} has no {label} eval yet ({how})"
        try:
            low = float(ci_low)
        except ValueError:
            return f"{name} v{version}: its {EVAL_TAG_PREFIX}{prefix}ci_low tag {ci_low!r} is not a number"
        if low < min_ci_low:
            return (f"{name} v{version}: {label} accuracy change {tags.get(f'{EVAL_TAG_PREFIX}{prefix}acc_delta', '?')}, "
                    f"95% CI lower bound {ci_low} < {min_ci_low:g} (--min-ci-low)")
    return None


def model_eval_suites(model: str) -> list[str]:
    """The held-out suites of model ``model`` (its ``conf/model`` file's ``eval_suites``) that a version
    must be evaluated on before promotion; ``[]`` for an unknown model or one that lists none."""
    path = config_dir() / "model" / f"{model}.yaml"
    if not model or not path.is_file():
        return []
    return [str(s) for s in (OmegaConf.load(path).get("eval_suites") or [])]


def version_tags(name: str, version: str) -> dict[str, str]:
    """The tags of one registered version (a one-line :class:`UserError` if it does not exist)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return dict(MlflowClient().get_model_version(name, str(version)).tags or {})
    except MlflowException as exc:
        raise UserError(f"{name} v{version}: {exc.message.splitlines()[0]} (see `python -m calib ls`)") from None


# -------------------------------------------------------------------------------- eval results
EVAL_TAG_PREFIX = "eval."
# summary metric (calib.tracking.EVAL_HEADLINES + sparsity) -> version tag (without the prefix)
EVAL_TAGS = {"summary/acc_delta": "acc_delta", "summary/acc_delta_ci_low": "ci_low",
             "summary/acc_delta_ci_high": "ci_high", "summary/acc_dense": "acc_dense",
             "summary/acc_sparse": "acc_sparse", "summary/sparsity": "sparsity"}


@dataclass(frozen=True)
class ModelRef:
    """A registry reference: ``models:/<name>/<version>`` or ``models:/<name>@<alias>``."""

    name: str
    version: str | None = None
    alias: str | None = None

    @property
    def label(self) -> str:
        """``saap-tiny@candidate`` or ``saap-tiny-v3`` (run names, messages)."""
        return f"{self.name}@{self.alias}" if self.alias else f"{self.name}-v{self.version}"


def parse_model_uri(uri: Any) -> ModelRef | None:
    """The :class:`ModelRef` of a ``models:/`` URI; ``None`` for anything else (a directory)."""
    text = str(uri or "")
    if not text.startswith("models:/"):
        return None
    body = text[len("models:/"):]
    name, at, alias = body.partition("@")
    if at:
        return ModelRef(name, alias=alias) if name and alias else None
    name, _, version = body.rpartition("/")
    return ModelRef(name, version=version) if name and version.isdigit() else None


def check_eval_method(method_cfg: Any, artifact: Any, artifact_method: str | None) -> None:
    """``calib eval`` takes the method from the artifact (``artifact_method``; ``None``: no artifact, dense
    only). A ``+method`` group (``method_cfg``) naming another method is a mistake the eval would
    otherwise answer for the artifact's method: a one-line :class:`UserError`."""
    wanted = None if method_cfg is None else method_cfg.get("name")
    if wanted is None or str(wanted) == artifact_method:
        return
    if artifact_method is None:
        raise UserError(f"+method={wanted} but no artifact: eval measures the method of artifact=<models:/... or "
                        "dir> (without one, dense only); add the artifact or drop +method")
    raise UserError(f"{artifact} artifact is {artifact_method!r} but +method={wanted}: eval takes the method "
                    f"from the artifact; drop +method or evaluate a {wanted} artifact")


def artifact_method(uri: Any, tracking_uri: str | None = None) -> str | None:
    """The method of artifact ``uri`` told without loading it: a registry version's ``method`` tag, a
    directory's ``manifest.json``; ``None`` when it cannot be told so (loading it will say why)."""
    ref = parse_model_uri(uri)
    if ref is None:
        local = local_path(str(uri))
        try:
            return str(json.loads((local / "manifest.json").read_text())["method"]) if local else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        mv = (client.get_model_version_by_alias(ref.name, ref.alias) if ref.alias
              else client.get_model_version(ref.name, str(ref.version)))
    except MlflowException:
        return None
    return (mv.tags or {}).get("method") or None


def eval_run_name(artifact: Any, method: str, model: str) -> str:
    """``eval saap-tiny@candidate`` / ``eval saap-tiny-v3`` for a registry URI, ``eval saap-tiny`` for a
    directory, ``eval dense-tiny`` without an artifact."""
    ref = parse_model_uri(artifact)
    return f"eval {ref.label}" if ref is not None else f"eval {method}-{model}"


def eval_tags(summary: Mapping[str, float], *, seed: int, num_prompts: int, run_id: str) -> dict[str, str]:
    """Readable version tags (``eval.acc_delta``, ``eval.ci_low``, ...) from ``calib eval``'s summary."""
    tags = {EVAL_TAG_PREFIX + tag: f"{float(summary[metric]):.4f}" for metric, tag in EVAL_TAGS.items()
            if metric in summary}
    for metric, value in summary.items():  # per suite: summary/books.acc_delta_ci_low -> eval.books.ci_low
        suite, dot, name = metric.removeprefix("summary/").partition(".")
        if metric.startswith("summary/") and dot and f"summary/{name}" in EVAL_TAGS:
            tags[f"{EVAL_TAG_PREFIX}{suite}.{EVAL_TAGS[f'summary/{name}']}"] = f"{float(value):.4f}"
    tags.update({EVAL_TAG_PREFIX + "seed": str(int(seed)), EVAL_TAG_PREFIX + "num_prompts": str(int(num_prompts)),
                 EVAL_TAG_PREFIX + "run_id": run_id})
    return tags


def _evaluated_version(client: Any, ref: ModelRef, digest: str) -> Any | None:
    """The version of ``ref.name`` whose artifact sha256 is ``digest``: the one ``ref`` names now when it
    matches (an alias can move while an eval runs), else the newest version with that artifact."""
    from mlflow.exceptions import MlflowException

    try:
        named = (client.get_model_version_by_alias(ref.name, ref.alias) if ref.alias
                 else client.get_model_version(ref.name, ref.version))
    except MlflowException:
        named = None
    if named is not None and (named.tags or {}).get("artifact_sha256") == digest:
        return named
    versions = client.search_model_versions(f"name='{ref.name}'", max_results=1000)
    same = [mv for mv in versions if (mv.tags or {}).get("artifact_sha256") == digest]
    return max(same, key=lambda mv: int(mv.version)) if same else None


def record_eval(uri: Any, artifact_dir: str | Path, summary: Mapping[str, float], *, seed: int,
                num_prompts: int, run_id: str) -> ModelRef | None:
    """Write ``calib eval``'s figures onto the registered version it evaluated (``uri`` a ``models:/``
    URI; ``artifact_dir`` the directory that was loaded) and tag the eval run with that version.
    Returns the version, or ``None`` when ``uri`` is no registry URI or no version holds that artifact."""
    from mlflow.tracking import MlflowClient

    ref = parse_model_uri(uri)
    if ref is None:
        return None
    client = MlflowClient()
    mv = _evaluated_version(client, ref, artifact_sha256(artifact_dir))
    if mv is None:
        print(f"warning: no version of {ref.name} holds the evaluated artifact any more; no eval tags written",
              file=sys.stderr)
        return None
    for key, value in eval_tags(summary, seed=seed, num_prompts=num_prompts, run_id=run_id).items():
        client.set_model_version_tag(ref.name, str(mv.version), key, value)
    client.set_tag(run_id, "evaluated_model", ref.name)
    client.set_tag(run_id, "evaluated_version", str(mv.version))
    return ModelRef(ref.name, version=str(mv.version))


# ------------------------------------------------------------------------------------- listing
@dataclass
class VersionRow:
    """One registered version as ``calib ls`` shows it."""

    name: str
    version: str
    aliases: list[str]
    method: str
    model: str
    created: str
    summary: dict[str, float] = field(default_factory=dict)  # the producing run's summary/* (no prefix)
    eval: dict[str, str] = field(default_factory=dict)  # the eval.* tags (no prefix)


def _run_summary(client: Any, run_id: str | None) -> dict[str, float]:
    from mlflow.exceptions import MlflowException

    if not run_id:
        return {}
    try:
        metrics = client.get_run(run_id).data.metrics
    except MlflowException:
        return {}
    return {k.split("/", 1)[1]: float(v) for k, v in sorted(metrics.items()) if k.startswith("summary/")}


def list_versions(name_filter: str | None = None) -> list[VersionRow]:
    """Every registered version (newest first per model): aliases, tags, the producing run's summary
    metrics and the held-out eval tags."""
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
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mv.creation_timestamp / 1000))
            evals = {k[len(EVAL_TAG_PREFIX):]: v for k, v in sorted(tags.items()) if k.startswith(EVAL_TAG_PREFIX)}
            rows.append(VersionRow(rm.name, str(mv.version), sorted(aliases.get(str(mv.version), [])),
                                   tags.get("method", ""), tags.get("model", ""), created,
                                   _run_summary(client, mv.run_id), evals))
    rows.sort(key=lambda r: (r.name, -int(r.version)))
    return rows


CALIBRATION_COLUMN = ("sparsity", "rel_error", "recall", "acc_sparse")  # summary/* shown by `calib ls`


def calibration_cell(summary: Mapping[str, float]) -> str:
    """``sparsity=0.61 rel_error=0.048``: the run's headline figures, or ``-``."""
    shown = [f"{k}={summary[k]:.3g}" for k in CALIBRATION_COLUMN if k in summary]
    return " ".join(shown) or "-"


def eval_cell(evals: Mapping[str, str]) -> str:
    """``acc_delta=-0.0250 ci=[-0.1000,0.0500] sparsity=0.6100 seed=424242``, or ``-`` (no eval yet)."""
    if not evals:
        return "-"
    parts = []
    if "acc_delta" in evals:
        parts.append(f"acc_delta={evals['acc_delta']}")
    if "ci_low" in evals and "ci_high" in evals:
        parts.append(f"ci=[{evals['ci_low']},{evals['ci_high']}]")
    parts += [f"{k}={evals[k]}" for k in ("sparsity", "seed") if k in evals]
    return " ".join(parts)


def format_table(rows: list[VersionRow]) -> str:
    """A plain-text table of :func:`list_versions` rows."""
    header = ["name", "version", "aliases", "method", "model", "created", "calibration", "held-out eval"]
    body = [[r.name, r.version, ",".join(r.aliases) or "-", r.method, r.model, r.created,
             calibration_cell(r.summary), eval_cell(r.eval)] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join(lines)
