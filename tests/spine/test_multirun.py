"""A Hydra multirun through the real CLI: every job writes result.json, the last stdout line is JSON,
and parallel processes initializing one fresh store do not race."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.sale.conftest import sale_model_dir, sale_overrides  # noqa: F401 (fixture)


def test_multirun_writes_result_json_per_job(sale_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(CALIB_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    overrides = [o for o in sale_overrides(sale_model_dir, 0.01) if not o.startswith("method.theta=")]
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "calib", "run", "-m", *overrides, "method.theta=0.01,0.03", "method.ablation_prompts=0",
         f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(sweep.glob("*/result.json"))
    assert [p.parent.name for p in results] == ["0", "1"]
    jobs = [json.loads(p.read_text()) for p in results]
    assert [j["model_uri"] for j in jobs] == ["models:/sale-rand-sale/1", "models:/sale-rand-sale/2"]
    assert all(Path(j["artifact_dir"], "manifest.json").is_file() for j in jobs)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == jobs[-1]


CONFIGURE = """
import sys
from calib import tracking
print(tracking.configure(tracking.resolve_target({"experiment": "race"})))
"""


def test_parallel_processes_share_one_fresh_store(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["CALIB_HOME"] = str(tmp_path / "home")
    procs = [subprocess.Popen([sys.executable, "-c", CONFIGURE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    ids = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(ids) == 1  # one experiment, created once, seen by all three
