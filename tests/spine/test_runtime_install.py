"""``calib-runtime`` (runtime/pyproject.toml): the runtime installs and runs without the calibration stack.

The slow test is the user's path: a fresh virtual environment, the one install command
``pip install torch==<this torch> <runtime dir>``, then the shipped tiny model, a SAAP artifact directory
written here, and ``runtime_kernels.hf.apply`` (tests/spine/runtime_user.py); then the ``[mlflow]`` extra
and the same artifact through a ``models:/`` URI of calib's SQLite registry. It installs torch into that
environment: fast from a local wheel (this machine, CI), a download elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from runtime_kernels.manifest import (DataRecord, Manifest, ModelRecord, ProducerRecord, facts_from_hf_config,
                                      write_artifact)
from runtime_kernels.saap import SaapLayerParams
from tests.runtime.saap.test_saap_reference import _params

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "artifacts" / "models" / "tiny"
# Distributions of the calibration stack (the full mlflow package among them: the extra takes its client).
CALIB_STACK = {"hydra-core", "omegaconf", "mlflow", "faiss-cpu", "faiss-gpu-cu12", "scikit-learn", "matplotlib",
               "datasets", "pandas", "calib"}


def _toml(path: Path) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads(path.read_text())


def test_runtime_requirements_are_calibs_with_the_same_ranges():
    """calib-runtime requires torch, numpy, safetensors and transformers with calib's ranges; its extras are
    MLflow's client in calib's mlflow range and the triton of calib's dev extra."""
    runtime, calib = _toml(ROOT / "runtime" / "pyproject.toml")["project"], _toml(ROOT / "pyproject.toml")["project"]
    assert set(runtime["dependencies"]) <= set(calib["dependencies"])
    names = {req.split(">")[0].split("<")[0].split("=")[0].strip().lower() for req in runtime["dependencies"]}
    assert names == {"torch", "numpy", "safetensors", "transformers"}
    extras = runtime["optional-dependencies"]
    calib_mlflow = [r for r in calib["dependencies"] if r.startswith("mlflow")]
    assert [r for r in extras["mlflow"] if r.startswith("mlflow")] == [r.replace("mlflow", "mlflow-skinny", 1)
                                                                       for r in calib_mlflow]
    assert extras["gpu"] == [r for r in calib["optional-dependencies"]["dev"] if r.startswith("triton")]


def test_both_distributions_ship_the_one_runtime_kernels_directory():
    """calib keeps runtime_kernels in its packages (the README's editable install); calib-runtime builds
    the same directory, and its version is the package's."""
    root = _toml(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"]["find"]
    runtime = _toml(ROOT / "runtime" / "pyproject.toml")["tool"]["setuptools"]
    assert "runtime_kernels*" in root["include"]
    find = runtime["packages"]["find"]
    assert find["include"] == ["runtime_kernels*"]
    assert [(ROOT / "runtime" / where / "runtime_kernels").resolve() for where in find["where"]] == [
        (ROOT / "runtime_kernels").resolve()]
    assert runtime["dynamic"]["version"] == {"attr": "runtime_kernels.__version__"}


def _saap_artifact(path: Path, clusters: int) -> Path:
    """A SAAP artifact for the tiny model: layer 0 dense, the others random classifiers of ``clusters``
    buckets, ℓ = ``clusters`` (every bucket visited: the sparse decode must equal the dense one)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(TINY)
    facts = facts_from_hf_config(config, name="tiny")
    sink, window = 1, 9
    layers = [SaapLayerParams(sink=sink, recent=window - sink, dense=True)] + [
        _params(facts["num_heads"], facts["num_kv_heads"], facts["head_dim"], clusters, 16, sink, window - sink,
                seed=i) for i in range(1, facts["num_layers"])]
    tensors = {}
    for i, layer in enumerate(layers):
        tensors.update(layer.to_tensors(f"layers.{i}."))
    manifest = Manifest(
        method="saap", abi_version=1, model=ModelRecord(**facts),
        hyperparameters={"sink": sink, "window": window, "top_l": clusters, "dense_layers": [0], "bn_eps": 1e-5},
        data=DataRecord(source="synthetic", seed=0, count=1, lengths=[64], content_hash="0" * 64),
        producer=ProducerRecord(package="calib", version="0", git_sha=None, created_at="2026-01-01T00:00:00Z"),
    )
    return write_artifact(path, manifest, {"classifier": tensors})


def _fresh_env() -> dict[str, str]:
    """This environment minus what would leak the repository or this venv into the child."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _run(cmd: list[str], cwd: Path, timeout: int) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_fresh_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _publish(artifact: Path) -> str:
    """Register ``artifact`` in calib's SQLite registry under CALIB_HOME; the tracking URI."""
    from calib import registry, tracking

    target = tracking.resolve_target({"experiment": "runtime-install"})
    with tracking.start_run(target, "publish") as run:
        assert registry.publish(artifact, run.info.run_id).model_uri == "models:/saap-tiny/1"
    return target.tracking_uri


def _check_saap_ran(seen: dict, venv: Path) -> None:
    assert Path(seen["runtime_kernels"]).is_relative_to(venv)  # the installed package, not the checkout
    assert not CALIB_STACK & set(seen["distributions"]), seen["distributions"]
    assert seen["decode_runtime"] == "SaapDecode" and seen["prefill_is_dense"]
    # Every bucket visited plus sink and window covers every key: the dense model's logits up to float32
    # rounding; one bucket of four per KV head changes them.
    assert seen["every_bucket_max_diff"] < 1e-5 * seen["dense_scale"]
    assert seen["one_bucket_max_diff"] > 1e-2 * seen["dense_scale"]


@pytest.mark.slow
def test_fresh_venv_with_only_the_runtime_runs_hf_apply_on_the_tiny_model(tmp_path, calib_home):
    if shutil.which("python3") is None:
        pytest.skip("needs python3 with venv to build the fresh environment")
    # The sources are copied so that building the wheel leaves nothing in the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "runtime", src / "runtime", ignore=shutil.ignore_patterns("build"))
    shutil.copytree(ROOT / "runtime_kernels", src / "runtime_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    artifact = _saap_artifact(tmp_path / "saap-tiny", clusters=4)
    venv = tmp_path / "venv"
    _run(["python3", "-m", "venv", str(venv)], tmp_path, 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    user = [str(venv / "bin" / "python"), str(ROOT / "tests" / "spine" / "runtime_user.py"), str(TINY)]

    _run([*pip, f"torch=={torch.__version__.split('+')[0]}", "./runtime"], src, 900)
    seen = json.loads(_run([*user, str(artifact)], tmp_path, 600).splitlines()[-1])
    _check_saap_ran(seen, venv)
    assert seen["imported"] == [] and seen["importable"] == []
    assert seen["artifact_path"] == str(artifact.resolve())
    assert "mlflow" in seen["registry_error"]

    tracking_uri = _publish(artifact)
    _run([*pip, "./runtime[mlflow]"], src, 600)
    seen = json.loads(_run([*user, "models:/saap-tiny@candidate", tracking_uri], tmp_path, 600).splitlines()[-1])
    _check_saap_ran(seen, venv)
    assert "mlflow-skinny" in seen["distributions"] and seen["imported"] == ["mlflow"]
    assert Path(seen["artifact_path"]).is_relative_to(calib_home)  # the registered copy, found through the registry
