"""Crafted artifacts the loader must refuse with one ArtifactError line naming the field or file, without
hanging: paths leaving the directory, symlinks, unlisted or non-regular files (FIFOs, directories),
oversized or deeply nested manifests, mistyped fields and NaN/Inf values. Each is made from a real
artifact (``write_test_artifact``: the tiny model's facts) on disk, so that only the defect differs."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime_kernels.artifact import load_artifact
from runtime_kernels.errors import ArtifactError
from runtime_kernels.manifest import write_artifact
from runtime_kernels.manifest_checks import MAX_JSON_DEPTH, MAX_MANIFEST_BYTES
from tests.spine.helpers import make_manifest, make_tensors, write_test_artifact

pytestmark = pytest.mark.timeout(20)

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


@pytest.fixture
def art(tmp_path: Path) -> Path:
    """A valid artifact (tensors tau, layers in thresholds.safetensors; weights in extra.safetensors)."""
    return write_test_artifact(tmp_path / "a")


def _manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_text())


def _edit(out: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    m = _manifest(out)
    change(m)
    (out / "manifest.json").write_text(json.dumps(m))


def _tensor(m: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in m["tensors"] if t["name"] == name)


def _file(m: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in m["files"] if f["file"] == name)


def _file_record(path: Path, name: str) -> dict[str, Any]:
    data = path.read_bytes()
    return {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _refused(out: Path, *fragments: str) -> str:
    with pytest.raises(ArtifactError) as exc:
        load_artifact(out)
    message = str(exc.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def test_the_untouched_artifact_loads(art):
    """The baseline every crafted case departs from."""
    assert set(load_artifact(art).tensors) == {"tau", "layers", "weights"}


# ----------------------------------------------------------------------------------------- paths


@pytest.mark.parametrize("listed", [False, True], ids=["unlisted", "listed"])
def test_traversal_in_a_tensor_file_is_refused(art, tmp_path, listed):
    """A byte-identical copy of the tensors sits outside; the manifest points there (and, when listed,
    records its true size and sha256), so only containment can refuse it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(art / "thresholds.safetensors", outside / "x.safetensors")
    name = "../outside/x.safetensors"

    def change(m: dict[str, Any]) -> None:
        for t in m["tensors"]:
            if t["file"] == "thresholds.safetensors":
                t["file"] = name
        if listed:
            m["files"].append(_file_record(outside / "x.safetensors", name))

    _edit(art, change)
    field = "files[2].file" if listed else "tensors.tau.file"
    _refused(art, f"manifest field {field} must name a file inside the artifact directory", repr(name))


def test_absolute_path_in_files_is_refused(art, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the artifact\n")
    _edit(art, lambda m: m["files"].append(_file_record(secret, str(secret))))
    # the offending value is shown cut to one short line: its start identifies it whatever the tmp path's length
    _refused(art, "manifest field files[2].file must name a file inside the artifact directory", f"(got '{str(secret)[:40]}")


def test_symlinked_tensor_file_pointing_outside_is_refused(art, tmp_path):
    """The link's target has exactly the listed bytes: only the no-symlink rule refuses it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "thresholds.safetensors"
    shutil.move(art / "thresholds.safetensors", target)
    (art / "thresholds.safetensors").symlink_to(target)
    _refused(art, "thresholds.safetensors is a symlink")


def test_symlinked_manifest_is_refused(art, tmp_path):
    real = tmp_path / "elsewhere.json"
    shutil.move(art / "manifest.json", real)
    (art / "manifest.json").symlink_to(real)
    _refused(art, "manifest.json is a symlink")


def test_an_artifact_reached_through_a_symlinked_directory_loads(art, tmp_path):
    """Links are refused inside the artifact, not on the way to it (a store may be mounted by a link)."""
    link = tmp_path / "link"
    link.symlink_to(art, target_is_directory=True)
    assert set(load_artifact(link).tensors) == {"tau", "layers", "weights"}


def test_tensor_file_not_listed_in_files_is_refused(art):
    _edit(art, lambda m: m["files"].remove(_file(m, "extra.safetensors")))
    _refused(art, "manifest field tensors.weights.file", "'extra.safetensors'", "files does not list")


def test_listed_directory_is_refused(art):
    (art / "sub").mkdir()
    _edit(art, lambda m: m["files"].append({"file": "sub", "bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}))
    _refused(art, "sub is a directory, not a regular file")


# ----------------------------------------------------------------------------------------- FIFOs


def _fifo_in_place_of(art: Path, name: str) -> None:
    (art / name).unlink()
    os.mkfifo(art / name)


@needs_fifo
def test_unlisted_fifo_tensor_file_is_refused_without_blocking(art):
    _fifo_in_place_of(art, "extra.safetensors")
    _edit(art, lambda m: m["files"].remove(_file(m, "extra.safetensors")))
    _refused(art, "manifest field tensors.weights.file", "files does not list")


@needs_fifo
def test_listed_fifo_is_refused_without_blocking(art):
    _fifo_in_place_of(art, "extra.safetensors")
    _refused(art, "extra.safetensors is a FIFO, not a regular file")


@needs_fifo
def test_fifo_manifest_is_refused_without_blocking(art):
    _fifo_in_place_of(art, "manifest.json")
    _refused(art, "manifest.json is a FIFO, not a regular file")


@needs_fifo
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cli_eval_of_a_fifo_artifact_prints_one_error_line(art, tmp_path):
    """``calib eval`` on the tiny model with an artifact whose tensor file is a FIFO: one ``error:`` line,
    exit 2, no hang."""
    _fifo_in_place_of(art, "extra.safetensors")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["CALIB_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([sys.executable, "-m", "calib", "eval", f"artifact={art}", "device=cpu",
                           "data.tasks=[niah_single]", "model.lengths=[512]", "eval.num_prompts=2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]  # a fresh store logs MLflow's setup first
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert errors == lines[-1:] and "extra.safetensors is a FIFO, not a regular file" in errors[0], lines


# ----------------------------------------------------------------------------------------- manifest size, depth


def test_deeply_nested_manifest_is_refused_without_recursion_error(art):
    text = (art / "manifest.json").read_text()
    depth = 200_000
    assert '"note": "test"' in text
    (art / "manifest.json").write_text(text.replace('"note": "test"', '"note": ' + "[" * depth + "]" * depth))
    _refused(art, "manifest.json", f"nests deeper than {MAX_JSON_DEPTH} levels")


def test_nesting_at_the_limit_still_parses(art):
    """Depth is counted as JSON nests it (the top object is level 1) and brackets inside strings do not
    count: a payload of brackets in a string, and nesting exactly at the limit, load."""
    inner = MAX_JSON_DEPTH - 2  # the manifest object and the payload object take two levels
    _edit(art, lambda m: m["payload"].update(note="[[[[{{{{" * 100, deep=json.loads("[" * inner + "]" * inner)))
    load_artifact(art)


def test_oversized_manifest_is_refused(art):
    text = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text(text + " " * (MAX_MANIFEST_BYTES + 1 - len(text.encode())))
    _refused(art, "manifest.json is larger than")


def test_manifest_at_the_size_cap_loads(art):
    text = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text(text + " " * (MAX_MANIFEST_BYTES - len(text.encode())))
    load_artifact(art)


# ----------------------------------------------------------------------------------------- field types

NOT_HEX = "z" * 64

# (what the manifest gets, the words the error must hold). Each names the field it breaks.
MISTYPED = {
    "tensor-file-int": (lambda m: _tensor(m, "tau").update(file=5),
                        "manifest field tensors.tau.file must be a string (got int)"),
    "shape-negative": (lambda m: _tensor(m, "tau").update(shape=[4, -8]),
                       "manifest field tensors.tau.shape must hold non-negative sizes"),
    "shape-bool": (lambda m: _tensor(m, "tau").update(shape=[True, 8]),
                   "manifest field tensors.tau.shape[0] must be an integer (got bool)"),
    "shape-not-list": (lambda m: _tensor(m, "tau").update(shape="4x8"),
                       "manifest field tensors.tau.shape must be a list (got string)"),
    "dtype-unknown": (lambda m: _tensor(m, "tau").update(dtype="complex64"),
                      "manifest field tensors.tau.dtype must be one of"),
    "tensor-sha-not-hex": (lambda m: _tensor(m, "tau").update(sha256=NOT_HEX),
                           "manifest field tensors.tau.sha256 must be 64 lowercase hex digits"),
    "tensor-name-duplicate": (lambda m: _tensor(m, "layers").update(name="tau"),
                              "manifest field tensors.tau.name must be a unique"),
    "file-bytes-float": (lambda m: _file(m, "extra.safetensors").update(bytes=12.5),
                         "manifest field files.extra.safetensors.bytes must be an integer (got float)"),
    "file-bytes-negative": (lambda m: _file(m, "extra.safetensors").update(bytes=-1),
                            "manifest field files.extra.safetensors.bytes must be >= 0"),
    "file-sha-short": (lambda m: _file(m, "extra.safetensors").update(sha256="ab"),
                       "manifest field files.extra.safetensors.sha256 must be 64 lowercase hex digits"),
    "file-listed-twice": (lambda m: m["files"].append(dict(_file(m, "extra.safetensors"))),
                          "manifest field files.extra.safetensors.file lists 'extra.safetensors' twice"),
    "abi-bool": (lambda m: m.update(abi_version=True), "manifest field abi_version must be an integer (got bool)"),
    "method-int": (lambda m: m.update(method=3), "manifest field method must be a string (got int)"),
    "tensors-object": (lambda m: m.update(tensors={}), "manifest field tensors must be a list (got object)"),
    "model-list": (lambda m: m.update(model=[]), "manifest field model must be an object (got list)"),
    "num-layers-string": (lambda m: m["model"].update(num_layers="4"),
                          "manifest field model.num_layers must be an integer (got string)"),
    "rope-theta-bool": (lambda m: m["model"].update(rope_theta=False),
                        "manifest field model.rope_theta must be a number (got bool)"),
    "lengths-item": (lambda m: m["data"].update(lengths=[1024, "x"]),
                     "manifest field data.lengths[1] must be an integer (got string)"),
    "seed-float": (lambda m: m["data"].update(seed=1.5), "manifest field data.seed must be an integer (got float)"),
    "hyperparameters-string": (lambda m: m.update(hyperparameters="x"),
                               "manifest field hyperparameters must be an object (got string)"),
    "unknown-model-field": (lambda m: m["model"].update(colour="red"), "model has unknown field 'colour'"),
    "missing-tensor-field": (lambda m: _tensor(m, "tau").pop("dtype"), "field tensors.tau.dtype is missing"),
    "schema-version-string": (lambda m: m.update(schema_version="1"),
                              "manifest field schema_version must be an integer (got string)"),
}


@pytest.mark.parametrize("change, words", MISTYPED.values(), ids=MISTYPED.keys())
def test_mistyped_field_is_refused_by_name(art, change, words):
    _edit(art, change)
    message = _refused(art, words)
    assert message.startswith(f"artifact {art.resolve()}:")


def test_manifest_that_is_not_an_object_is_refused(art):
    (art / "manifest.json").write_text("[1, 2]")
    _refused(art, "manifest.json is not a JSON object")


def test_listed_file_that_is_not_safetensors_is_refused(art):
    """Garbage with a consistent file record passes the file hash; parsing it must still end in one line."""
    (art / "extra.safetensors").write_bytes(b"\xff" * 64)
    _edit(art, lambda m: _file(m, "extra.safetensors").update(_file_record(art / "extra.safetensors",
                                                                             "extra.safetensors")))
    _refused(art, "cannot read extra.safetensors")


def test_huge_integer_is_refused_as_invalid_json(art):
    """Python refuses to convert integers of thousands of digits with a ValueError; it must not escape."""
    text = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text(text.replace('"count": 5', '"count": ' + "9" * 10_000))
    _refused(art, "manifest.json is not valid JSON")


# ----------------------------------------------------------------------------------------- non-finite values


def _raw_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _rewrite_tensor(art: Path, file: str, name: str, value: torch.Tensor) -> None:
    """Replace one tensor and update its tensor and file records consistently, as a forger would."""
    tensors = load_file(str(art / file))
    tensors[name] = value
    save_file(tensors, str(art / file), metadata={"format": "pt"})

    def change(m: dict[str, Any]) -> None:
        _tensor(m, name).update(sha256=_raw_sha(value))
        _file(m, file).update(_file_record(art / file, file))

    _edit(art, change)


@pytest.mark.parametrize("file, name, dtype, bad", [
    ("thresholds.safetensors", "tau", torch.float32, float("nan")),
    ("thresholds.safetensors", "tau", torch.float32, float("inf")),
    ("extra.safetensors", "weights", torch.bfloat16, float("-inf")),
], ids=["nan-tau", "inf-tau", "neg-inf-bf16-weights"])
def test_non_finite_tensor_is_refused(art, file, name, dtype, bad):
    value = make_tensors()[file.removesuffix(".safetensors")][name].clone()
    value.view(-1)[1] = bad
    assert value.dtype == dtype
    _rewrite_tensor(art, file, name, value)
    _refused(art, f"tensor '{name}' (tensors.{name}) holds 1 NaN or infinite value")


def test_finite_rewrite_of_a_tensor_loads(art):
    """The forging helper itself yields a loadable artifact when the new value is finite."""
    value = make_tensors()["thresholds"]["tau"] + 1.0
    _rewrite_tensor(art, "thresholds.safetensors", "tau", value)
    assert torch.equal(load_artifact(art).tensors["tau"], value)


@pytest.mark.parametrize("token, field", [("NaN", "payload.alpha"), ("Infinity", "hyperparameters.theta"),
                                          ("-Infinity", "model.rope_theta"), ("1e999", "payload.alpha")])
def test_non_finite_manifest_number_is_refused(art, token, field):
    section, key = field.split(".")
    m = _manifest(art)
    m[section][key] = "@@"
    (art / "manifest.json").write_text(json.dumps(m).replace('"@@"', token))
    _refused(art, f"manifest field {field} must be a finite number")


def test_non_finite_headline_metric_still_loads(art):
    """Headline metrics are free-form figures for people; they are never fed to a method."""
    m = _manifest(art)
    m["metrics"]["sparsity"] = "@@"
    (art / "manifest.json").write_text(json.dumps(m).replace('"@@"', "NaN"))
    assert math.isnan(load_artifact(art).manifest.metrics["sparsity"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_writer_refuses_a_non_finite_tensor_and_leaves_nothing(tmp_path, bad):
    tensors = make_tensors()
    tensors["thresholds"]["tau"][0, 0] = bad
    with pytest.raises(ValueError, match="'tau' holds NaN or infinite values"):
        write_artifact(tmp_path / "a", make_manifest(), tensors)
    assert os.listdir(tmp_path) == []
