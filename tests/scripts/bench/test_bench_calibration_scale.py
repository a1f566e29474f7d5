"""scripts/bench/bench_calibration_scale.py: its table from hand-made rows, and one real dry run on the tiny shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_calibration_scale as bench  # noqa: E402


def test_parse_sets_groups_overrides_by_method():
    assert bench.parse_sets(["saap:method.prompts=8", "sale:method.theta=0.4", "saap:data.lengths=[32768]"]) == {
        "saap": ["method.prompts=8", "data.lengths=[32768]"], "sale": ["method.theta=0.4"]}
    with pytest.raises(SystemExit, match="--set takes"):
        bench.parse_sets(["saap-method.prompts=8"])


def test_table_has_every_stage_any_method_reported():
    rows = [{"method": "saap", "exit_code": 0, "wall_s": 12.25, "time_kmeans_s": 3.0, "peak_gpu_mem_gb": 20.5,
             "peak_host_rss_gb": 4.0, "artifact_mb": 1.5},
            {"method": "sale", "exit_code": 1, "wall_s": 2.0, "time_load_s": 1.0, "peak_host_rss_gb": 1.0,
             "error": "error: boom", "log": "/x/sale.log"}]
    lines = bench.format_rows(rows).splitlines()
    assert lines[0] == ("| method | exit | wall_s | time_kmeans_s | time_load_s | peak_gpu_mem_gb | peak_host_rss_gb "
                        "| artifact_mb |")
    assert lines[2] == "| saap | 0 | 12.2 | 3.0 | - | 20.5 | 4.0 | 1.5 |"
    assert lines[3] == "| sale | 1 | 2.0 | - | 1.0 | - | 1.0 | - |"
    assert lines[4] == "sale: error: boom (log: /x/sale.log)"


def test_a_killed_run_reports_the_stages_it_logged(tmp_path):
    """Stage times come from the newest run of the MLflow store (an older run's and other metrics ignored)."""
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    assert bench.logged_stage_times(db) == {}
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")  # no global MLflow state: other tests keep theirs
    experiment = client.create_experiment("bench", artifact_location=(tmp_path / "runs").as_uri())
    older = client.create_run(experiment, run_name="older", start_time=1_000)
    client.log_metric(older.info.run_id, "time_load_s", 99.0)
    killed = client.create_run(experiment, run_name="killed", start_time=2_000).info.run_id
    for key, value in (("time_load_s", 14.5), ("time_collect_s", 51.0), ("timeless", 1.0), ("kl", 0.5)):
        client.log_metric(killed, key, value)
    assert bench.logged_stage_times(db) == {"time_load_s": 14.5, "time_collect_s": 51.0}


@pytest.mark.slow  # a real calibration in a subprocess; tests/spine/test_dry_run.py covers the dry run itself
def test_one_method_dry_run_on_the_tiny_shape(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "bench_calibration_scale.py"),
         "--methods", "sale", "--model", "tiny",
         "--home", str(tmp_path / "home"), "--json", str(out), "--",
         "device=cpu", "model.lengths=[256,320]", "method.block_q=32", "method.block_k=16", "method.sink=16",
         "method.local=64", "method.num_samples=1", "data.tasks=[niah_single]", "method.sparsity_prompts=1",
         "method.ablation_prompts=1", "eval.max_new_tokens=2", "eval.bootstrap=50"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["exit_code"] == 0 and row["model_uri"] == "models:/sale-tiny/1"
    assert row["time_load_s"] > 0 and row["wall_s"] > row["time_load_s"]
    assert row["peak_host_rss_gb"] > 0.2 and row["artifact_mb"] > 0
    assert "| sale | 0 |" in proc.stdout
