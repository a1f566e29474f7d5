"""Manifest round trip, and refusal of tampered, truncated, foreign or newer artifacts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from runtime_kernels.manifest import (
    SCHEMA_VERSION,
    ArtifactError,
    file_sha256,
    read_artifact,
    tensor_sha256,
    write_artifact,
)
from tests.spine.helpers import TINY_FACTS, make_manifest, make_tensors, write_test_artifact


def test_round_trip_keeps_every_tensor_and_field(tmp_path):
    out = write_test_artifact(tmp_path / "a")
    art = read_artifact(out)
    want = make_tensors()
    for group in want.values():
        for name, t in group.items():
            assert art.tensors[name].dtype == t.dtype
            assert torch.equal(art.tensors[name], t)
    m = json.loads((out / "manifest.json").read_text())
    assert m["schema_version"] == SCHEMA_VERSION
    assert m["method"] == "sale" and m["abi_version"] == 1
    assert m["model"]["num_kv_heads"] == 2 and m["data"]["seed"] == 1234
    assert m["hyperparameters"]["theta"] == 0.05
    assert {t["name"] for t in m["tensors"]} == {"tau", "layers", "weights"}
    rec = next(t for t in m["tensors"] if t["name"] == "weights")
    assert rec == {"name": "weights", "file": "extra.safetensors", "shape": [3, 5], "dtype": "bfloat16",
                   "sha256": tensor_sha256(want["extra"]["weights"])}
    for f in m["files"]:
        assert f["sha256"] == file_sha256(out / f["file"]) and f["bytes"] == (out / f["file"]).stat().st_size


def test_tensor_sha_is_independent_of_hashlib_order():
    t = torch.arange(6, dtype=torch.int32)
    import hashlib

    assert tensor_sha256(t) == hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _flip_last_data_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_tampered_file_is_refused(tmp_path):
    out = write_test_artifact(tmp_path / "a")
    _flip_last_data_byte(out / "thresholds.safetensors")
    with pytest.raises(ArtifactError, match="sha256") as exc:
        read_artifact(out)
    assert "\n" not in str(exc.value)


def test_tampered_tensor_with_consistent_file_record_is_refused(tmp_path):
    """Someone rewrites the file AND its file record: the per-tensor sha256 still catches it."""
    from safetensors.torch import save_file

    out = write_test_artifact(tmp_path / "a")
    tensors = make_tensors()["thresholds"]
    tensors["tau"] = tensors["tau"] + 1.0
    save_file(tensors, str(out / "thresholds.safetensors"))
    m = json.loads((out / "manifest.json").read_text())
    for f in m["files"]:
        if f["file"] == "thresholds.safetensors":
            f["sha256"] = file_sha256(out / f["file"])
            f["bytes"] = (out / f["file"]).stat().st_size
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="tensor 'tau' sha256"):
        read_artifact(out)


def test_truncated_file_is_refused(tmp_path):
    out = write_test_artifact(tmp_path / "a")
    p = out / "extra.safetensors"
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(ArtifactError, match="truncated"):
        read_artifact(out)


def test_missing_or_garbage_manifest_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        read_artifact(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_artifact(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 1, "method": "sale"}))
    with pytest.raises(ArtifactError, match="malformed"):
        read_artifact(tmp_path)


def test_newer_schema_is_refused(tmp_path):
    out = write_test_artifact(tmp_path / "a")
    m = json.loads((out / "manifest.json").read_text())
    m["schema_version"] = SCHEMA_VERSION + 1
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="upgrade runtime_kernels"):
        read_artifact(out)


def test_foreign_model_is_refused_and_own_model_accepted(tmp_path):
    out = write_test_artifact(tmp_path / "a")
    read_artifact(out, model=dict(TINY_FACTS))
    with pytest.raises(ArtifactError, match="calibrated for model 'tiny'.*num_layers=4 vs 32") as exc:
        read_artifact(out, model={**TINY_FACTS, "num_layers": 32})
    assert "\n" not in str(exc.value)
    with pytest.raises(ArtifactError, match="rope_theta"):
        read_artifact(out, model={**TINY_FACTS, "rope_theta": 500000.0})
    with pytest.raises(ArtifactError, match="model_hash"):
        read_artifact(out, model={**TINY_FACTS, "model_hash": "ff" * 32})


def test_wrong_method_or_abi_is_refused(tmp_path):
    out = write_test_artifact(tmp_path / "a")
    with pytest.raises(ArtifactError, match="not 'saap'"):
        read_artifact(out, method="saap")
    with pytest.raises(ArtifactError, match="ABI v1; this runtime implements v2"):
        read_artifact(out, abi_versions={"sale": 2})


def test_crash_during_write_leaves_nothing(tmp_path, monkeypatch):
    """A failure mid-write (e.g. disk full) leaves neither the target nor a temp directory behind."""
    import safetensors.torch as st

    calls = {"n": 0}
    real = st.save_file

    def failing(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st, "save_file", failing)
    with pytest.raises(OSError, match="No space"):
        write_artifact(tmp_path / "a", make_manifest(), make_tensors())
    assert os.listdir(tmp_path) == []


def test_existing_target_is_not_overwritten(tmp_path):
    write_test_artifact(tmp_path / "a")
    with pytest.raises(FileExistsError):
        write_test_artifact(tmp_path / "a")


def test_nan_metric_is_rejected_before_anything_is_written(tmp_path):
    m = make_manifest()
    m.metrics["bad"] = float("nan")
    with pytest.raises(ValueError):
        write_artifact(tmp_path / "a", m, make_tensors())
    assert not (tmp_path / "a").exists()
