"""The artifact format: ``manifest.json`` beside safetensors files.

The runtime owns this schema; calib imports it to write artifacts. An artifact directory holds

* ``manifest.json``: schema version, method, method ABI version, the model facts it was calibrated for,
  every hyper-parameter, the calibration data record, the producer, the per-tensor records
  ``{name, file, shape, dtype, sha256}``, the per-file records ``{file, bytes, sha256}``, headline
  metrics and a method-specific ``payload`` of small JSON values (e.g. SampleAttention's bucket table);
* one or more ``*.safetensors`` files (never pickle).

Writing is atomic: everything goes to a hidden sibling temp directory, is fsynced, and the directory
is renamed into place, so a crash (or a full disk) never leaves a directory that looks complete.
Reading (:func:`read_artifact`) treats the directory as untrusted: it checks the manifest's size,
nesting and every field's type, opens only regular files listed in it (see
:mod:`runtime_kernels.manifest_checks`), recomputes every file and tensor sha256 and refuses a mismatch
or a NaN/infinite tensor value with a one-line :class:`ArtifactError`.
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

import safetensors.torch
import torch

from runtime_kernels.errors import ArtifactError
from runtime_kernels.manifest_checks import (
    MAX_MANIFEST_BYTES,
    TENSOR_DTYPES,
    check_finite,
    check_record,
    check_tensor_and_file_records,
    check_value,
    open_regular,
    parse_manifest,
    read_fd,
)

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
    with open_regular(Path(directory), MANIFEST_NAME, f"artifact {directory}") as (fd, _):
        return hashlib.sha256(read_fd(fd, MAX_MANIFEST_BYTES + 1)).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_writable(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor the reader would refuse (an unknown dtype, a NaN or infinite value)."""
    if _dtype_name(t.dtype) not in TENSOR_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {_dtype_name(t.dtype)}; artifacts hold {sorted(TENSOR_DTYPES)}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"tensor {name!r} holds NaN or infinite values; the runtime refuses such an artifact")


def write_artifact(
    out_dir: str | os.PathLike,
    manifest: Manifest,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
) -> Path:
    """Write ``tensors`` (``{file_stem: {tensor_name: tensor}}``) and the manifest atomically.

    Tensor names must be unique across files. ``manifest.tensors``/``files`` are filled in here.
    Returns the final directory. Raises ``FileExistsError`` if it already exists.
    """
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
                _check_writable(name, cpu[name])
                records.append(TensorRecord(name, fname, list(cpu[name].shape), _dtype_name(cpu[name].dtype),
                                            tensor_sha256(cpu[name])))
            safetensors.torch.save_file(cpu, str(tmp / fname), metadata={"format": "pt"})
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
    """Parse and type-check ``manifest.json`` (no hash checks; use :func:`read_artifact` before using
    tensors). Reads it only if it is a regular file of at most ``MAX_MANIFEST_BYTES``."""
    root = Path(directory)
    path = root / MANIFEST_NAME
    if not os.path.lexists(path):
        raise ArtifactError(f"{directory} is not an artifact directory (no {MANIFEST_NAME})")
    with open_regular(root, MANIFEST_NAME, f"artifact {root}") as (fd, size):
        if size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a calib manifest")
        data = read_fd(fd, MAX_MANIFEST_BYTES + 1)
    return manifest_from_json(parse_manifest(data, path), f"artifact {root}")


def manifest_from_json(d: Any, where: str) -> Manifest:
    """The :class:`Manifest` of a parsed ``manifest.json``, after checking every field (one-line
    :class:`ArtifactError` naming the first bad field); ``where`` starts each message."""
    if not isinstance(d, dict):
        raise ArtifactError(f"{where}: manifest.json is not a JSON object")
    if "schema_version" not in d:
        raise ArtifactError(f"{where}: manifest is malformed: field schema_version is missing")
    version = d["schema_version"]
    check_value(version, int, "schema_version", where)
    if version > SCHEMA_VERSION or version < 1:
        raise ArtifactError(
            f"{where} has schema version {version!r}; this runtime reads 1..{SCHEMA_VERSION}: upgrade runtime_kernels"
        )
    check_record(d, Manifest, "", where)
    check_tensor_and_file_records(d, where)
    check_finite(d, "", where)
    return Manifest.from_dict(d)


def _read_listed_file(root: Path, rec: FileRecord, where: str) -> bytes:
    """The bytes of a listed file, once its size and sha256 match the manifest."""
    def wrong_size(size: int) -> ArtifactError:
        return ArtifactError(f"{where}: {rec.file} is {size} bytes, manifest says {rec.bytes} (truncated or replaced)")

    with open_regular(root, rec.file, where) as (fd, size):
        if size != rec.bytes:
            raise wrong_size(size)
        data = read_fd(fd, rec.bytes + 1)
    if len(data) != rec.bytes:  # the file changed while it was read
        raise wrong_size(len(data))
    if hashlib.sha256(data).hexdigest() != rec.sha256:
        raise ArtifactError(f"{where}: {rec.file} sha256 does not match the manifest (tampered or corrupt)")
    return data


def _load_tensors(data: bytes, file: str, records: list[TensorRecord], where: str) -> dict[str, torch.Tensor]:
    """The tensors ``records`` names, parsed from the verified bytes of ``file``; each must match its
    record's dtype, shape and sha256 and, if floating point, hold no NaN or infinite value."""
    try:
        loaded = safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, TypeError, KeyError, RuntimeError, OverflowError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ArtifactError(f"{where}: cannot read {file} ({reason})") from None
    out: dict[str, torch.Tensor] = {}
    for rec in records:
        t = loaded.get(rec.name)
        if t is None:
            raise ArtifactError(f"{where}: tensor {rec.name!r} is missing from {rec.file}")
        if list(t.shape) != rec.shape or _dtype_name(t.dtype) != rec.dtype:
            raise ArtifactError(f"{where}: tensor {rec.name!r} is {_dtype_name(t.dtype)}{list(t.shape)}, "
                                f"manifest says {rec.dtype}{rec.shape}")
        if tensor_sha256(t) != rec.sha256:
            raise ArtifactError(f"{where}: tensor {rec.name!r} sha256 does not match the manifest (tampered)")
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            raise ArtifactError(f"{where}: tensor {rec.name!r} (tensors.{rec.name}) holds {bad} NaN or infinite "
                                "value(s); no method can use them: recalibrate")
        out[rec.name] = t
    return out


def read_artifact(
    directory: str | os.PathLike,
    *,
    method: str | None = None,
    abi_versions: Mapping[str, int] | None = None,
    model: Mapping[str, Any] | None = None,
) -> Artifact:
    """Load and verify an artifact directory.

    Checks, in order: the manifest parses, its schema is known and every field is well typed (see
    :func:`manifest_from_json`); ``method`` matches if given; the method ABI is the one this runtime
    implements (``abi_versions[method]``) if given; every listed file is a regular file inside the
    directory with the recorded size and sha256; every tensor's dtype, shape, sha256 and finiteness; the
    model facts (see :func:`check_model_facts`). Only files listed in the manifest are ever opened.
    Any failure raises :class:`ArtifactError` with a one-line reason.
    """
    root = Path(directory).resolve()
    where = f"artifact {root}"
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
    by_file: dict[str, list[TensorRecord]] = {}
    for rec in manifest.tensors:
        by_file.setdefault(rec.file, []).append(rec)
    tensors: dict[str, torch.Tensor] = {}
    for rec in manifest.files:
        data = _read_listed_file(root, rec, where)
        if rec.file in by_file:
            tensors.update(_load_tensors(data, rec.file, by_file[rec.file], where))
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
