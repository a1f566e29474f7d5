"""Held-out eval figures on registered versions: URI parsing, readable tags, ls, promote's warning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from calib import registry, tracking
from runtime_kernels.manifest import write_artifact
from tests.spine.helpers import make_manifest, make_tensors
from tests.subprocess_env import python_path

SUMMARY = {"summary/acc_delta": -0.025, "summary/acc_delta_ci_low": -0.1, "summary/acc_delta_ci_high": 0.05,
           "summary/acc_dense": 0.9, "summary/acc_sparse": 0.875, "summary/sparsity": 0.61234, "summary/wall_s": 12.0}


def _artifact(path, note: str):
    """A valid SALE artifact whose payload (hence sha256) differs by ``note``."""
    manifest = make_manifest()
    manifest.payload = {"note": note}
    return write_artifact(path, manifest, make_tensors())


def _publish(tmp_path, name: str):
    target = tracking.resolve_target({"experiment": "test"})
    with tracking.start_run(target, "t") as run:
        art = _artifact(tmp_path / name, name)
        pub = registry.publish(art, run.info.run_id)
    return art, pub, run.info.run_id


def _eval_run() -> str:
    """An (ended) run standing for the ``calib eval`` run that produced the figures."""
    with tracking.start_run(tracking.resolve_target({"experiment": "test"}), "eval") as run:
        pass
    return run.info.run_id


@pytest.mark.parametrize("uri, ref", [
    ("models:/saap-tiny@candidate", registry.ModelRef("saap-tiny", alias="candidate")),
    ("models:/saap-tiny/12", registry.ModelRef("saap-tiny", version="12")),
    ("models:/saap-tiny/latest", None),
    ("models:/@candidate", None),
    ("/tmp/artifact", None),
    (None, None),
])
def test_parse_model_uri(uri, ref):
    assert registry.parse_model_uri(uri) == ref


def test_eval_tags_are_readable_strings():
    tags = registry.eval_tags(SUMMARY, seed=424242, num_prompts=160, run_id="abc")
    assert tags == {"eval.acc_delta": "-0.0250", "eval.ci_low": "-0.1000", "eval.ci_high": "0.0500",
                    "eval.acc_dense": "0.9000", "eval.acc_sparse": "0.8750", "eval.sparsity": "0.6123",
                    "eval.seed": "424242", "eval.num_prompts": "160", "eval.run_id": "abc"}


@pytest.mark.parametrize("tags, threshold, expected", [
    ({}, -0.05, "sale-tiny v2 has no held-out eval yet (python -m calib eval artifact=models:/sale-tiny/2)"),
    ({"eval.ci_low": "-0.1000", "eval.acc_delta": "-0.0250"}, -0.05,
     "sale-tiny v2: held-out accuracy change -0.0250, 95% CI lower bound -0.1000 < -0.05 (--min-ci-low)"),
    ({"eval.ci_low": "-0.1000", "eval.acc_delta": "-0.0250"}, -0.2, None),
    ({"eval.ci_low": "-0.0500"}, -0.05, None),  # at the threshold: no warning
    ({"eval.ci_low": "n/a"}, -0.05, "sale-tiny v2: its eval.ci_low tag 'n/a' is not a number"),
])
def test_promotion_warning(tags, threshold, expected):
    assert registry.promotion_warning("sale-tiny", "2", tags, threshold) == expected


@pytest.mark.parametrize("tags, expected", [
    ({"eval.ci_low": "0.0"}, "sale-smollm2 v2 has no books held-out eval yet "
                             "(python -m calib eval artifact=models:/sale-smollm2/2)"),
    ({"eval.ci_low": "0.0", "eval.books.ci_low": "-0.3000", "eval.books.acc_delta": "-0.2000"},
     "sale-smollm2 v2: books held-out accuracy change -0.2000, 95% CI lower bound -0.3000 < -0.05 (--min-ci-low)"),
    ({"eval.ci_low": "0.0", "eval.books.ci_low": "-0.0100"}, None),
])
def test_promotion_needs_the_natural_text_suite_where_the_model_lists_it(tags, expected):
    suites = registry.model_eval_suites("smollm2")
    assert "books" in suites and registry.model_eval_suites("tiny") == [] and registry.model_eval_suites("nope") == []
    assert registry.promotion_warning("sale-smollm2", "2", tags, -0.05, ["books"]) == expected


def test_publish_names_the_run_after_the_version(calib_home, tmp_path):
    import mlflow

    _, pub, run_id = _publish(tmp_path, "a1")
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.info.run_name == "sale-tiny-v1"
    assert "metrics" not in mlflow.MlflowClient().get_model_version("sale-tiny", "1").tags


def test_record_eval_tags_the_version_that_was_evaluated(calib_home, tmp_path):
    """The tags go to the version holding the evaluated artifact, even when the alias moved meanwhile."""
    import mlflow

    art1, _, _ = _publish(tmp_path, "a1")
    _publish(tmp_path, "a2")  # candidate -> v2
    client = mlflow.MlflowClient()
    run_id = _eval_run()
    ref = registry.record_eval("models:/sale-tiny@candidate", art1, SUMMARY, seed=7, num_prompts=10, run_id=run_id)
    assert ref == registry.ModelRef("sale-tiny", version="1")
    v1, v2 = (client.get_model_version("sale-tiny", v).tags for v in ("1", "2"))
    assert v1["eval.acc_delta"] == "-0.0250" and v1["eval.seed"] == "7" and v1["eval.run_id"] == run_id
    assert not any(k.startswith("eval.") for k in v2)
    assert registry.record_eval(str(art1), art1, SUMMARY, seed=7, num_prompts=10, run_id=run_id) is None


def test_record_eval_tags_the_eval_run(calib_home, tmp_path):
    import mlflow

    art, _, _ = _publish(tmp_path, "a1")
    run_id = _eval_run()
    registry.record_eval("models:/sale-tiny/1", art, SUMMARY, seed=7, num_prompts=10, run_id=run_id)
    tags = mlflow.MlflowClient().get_run(run_id).data.tags
    assert tags["evaluated_model"] == "sale-tiny" and tags["evaluated_version"] == "1"


def test_record_eval_without_the_artifact_in_the_registry_warns(calib_home, tmp_path, capsys):
    _publish(tmp_path, "a1")
    other = _artifact(tmp_path / "other", "never registered")
    run_id = _eval_run()
    capsys.readouterr()
    assert registry.record_eval("models:/sale-tiny@candidate", other, SUMMARY, seed=7, num_prompts=1, run_id=run_id) is None
    assert capsys.readouterr().err.startswith("warning: no version of sale-tiny holds the evaluated artifact")


def test_ls_shows_calibration_summary_and_eval(calib_home, tmp_path):
    import mlflow

    target = tracking.resolve_target({"experiment": "test"})
    with tracking.start_run(target, "t") as run:
        tracking.log_run_summary("sale", {"sparsity": 0.4, "err_worst": 0.05})
        art = _artifact(tmp_path / "a1", "a1")
        registry.publish(art, run.info.run_id)
    registry.record_eval("models:/sale-tiny/1", art, SUMMARY, seed=7, num_prompts=10, run_id=_eval_run())
    _publish(tmp_path, "a2")
    rows = registry.list_versions()
    assert [(r.version, r.aliases) for r in rows] == [("2", ["candidate"]), ("1", [])]
    assert rows[1].summary["sparsity"] == pytest.approx(0.4) and rows[1].summary["rel_error"] == pytest.approx(0.05)
    assert rows[1].eval["ci_low"] == "-0.1000" and rows[0].eval == {} and rows[0].summary == {}
    table = registry.format_table(rows).splitlines()
    assert table[0].split()[:6] == ["name", "version", "aliases", "method", "model", "created"]
    assert table[1].split()[-2:] == ["-", "-"]  # v2: no summary, no eval
    assert "sparsity=0.4 rel_error=0.05" in table[2]
    assert "acc_delta=-0.0250 ci=[-0.1000,0.0500] sparsity=0.6123 seed=7" in table[2]
    mlflow.end_run()


def test_cli_promote_warns_in_one_line(calib_home, tmp_path):
    art, _, _ = _publish(tmp_path, "a1")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "CALIB_HOME": str(calib_home),
           "PYTHONPATH": python_path()}

    def promote(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "calib", "promote", "sale-tiny", "1", *args],
                              capture_output=True, text=True, env=env, timeout=120)

    no_eval = promote()
    assert no_eval.returncode == 0 and "models:/sale-tiny@champion" in no_eval.stdout
    assert no_eval.stderr.strip().splitlines() == [
        "warning: sale-tiny v1 has no held-out eval yet (python -m calib eval artifact=models:/sale-tiny/1)"]
    registry.record_eval("models:/sale-tiny/1", art, SUMMARY, seed=7, num_prompts=10, run_id=_eval_run())
    low = promote("alias=prod")
    assert low.returncode == 0 and "models:/sale-tiny@prod" in low.stdout
    assert len(low.stderr.strip().splitlines()) == 1 and "lower bound -0.1000 < -0.05" in low.stderr
    assert promote("--min-ci-low", "-0.2").stderr.strip() == ""
    strict = promote("alias=gated", "--strict")  # the low bound refuses instead of warning
    assert strict.returncode == 2 and strict.stderr.strip().splitlines() == [
        "error: sale-tiny v1: held-out accuracy change -0.0250, 95% CI lower bound -0.1000 < -0.05 (--min-ci-low); "
        "not promoted (--strict)"]
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with pytest.raises(MlflowException):  # the alias was never set
        MlflowClient().get_model_version_by_alias("sale-tiny", "gated")
    bad = promote("--min-ci-low", "x")
    assert bad.returncode == 2 and bad.stderr.startswith("error: argument --min-ci-low") and "Traceback" not in bad.stderr
