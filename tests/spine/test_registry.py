"""publish / promote / ls against a temporary SQLite store, and models:/ resolution by the runtime."""

from __future__ import annotations

import subprocess
import sys

import pytest

from calib import registry, tracking
from calib.errors import UserError
from runtime_kernels.artifact import load_artifact, resolve_artifact_dir
from runtime_kernels.manifest import ArtifactError, artifact_sha256
from tests.spine.helpers import TINY_FACTS, write_test_artifact
from tests.subprocess_env import python_path


def _publish_one(tmp_path, name: str):
    import mlflow

    target = tracking.resolve_target({"experiment": "test"})
    with tracking.start_run(target, "t") as run:
        art = write_test_artifact(tmp_path / name)
        pub = registry.publish(art, run.info.run_id)
    return art, pub, run.info.run_id, mlflow


def test_embedded_store_is_sqlite_under_calib_home(calib_home):
    target = tracking.resolve_target()
    assert target.tracking_uri == f"sqlite:///{calib_home / 'artifacts' / 'mlflow.db'}"
    assert target.artifact_root == (calib_home / "artifacts" / "mlruns").as_uri()


def test_env_tracking_uri_wins(calib_home, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/other.db")
    assert tracking.resolve_target({"uri": "http://ignored:5000"}).tracking_uri == f"sqlite:///{tmp_path}/other.db"


def test_publish_registers_version_with_tags_and_candidate_alias(calib_home, tmp_path):
    art, pub, run_id, mlflow = _publish_one(tmp_path, "a1")
    assert pub.name == "sale-tiny" and pub.version == "1" and pub.model_uri == "models:/sale-tiny/1"
    client = mlflow.MlflowClient()
    mv = client.get_model_version_by_alias("sale-tiny", "candidate")
    assert str(mv.version) == "1" and mv.run_id == run_id
    assert mv.tags["artifact_sha256"] == artifact_sha256(art)
    assert mv.tags["schema_version"] == "1" and mv.tags["abi_version"] == "1"
    assert mv.tags["model_hash"] == TINY_FACTS["model_hash"]
    # the registered source is a logged copy that verifies on its own
    d = resolve_artifact_dir("models:/sale-tiny@candidate")
    assert artifact_sha256(d) == artifact_sha256(art)
    assert load_artifact("models:/sale-tiny/1", model=TINY_FACTS).manifest.method == "sale"


def test_second_publish_moves_candidate_and_promote_sets_champion(calib_home, tmp_path):
    _publish_one(tmp_path, "a1")
    _, pub2, _, mlflow = _publish_one(tmp_path, "a2")
    assert pub2.version == "2"
    client = mlflow.MlflowClient()
    assert str(client.get_model_version_by_alias("sale-tiny", "candidate").version) == "2"
    assert registry.promote("sale-tiny", "1") == "models:/sale-tiny@champion"
    assert str(client.get_model_version_by_alias("sale-tiny", "champion").version) == "1"
    rows = registry.list_versions()
    assert [(r.name, r.version, r.aliases) for r in rows] == [
        ("sale-tiny", "2", ["candidate"]), ("sale-tiny", "1", ["champion"])]
    assert rows[0].method == "sale" and rows[0].model == "tiny"
    assert "champion" in registry.format_table(rows)


def test_promote_unknown_version_is_a_user_error(calib_home, tmp_path):
    _publish_one(tmp_path, "a1")
    with pytest.raises(UserError, match="cannot promote sale-tiny v9"):
        registry.promote("sale-tiny", "9")


def test_tampered_artifact_is_never_registered(calib_home, tmp_path):
    import mlflow

    target = tracking.resolve_target({"experiment": "test"})
    art = write_test_artifact(tmp_path / "bad")
    p = art / "extra.safetensors"
    p.write_bytes(p.read_bytes()[:-3])
    with tracking.start_run(target, "t") as run:
        with pytest.raises(ArtifactError):
            registry.publish(art, run.info.run_id)
    assert mlflow.MlflowClient().search_registered_models() == []


def test_unknown_registry_uri_is_an_artifact_error(calib_home, tmp_path):
    _publish_one(tmp_path, "a1")
    with pytest.raises(ArtifactError, match="not in the registry"):
        resolve_artifact_dir("models:/nope@candidate")
    with pytest.raises(ArtifactError, match="does not exist"):
        resolve_artifact_dir(tmp_path / "missing")


def test_cli_ls_and_promote(calib_home, tmp_path):
    _publish_one(tmp_path, "a1")
    env = {"CALIB_HOME": str(calib_home), "PATH": "/usr/bin:/bin", "PYTHONPATH": python_path()}
    ls = subprocess.run([sys.executable, "-m", "calib", "ls"], capture_output=True, text=True, env=env, timeout=120)
    assert ls.returncode == 0, ls.stderr
    assert "sale-tiny" in ls.stdout and "candidate" in ls.stdout
    bad = subprocess.run([sys.executable, "-m", "calib", "promote", "sale-tiny"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: usage")
    ok = subprocess.run([sys.executable, "-m", "calib", "promote", "sale-tiny", "1", "alias=prod"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "models:/sale-tiny@prod" in ok.stdout


def test_eval_method_must_be_the_artifacts(tmp_path):
    from omegaconf import OmegaConf

    saap = OmegaConf.create({"name": "saap"})
    registry.check_eval_method(None, "models:/sale-tiny@candidate", "sale")  # no +method: the artifact's
    registry.check_eval_method(OmegaConf.create({"name": "sale"}), "models:/sale-tiny@candidate", "sale")
    registry.check_eval_method(None, None, None)  # dense
    with pytest.raises(UserError, match=r"models:/sale-tiny@candidate artifact is 'sale' but \+method=saap"):
        registry.check_eval_method(saap, "models:/sale-tiny@candidate", "sale")
    with pytest.raises(UserError, match=r"\+method=saap but no artifact"):
        registry.check_eval_method(saap, None, None)


def test_artifact_method_without_loading(calib_home, tmp_path):
    art = write_test_artifact(tmp_path / "saap", method="saap")
    assert registry.artifact_method(art) == "saap"
    assert registry.artifact_method(art.as_uri()) == "saap"
    assert registry.artifact_method(tmp_path / "missing") is None  # loading it says why
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    assert registry.artifact_method(tmp_path / "bad") is None
    _publish_one(tmp_path, "a1")
    assert registry.artifact_method("models:/sale-tiny@candidate") == "sale"
    assert registry.artifact_method("models:/sale-tiny/1") == "sale"
    assert registry.artifact_method("models:/sale-tiny@nope") is None
