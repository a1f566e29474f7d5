"""The artifact format: ``manifest.json`` beside safetensors files (SPEC §6).

The runtime owns this schema; calib imports it to write artifacts. An artifact directory holds

* ``manifest.json``: schema version, method, method ABI version, the model facts it was calibrated for,
  every hyper-parameter, the calibration data record, the producer, the per-tensor records
  ``{name, file, shape, dtype, sha256}``, the per-file records ``{file, bytes, sha256}``, headline
  metrics and a method-specific ``payload`` of small JSON values (e.g. SampleAttention's bucket table);
* one or more ``*.safetensors`` files (never pickle).

Writing is atomic: everything goes to a hidden sibling temp directory, is fsynced, and the directory
is renamed into place, so a crash (or a full disk) never leaves a directory that looks complete.
Reading (:func:`read_artifact`) recomputes every file and tensor sha256 and refuses any mismatch with
a one-line :class:`ArtifactError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from runtime_kernels.errors import ArtifactError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Model facts that must match between an artifact and the model it is applied to.
ARCH_FACTS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling")


@dataclass
class TensorRecord:
    name: str
    file: str
    shape: list[int]
    dtype: str
    sha256: str


@dataclass
class FileRecord:
    file: str
    bytes: int
    sha256: str


@dataclass
class ModelRecord:
    """The model an artifact was calibrated for (architecture facts + identity)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None = None
    hidden_size: int | None = None
    max_position_embeddings: int | None = None
    family: str | None = None
    revision: str | None = None
    model_hash: str | None = None
    dry_run: bool = False  # calibrated on random weights (model.init=random): for measuring cost only


@dataclass
class DataRecord:
    """Where the calibration data came from; enough to regenerate it and to prove eval is disjoint."""

    source: str
    seed: int | None
    count: int
    lengths: list[int]
    content_hash: str
    tasks: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)


@dataclass
class ProducerRecord:
    package: str
    version: str
    git_sha: str | None
    created_at: str
    config: dict = field(default_factory=dict)  # the resolved Hydra config


@dataclass
class Manifest:
    method: str
    abi_version: int
    model: ModelRecord
    hyperparameters: dict
    data: DataRecord
    producer: ProducerRecord
    metrics: dict = field(default_factory=dict)
    payload: dict = field(default_factory=dict)
    tensors: list[TensorRecord] = field(default_factory=list)
    files: list[FileRecord] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Manifest":
        try:
            return cls(
                method=d["method"],
                abi_version=int(d["abi_version"]),
                model=ModelRecord(**d["model"]),
                hyperparameters=dict(d["hyperparameters"]),
                data=DataRecord(**d["data"]),
                producer=ProducerRecord(**d["producer"]),
                metrics=dict(d.get("metrics", {})),
                payload=dict(d.get("payload", {})),
                tensors=[TensorRecord(**t) for t in d["tensors"]],
                files=[FileRecord(**f) for f in d["files"]],
                schema_version=int(d["schema_version"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"manifest.json is malformed ({type(exc).__name__}: {exc})") from None


# ----------------------------------------------------------------------------------------- hashing


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (C-contiguous, CPU); dtype and shape are recorded separately."""
    t = t.detach().to("cpu").contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def artifact_sha256(directory: str | os.PathLike) -> str:
    """One digest for a whole artifact: sha256 of its manifest bytes (which hold every file's sha256)."""
    return file_sha256(Path(directory) / MANIFEST_NAME)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_artifact(
    out_dir: str | os.PathLike,
    manifest: Manifest,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
) -> Path:
    """Write ``tensors`` (``{file_stem: {tensor_name: tensor}}``) and the manifest atomically.

    Tensor names must be unique across files. ``manifest.tensors``/``files`` are filled in here.
    Returns the final directory. Raises ``FileExistsError`` if it already exists.
    """
    from safetensors.torch import save_file  # local: keep `import runtime_kernels` light

    out = Path(out_dir).resolve()
    if out.exists():
        raise FileExistsError(f"artifact directory already exists: {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        records, files, seen = [], [], set()
        for stem, group in tensors.items():
            fname = f"{stem}.safetensors"
            cpu = {}
            for name, t in group.items():
                if name in seen:
                    raise ValueError(f"duplicate tensor name {name!r}")
                seen.add(name)
                cpu[name] = t.detach().to("cpu").contiguous()
                records.append(TensorRecord(name, fname, list(cpu[name].shape), _dtype_name(cpu[name].dtype),
                                            tensor_sha256(cpu[name])))
            save_file(cpu, str(tmp / fname), metadata={"format": "pt"})
            files.append(FileRecord(fname, (tmp / fname).stat().st_size, file_sha256(tmp / fname)))
        manifest = dataclasses.replace(manifest, tensors=records, files=files)
        with open(tmp / MANIFEST_NAME, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        for rec in files:
            with open(tmp / rec.file, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ----------------------------------------------------------------------------------------- reading


@dataclass
class Artifact:
    """A verified artifact: its manifest and its tensors (CPU)."""

    path: Path
    manifest: Manifest
    tensors: dict[str, torch.Tensor]

    @property
    def method(self) -> str:
        return self.manifest.method

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ArtifactError(f"artifact {self.path} has no tensor {name!r}") from None


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Parse ``manifest.json`` (no hash checks; use :func:`read_artifact` before using tensors)."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{directory} is not an artifact directory (no {MANIFEST_NAME})")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not isinstance(d, dict):
        raise ArtifactError(f"{path} is not a JSON object")
    version = d.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema version {version!r}; this runtime reads <= {SCHEMA_VERSION}: upgrade runtime_kernels"
        )
    return Manifest.from_dict(d)


def read_artifact(
    directory: str | os.PathLike,
    *,
    method: str | None = None,
    abi_versions: Mapping[str, int] | None = None,
    model: Mapping[str, Any] | None = None,
) -> Artifact:
    """Load and verify an artifact directory.

    Checks, in order: manifest parses and its schema is known; ``method`` matches if given; the method
    ABI is the one this runtime implements (``abi_versions[method]``) if given; every file's size and
    sha256; every tensor's dtype, shape and sha256; the model facts (see :func:`check_model_facts`).
    Any failure raises :class:`ArtifactError` with a one-line reason.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(directory)
    manifest = read_manifest(root)
    if method is not None and manifest.method != method:
        raise ArtifactError(f"{root} is a {manifest.method!r} artifact, not {method!r}")
    if abi_versions is not None and manifest.method in abi_versions:
        want = abi_versions[manifest.method]
        if manifest.abi_version != want:
            raise ArtifactError(
                f"{root} has {manifest.method} ABI v{manifest.abi_version}; this runtime implements v{want}: "
                "recalibrate with the matching calib version"
            )
    for rec in manifest.files:
        fpath = root / rec.file
        if not fpath.is_file():
            raise ArtifactError(f"{root}: file {rec.file} is missing")
        size = fpath.stat().st_size
        if size != rec.bytes:
            raise ArtifactError(f"{root}: {rec.file} is {size} bytes, manifest says {rec.bytes} (truncated or replaced)")
        if file_sha256(fpath) != rec.sha256:
            raise ArtifactError(f"{root}: {rec.file} sha256 does not match the manifest (tampered or corrupt)")
    tensors: dict[str, torch.Tensor] = {}
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for rec in manifest.tensors:
        if rec.file not in loaded:
            try:
                loaded[rec.file] = load_file(str(root / rec.file))
            except (SafetensorError, OSError) as exc:
                raise ArtifactError(f"{root}: cannot read {rec.file} ({exc})") from None
        t = loaded[rec.file].get(rec.name)
        if t is None:
            raise ArtifactError(f"{root}: tensor {rec.name!r} is missing from {rec.file}")
        if list(t.shape) != rec.shape or _dtype_name(t.dtype) != rec.dtype:
            raise ArtifactError(
                f"{root}: tensor {rec.name!r} is {_dtype_name(t.dtype)}{list(t.shape)}, manifest says {rec.dtype}{rec.shape}"
            )
        if tensor_sha256(t) != rec.sha256:
            raise ArtifactError(f"{root}: tensor {rec.name!r} sha256 does not match the manifest (tampered)")
        tensors[rec.name] = t
    if model is not None:
        check_model_facts(manifest.model, model, where=str(root))
    return Artifact(root, manifest, tensors)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(a)))
        except (TypeError, ValueError):
            return False
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        keys = set(a) | set(b)
        return all(_same(a.get(k), b.get(k)) for k in keys)
    return a == b


def check_model_facts(recorded: ModelRecord, actual: Mapping[str, Any], *, where: str = "artifact") -> None:
    """Refuse an artifact calibrated for another model.

    Architecture facts (:data:`ARCH_FACTS`) must match; ``model_hash`` must match when both sides
    know it (the runtime does not hash 16 GB of weights on every load: pass it when you have it).
    """
    rec = dataclasses.asdict(recorded)
    diffs = [f"{k}={rec.get(k)!r} vs {actual.get(k)!r}" for k in ARCH_FACTS if k in actual and not _same(rec.get(k), actual.get(k))]
    if rec.get("model_hash") and actual.get("model_hash") and rec["model_hash"] != actual["model_hash"]:
        diffs.append("model_hash differs")
    if diffs:
        raise ArtifactError(
            f"{where} was calibrated for model {recorded.name!r}, not this one ({'; '.join(diffs)}): "
            f"calibrate this model with `python -m calib run +method={'<method>'} model=<its config>`"
        )


def facts_from_hf_config(config: Any, name: str | None = None) -> dict[str, Any]:
    """Model facts (the :class:`ModelRecord` fields) read off a transformers ``PretrainedConfig``."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope_params = getattr(config, "rope_parameters", None) or {}
    theta = rope_params.get("rope_theta", getattr(config, "rope_theta", None))
    scaling = getattr(config, "rope_scaling", None)
    if rope_params and rope_params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return {
        "name": name or getattr(config, "name_or_path", "") or config.model_type,
        "num_layers": int(config.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "rope_theta": float(theta) if theta is not None else None,
        "rope_scaling": dict(scaling) if scaling else None,
        "hidden_size": int(config.hidden_size),
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0) or None,
        "family": config.model_type,
    }
