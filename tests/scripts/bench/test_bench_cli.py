"""``scripts/bench/bench_cli.py``: stage times from the run's metrics, the markdown table, a real job (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import python_path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_cli  # noqa: E402 - a script, imported from scripts/bench/


def test_stage_times_reads_only_time_metrics():
    metrics = {"time_load_s": 1.5, "time_kmeans_s": 2, "sparsity": 0.4, "time_s": 9.0, "timer_x_s": 1.0,
               "table3.b0.n1.time_s": 0.1}
    assert bench_cli.stage_times(metrics) == {"load": 1.5, "kmeans": 2.0}


def test_last_json_line_is_the_result():
    assert bench_cli.last_json_line('progress\n{"a": 1}\n{"model_uri": "m", "metrics": {}}\n\n') == {
        "model_uri": "m", "metrics": {}}
    with pytest.raises(ValueError):
        bench_cli.last_json_line("  \n")


def test_markdown_table_rows_sums_and_failures():
    rows = [bench_cli.JobTiming("sale", 100.04, {"load": 5.0, "calibrate": 80.25}, cpu_s=150.0),
            bench_cli.JobTiming("santa", 3.0, cpu_s=2.5, ok=False, error="exit 2: boom\nerror: no such model")]
    out = bench_cli.markdown_table(rows, 2, (1.0, 0.5, 0.25))
    lines = out.splitlines()
    assert lines[0] == "CPU cores (os.cpu_count()): 2; load average at start (1/5/15 min): 1.00 / 0.50 / 0.25"
    assert "| sale | load 5.0, calibrate 80.2 | 85.2 | 100.0 | 150.0 |" in lines  # 5.0 + 80.25 = 85.25 -> 85.2
    assert "| santa | FAILED: error: no such model | | 3.0 | 2.5 |" in lines


def test_unknown_method_is_a_one_line_error():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_cli.py"), "--methods", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": python_path(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: unknown method(s) nope")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_real_job_in_a_private_home(tmp_path):
    """One cheap SALE job (two short samples) through the script: its stages, publish included, and wall."""
    out_json = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_cli.py"), "--methods", "sale",
                           "--json", str(out_json), "--", "model.lengths=[512]", "method.num_samples=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = json.loads(out_json.read_text())["jobs"][0]
    assert job["ok"] and job["model_uri"] == "models:/sale-tiny/1"  # a fresh store: version 1
    assert {"load", "calibrate", "publish"} <= set(job["stages"])
    assert 0 < sum(job["stages"].values()) <= job["wall_s"] and job["cpu_s"] > 0
    assert "| sale | load " in proc.stdout and "CPU cores (os.cpu_count()):" in proc.stdout


def test_stages_are_listed_in_the_order_the_recipes_run_them():
    metrics = {"time_publish_s": 0.1, "time_calibrate_s": 70.0, "time_zeta_s": 1.0, "time_load_s": 3.0, "loss": 2.0}
    assert list(bench_cli.stage_times(metrics)) == ["load", "calibrate", "publish", "zeta"]
