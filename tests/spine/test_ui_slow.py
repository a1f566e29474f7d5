"""End to end on the shipped tiny model: ``calib run`` (SALE, small), ``calib eval`` of its candidate, then
``calib ui`` on a free port, checked through MLflow's REST API: the experiment kind, the headline metrics,
the dataset inputs, the version's eval tags and its alias; SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.spine.test_ui import _group_members, _processes
from tests.subprocess_env import python_path

pytestmark = pytest.mark.slow

# The smallest SALE run that still measures something on tiny: one task at 512 tokens (sink 32 + local
# 256 leave blocks to skip), two calibration samples, no shared-tau ablation.
DATA = ["device=cpu", "data.tasks=[niah_single]", "model.lengths=[512]"]
RUN = ["+method=sale", *DATA, "method.num_samples=2", "method.sparsity_prompts=1", "method.compare_shared_tau=false"]
EVAL = ["artifact=models:/sale-tiny@candidate", *DATA, "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.bootstrap=200"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _calib(env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "calib", *args], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rest(base: str, path: str, body: dict | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, "calib ui exited early"
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"no answer from {base} within {timeout_s} s")


def _check_store(base: str, experiment_id: str, run: dict[str, Any], evaluation: dict[str, Any]) -> None:
    exp = _rest(base, f"experiments/get?experiment_id={experiment_id}")["experiment"]
    assert {t["key"]: t["value"] for t in exp["tags"]}["mlflow.experimentKind"] == "custom_model_development"

    runs = {r["info"]["run_id"]: r for r in _rest(base, "runs/search", {"experiment_ids": [experiment_id]})["runs"]}
    cal, ev = runs[run["run_id"]], runs[evaluation["run_id"]]
    assert cal["info"]["run_name"] == "sale-tiny-v1" and ev["info"]["run_name"] == "eval sale-tiny@candidate"
    cal_metrics = {m["key"]: m["value"] for m in cal["data"]["metrics"]}
    assert cal_metrics["summary/sparsity"] == pytest.approx(run["metrics"]["sparsity"], rel=1e-3)  # 4 digits
    assert cal_metrics["summary/rel_error"] == pytest.approx(run["metrics"]["err_worst"], rel=1e-3)
    assert cal_metrics["summary/wall_s"] > 0
    ev_metrics = {m["key"]: m["value"] for m in ev["data"]["metrics"]}
    for name, source in (("acc_dense", "dense_acc"), ("acc_sparse", "sparse_acc"), ("acc_delta", "diff"),
                         ("acc_delta_ci_low", "diff_ci_low"), ("acc_delta_ci_high", "diff_ci_high")):
        assert ev_metrics[f"summary/{name}"] == pytest.approx(evaluation["metrics"][source], rel=1e-3, abs=1e-9)
    assert 0.0 < ev_metrics["summary/sparsity"] < 1.0

    content_hash = json.loads((Path(run["artifact_dir"]) / "manifest.json").read_text())["data"]["content_hash"]
    (cal_input,) = cal["inputs"]["dataset_inputs"]
    assert cal_input["tags"] == [{"key": "mlflow.data.context", "value": "calibration"}]
    assert cal_input["dataset"]["name"] == "synthetic seed=1234" and cal_input["dataset"]["digest"] == content_hash[:12]
    (ev_input,) = ev["inputs"]["dataset_inputs"]
    assert ev_input["tags"] == [{"key": "mlflow.data.context", "value": "evaluation"}]
    assert ev_input["dataset"]["name"] == "synthetic seed=424242"

    version = _rest(base, "model-versions/get?name=sale-tiny&version=1")["model_version"]
    tags = {t["key"]: t["value"] for t in version["tags"]}
    assert float(tags["eval.acc_delta"]) == pytest.approx(evaluation["metrics"]["diff"], abs=1e-4)
    assert float(tags["eval.ci_low"]) == pytest.approx(evaluation["metrics"]["diff_ci_low"], abs=1e-4)
    assert float(tags["eval.sparsity"]) == pytest.approx(ev_metrics["summary/sparsity"], abs=1e-4)
    assert tags["eval.seed"] == "424242" and tags["eval.run_id"] == evaluation["run_id"]
    assert "metrics" not in tags
    alias = _rest(base, "registered-models/alias?" + urllib.parse.urlencode({"name": "sale-tiny", "alias": "candidate"}))
    assert alias["model_version"]["version"] == "1"


def test_ui_shows_the_headlines_lineage_and_eval_of_a_run(tmp_path):
    home = tmp_path / "home"
    (home / "artifacts").mkdir(parents=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "CALIB_HOME": str(home),
           "PYTHONPATH": python_path()}
    out = f"hydra.run.dir={tmp_path / 'outputs'}"
    run = _calib(env, "run", *RUN, out)
    evaluation = _calib(env, "eval", *EVAL, out)
    assert evaluation["summary"]["summary/acc_delta"] == pytest.approx(evaluation["metrics"]["diff"], rel=1e-3, abs=1e-9)

    port = _free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "calib", "ui", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = proc.stdout.readline().strip().split(": ", 1)[1]
        prefix = f"http://127.0.0.1:{port}/#/experiments/"
        assert url.startswith(prefix) and url.endswith("/runs?workflowType=machine_learning")
        experiment_id = url[len(prefix):].split("/")[0]
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc)
        print(f"calib ui answered after {time.monotonic() - started:.1f} s")
        server = [pid for pid, (_, ppid, _) in _processes().items() if ppid == proc.pid]
        pgid = _processes()[server[0]][2]
        assert len(_group_members(pgid)) == 2, "mlflow server + one uvicorn worker, no job runner"
        _check_store(base, experiment_id, run, evaluation)
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert _group_members(pgid) == []
        print(f"calib ui and its server stopped {time.monotonic() - stopping:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
