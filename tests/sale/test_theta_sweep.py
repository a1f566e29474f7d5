"""scripts/research/sale_theta_sweep.py summarizes a finished multirun: table, plot, JSON, monotonicity verdict."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "research" / "sale_theta_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sale_theta_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job(root: Path, i: int, theta: float, sparsity: float) -> None:
    job = root / str(i)
    job.mkdir(parents=True)
    metrics = {"theta": theta, "sparsity": sparsity, "err_worst": theta / 2, "dense_head_fraction": 0.1,
               "sparsity_at_1024": sparsity * 0.8, "sparsity_at_2048": sparsity}
    (job / "result.json").write_text(json.dumps({"model_uri": f"models:/sale-tiny/{i + 1}", "run_id": f"r{i}",
                                                 "artifact_dir": "/x", "metrics": metrics}))


def test_summarizes_a_monotone_sweep(sweep, tmp_path, capsys):
    for i, (theta, sp) in enumerate([(0.1, 0.5), (0.025, 0.2), (0.05, 0.3)]):  # job order != theta order
        _job(tmp_path, i, theta, sp)
    assert sweep.main(["--from", str(tmp_path), "--no-mlflow"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["monotone"] is True
    assert [r["theta"] for r in summary["rows"]] == [0.025, 0.05, 0.1]
    assert summary["rows"][0]["by_length"] == {"1024": pytest.approx(0.16), "2048": pytest.approx(0.2)}
    assert (tmp_path / "sale_theta_sweep.png").stat().st_size > 1000
    assert json.loads((tmp_path / "sale_theta_sweep.json").read_text())["monotone"] is True


def test_non_monotone_sweep_exits_1(sweep, tmp_path):
    for i, (theta, sp) in enumerate([(0.025, 0.3), (0.05, 0.2)]):
        _job(tmp_path, i, theta, sp)
    assert sweep.main(["--from", str(tmp_path), "--no-mlflow"]) == 1


def test_empty_sweep_dir_is_an_error(sweep, tmp_path):
    with pytest.raises(SystemExit, match="no \\*/result.json"):
        sweep.main(["--from", str(tmp_path), "--no-mlflow"])
