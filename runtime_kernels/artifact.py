"""Find and load a calib artifact: a directory, ``models:/name/version`` or ``models:/name@alias``.

Registry URIs are resolved with mlflow *only if it is installed* (imported here, lazily); a plain
directory needs nothing beyond torch and safetensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urlparse

from runtime_kernels.manifest import Artifact, ArtifactError, read_artifact

# The method ABI versions this runtime implements. calib writes these same numbers into manifests;
# bump one when the meaning or layout of that method's tensors changes.
ABI_VERSIONS: dict[str, int] = {"saap": 1, "sale": 1, "sampleattention": 1, "santa": 1}


def local_path(uri: str) -> Path | None:
    """The local filesystem path of a plain path or ``file://`` URI; ``None`` for remote schemes."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(uri)
    return None


def resolve_artifact_dir(uri: str | os.PathLike, tracking_uri: str | None = None) -> Path:
    """Map an artifact reference to a local directory.

    ``uri`` may be a path, a ``file://`` URI, or a registry URI ``models:/<name>/<version>`` /
    ``models:/<name>@<alias>``. Registry URIs need mlflow and use ``tracking_uri`` (or mlflow's own
    default, i.e. ``MLFLOW_TRACKING_URI``). Remote sources are downloaded to mlflow's cache.
    """
    text = os.fspath(uri)
    if not text.startswith("models:/"):
        local = local_path(text)
        if local is None:
            raise ArtifactError(f"cannot load {text!r}: give a directory, file:// URI or models:/name@alias")
        if not local.is_dir():
            raise ArtifactError(f"artifact directory {local} does not exist")
        return local.resolve()
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ArtifactError(
            f"resolving {text} needs mlflow (pip install mlflow), or pass the artifact directory instead"
        ) from None
    name, _, ref = text[len("models:/"):].partition("@")
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        if ref:
            mv = client.get_model_version_by_alias(name, ref)
        else:
            name, _, version = name.partition("/")
            if not version.isdigit():
                raise ArtifactError(f"{text}: expected models:/<name>/<version> or models:/<name>@<alias>")
            mv = client.get_model_version(name, version)
    except MlflowException as exc:
        raise ArtifactError(f"{text} is not in the registry ({exc.message.splitlines()[0]})") from None
    local = local_path(mv.source)
    if local is not None and local.is_dir():
        return local.resolve()
    from mlflow.artifacts import download_artifacts

    return Path(download_artifacts(artifact_uri=mv.source, tracking_uri=tracking_uri)).resolve()


def load_artifact(
    uri: str | os.PathLike,
    *,
    method: str | None = None,
    model: Mapping[str, Any] | None = None,
    tracking_uri: str | None = None,
) -> Artifact:
    """Resolve ``uri`` and return the verified :class:`Artifact` (every sha256 and model fact checked)."""
    directory = resolve_artifact_dir(uri, tracking_uri)
    return read_artifact(directory, method=method, abi_versions=ABI_VERSIONS, model=model)
