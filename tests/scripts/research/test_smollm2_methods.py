"""scripts/research/smollm2_methods.py: the starved-budget pick, the cells confirmed and the verdicts, the lanes
and resuming, with a fake calib in place of the subprocesses (the real runs are GPU work)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.scripts.research.loader import load_script

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def script():
    return load_script("smollm2_methods")


def _sweep(rewards: dict[str, float]) -> dict[str, dict]:
    return {k: {"reward": v} for k, v in rewards.items()}


def _eval_result(lows: dict[str, float], prompts: int) -> dict:
    """A calib eval result JSON: per cell a diff 0.01 above its lower bound, dense 0.9."""
    metrics: dict[str, float] = {"num_prompts": float(prompts * len(lows)), "diff_ci_low": -0.9,
                                 "len1024.diff_ci_low": -0.9, "suite.books.diff_ci_low": -0.9}
    tasks = {}
    for cell, low in lows.items():
        metrics.update({f"{cell}.diff": low + 0.01, f"{cell}.diff_ci_low": low, f"{cell}.diff_ci_high": low + 0.02})
        tasks[cell] = {"dense": 0.9, "sparse": 0.9 + low + 0.01}
    return {"tasks": tasks, "metrics": metrics, "summary": {}}


class FakeCalib:
    """Stands in for ``run_logged``: records every command with its environment and log, answers like calib."""

    def __init__(self, eval_lows: dict[str, float], confirm_lows: dict[str, float] | None = None,
                 fail: str = "", barrier: threading.Barrier | None = None) -> None:
        self.eval_lows, self.confirm_lows = eval_lows, confirm_lows or {}
        self.fail, self.barrier = fail, barrier
        self.calls: list[tuple[list[str], dict[str, str], Path]] = []

    def kind(self, cmd: list[str]) -> str:
        if cmd[2] == "calib.santa.sweep":
            return "sweep"
        if cmd[3] == "eval":
            return "confirm" if "eval.nll.chunks=0" in cmd else "eval"
        return "run"

    def __call__(self, cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> dict:
        self.calls.append((cmd, env, log_path))
        kind = self.kind(cmd)
        done = {"exit_code": 0, "wall_s": 0.5, "peak_host_rss_gb": 1.0, "log": str(log_path)}
        if kind == self.fail:
            return {**done, "exit_code": 1, "error": "RuntimeError: CUDA out of memory"}
        if kind == "run" and self.barrier is not None:
            self.barrier.wait()  # BrokenBarrierError unless another lane's run is waiting too
        if kind == "sweep":
            return {**done, "result": {"uniform_reward": _sweep({"1": 0.1, "2": 0.45, "4": 0.8, "dense": 0.9})}}
        if kind == "run":
            method = next(a for a in cmd if a.startswith("+method="))[len("+method="):]
            return {**done, "result": {"artifact_dir": f"/artifacts/{method}", "metrics": {"time_collect_s": 2.0}}}
        if kind == "eval":
            return {**done, "result": _eval_result(self.eval_lows, 100)}
        cells = [a for a in cmd if a.startswith("eval.cells=")][-1][len("eval.cells=["):-1].split(",")
        return {**done, "result": _eval_result({c: self.confirm_lows[c] for c in cells}, 1000)}

    def kinds(self) -> list[str]:
        return [self.kind(cmd) for cmd, _, _ in self.calls]


@pytest.fixture
def calib(script, monkeypatch):
    """Install a fake calib: ``calib(eval_lows, ...)`` returns it."""
    def install(*args, **kwargs) -> FakeCalib:
        fake = FakeCalib(*args, **kwargs)
        monkeypatch.setattr(script, "run_logged", fake)
        monkeypatch.setattr(sys.modules["bench_calibration_scale"], "run_logged", fake)  # calib run's runner
        return fake
    for var in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    return install


def test_starved_budget_is_the_in_band_reward_nearest_the_middle(script):
    got = script.pick_starved_budget(_sweep({"1": 0.05, "2": 0.35, "4": 0.55, "8": 0.9, "dense": 0.95}))
    assert got == {"budget_per_layer": 4, "uniform_reward": 0.55, "in_band": True}


def test_no_budget_in_band_takes_the_nearest_and_says_so(script):
    got = script.pick_starved_budget(_sweep({"1": 0.1, "2": 0.92, "4": 0.95, "dense": 0.96}))
    assert got == {"budget_per_layer": 1, "uniform_reward": 0.1, "in_band": False}
    with pytest.raises(ValueError, match="no budget"):
        script.pick_starved_budget(_sweep({"dense": 0.9}))


def test_summary_table_reads_the_eval_and_run(script):
    rows = {"sale": {"run": {"wall_s": 45.2}, "eval": {
        "metrics": {"dense_acc": 0.86, "sparse_acc": 0.85, "diff": -0.01, "diff_ci_low": -0.03, "diff_ci_high": 0.01,
                    "niah_single@1024.diff_ci_low": -0.02, "niah_multikey@1024.diff_ci_low": -0.07,
                    "len1024.diff_ci_low": -0.05, "nll_increase": 0.0123},
        "summary": {"summary/sparsity": 0.31}}}, "saap": {"run": {"exit_code": 1}}}
    lines = script.summary_table(rows).splitlines()
    assert lines[2] == "| sale | 0.860 | 0.850 | -0.010 [-0.030, +0.010] | -0.070 | 0.310 | +1.23 | 45 |"
    assert lines[3] == "| saap | - | - | - [-, -] | - | - | - | - |"


def test_failing_cells_are_the_cells_below_the_bound_and_the_bound_itself_holds(script):
    metrics = {"niah_single@1024.diff_ci_low": -0.02, "niah_single@2048.diff_ci_low": 0.93 - 0.95,
               "book_needle@1024.diff_ci_low": -0.0201, "niah_multikey@1024.diff_ci_low": -0.5,
               "niah_single@4096.diff_ci_low": 0.01, "niah_single@1024.diff": -0.9,
               "len1024.diff_ci_low": -0.9, "suite.books.diff_ci_low": -0.9, "diff_ci_low": -0.9}
    assert script.failing_cells(metrics, -0.02) == ["book_needle@1024", "niah_multikey@1024"]
    assert script.failing_cells(metrics, -0.5) == []
    assert script.failing_cells(metrics, 0.0) == ["book_needle@1024", "niah_multikey@1024", "niah_single@1024",
                                                  "niah_single@2048"]


def test_confirm_reanswers_the_failing_cells_on_more_prompts(script, calib, tmp_path):
    fake = calib({"niah_single@1024": -0.02, "book_needle@2048": -0.03, "niah_multikey@1024": -0.05},
                 confirm_lows={"book_needle@2048": -0.01, "niah_multikey@1024": -0.03})
    out = tmp_path / "m.json"
    code = script.main(["--methods", "sale", "--home", str(tmp_path / "h"), "--out", str(out), "--batch-tokens", "4096",
                        "--eval-set", "eval.loop=eager", "--eval-set", "eval.cells=[niah_single@1024]"])
    assert code == 0  # a failing cell is a result, not an error
    assert fake.kinds() == ["run", "eval", "confirm"]
    eval_cmd, confirm = fake.calls[1][0], fake.calls[2][0]
    assert "eval.num_prompts=100" in eval_cmd and "eval.cells=[niah_single@1024]" in eval_cmd
    assert confirm[3:] == ["eval", "model=smollm2", "artifact=/artifacts/sale", "eval.num_prompts=1000",
                           "eval.batch_tokens=4096", "eval.loop=eager", "eval.nll.chunks=0",
                           "eval.suites=[synthetic,books]", "eval.cells=[book_needle@2048,niah_multikey@1024]"]
    row = json.loads(out.read_text())["sale"]
    assert row["confirm"]["cells"] == ["book_needle@2048", "niah_multikey@1024"] and row["confirm"]["prompts"] == 1000
    summary = out.with_suffix(".md").read_text()
    assert "| sale | book_needle@2048 | 1000 | 0.900 → 0.900 | +0.000 [-0.010, +0.010] | holds |" in summary
    assert "| sale | niah_single@1024 | 100 | 0.900 → 0.890 | -0.010 [-0.020, +0.000] | holds |" in summary
    assert "| sale | synthetic | 2 | fails: niah_multikey@1024 |" in summary
    assert "| sale | books | 1 | holds |" in summary


def test_named_cells_are_confirmed_even_when_their_100_prompt_interval_holds(script, calib, tmp_path):
    fake = calib({"niah_single@8192": 0.0, "niah_single@4096": -0.03, "niah_single@1024": 0.0},
                 confirm_lows={"niah_single@8192": -0.025, "niah_single@4096": -0.01})
    out = tmp_path / "m.json"
    assert script.main(["--methods", "saap", "--home", str(tmp_path / "h"), "--out", str(out),
                        "--confirm-cells", "niah_single@8192,book_needle@4096"]) == 0  # a cell not kept: ignored
    assert fake.kinds() == ["run", "eval", "confirm"]
    assert fake.calls[2][0][-1] == "eval.cells=[niah_single@4096,niah_single@8192]"
    assert "| saap | synthetic | 3 | fails: niah_single@8192 |" in out.with_suffix(".md").read_text()


def test_a_rerun_of_synthetic_cells_names_only_the_synthetic_suite(script):
    # a suite given eval.cells of none of its tasks answers its whole grid: the rerun must not name it
    args = script.parse_args(["--home", "h", "--out", "o.json", "--eval-set", "eval.suites=[books]"])
    cmd = script.eval_command(args, "/a", ["niah_single@4096", "niah_single@8192"])
    assert [a for a in cmd if a.startswith("eval.suites=")] == ["eval.suites=[synthetic]"]
    assert script.suites_for(["book_needle@1024"]) == ["books"]
    assert script.suites_for(["book_needle@1024", "niah_single@1024"]) == ["synthetic", "books"]


def test_no_confirmation_when_every_cell_holds_or_it_is_off(script, calib, tmp_path):
    fake = calib({"niah_single@1024": -0.01, "book_needle@1024": -0.5})
    home = str(tmp_path / "h")
    assert script.main(["--methods", "sale", "--home", home, "--out", str(tmp_path / "a.json"),
                        "--confirm-prompts", "0"]) == 0
    fake.eval_lows = {"niah_single@1024": -0.01}
    assert script.main(["--methods", "saap", "--home", home, "--out", str(tmp_path / "b.json")]) == 0
    assert fake.kinds() == ["run", "eval", "run", "eval"]


def _row(eval_lows: dict[str, float], confirm: dict | None = None) -> dict:
    row = {"run": {"exit_code": 0}, "eval": {**_eval_result(eval_lows, 100), "prompts": 100}}
    return {**row, "confirm": confirm} if confirm is not None else row


def test_suite_verdict_takes_the_confirmation_where_a_cell_has_one(script):
    eval_lows = {"book_needle@1024": -0.04, "niah_single@1024": -0.01, "niah_multikey@1024": -0.03}
    confirmed = {**_eval_result({"book_needle@1024": -0.015, "niah_multikey@1024": -0.025}, 1000), "prompts": 1000}
    rows = {"sale": _row(eval_lows, confirmed), "saap": _row(eval_lows),
            "santa": _row(eval_lows, {"error": "timed out after 3600 s"}), "sampleattention": {"run": {"error": "x"}}}
    assert script.suite_verdicts(rows, -0.02) == [
        ("sale", "synthetic", 2, ["niah_multikey@1024"]), ("sale", "books", 1, []),
        ("saap", "synthetic", 2, ["niah_multikey@1024"]), ("saap", "books", 1, ["book_needle@1024"]),
        ("santa", "synthetic", 2, ["niah_multikey@1024"]), ("santa", "books", 1, ["book_needle@1024"])]
    assert script.suite_verdicts(rows, -0.03)[:2] == [("sale", "synthetic", 2, []), ("sale", "books", 1, [])]
    sale = {c["cell"]: c for c in script.cell_results(rows["sale"], -0.02)}
    assert (sale["book_needle@1024"]["prompts"], sale["niah_single@1024"]["prompts"]) == (1000, 100)


def test_lanes_get_their_gpu_home_and_a_share_of_the_cores(script, calib, monkeypatch, tmp_path):
    monkeypatch.setattr(script, "usable_cpus", lambda: 16)
    home = tmp_path / "h"
    assert [(lane.env["CUDA_VISIBLE_DEVICES"], lane.env["OMP_NUM_THREADS"], lane.env["MKL_NUM_THREADS"])
            for lane in script.make_lanes(home, ["0", "1", "2"], 5)] == [("0", "5", "5"), ("1", "5", "5"),
                                                                         ("2", "5", "5")]
    assert [lane.env["OMP_NUM_THREADS"] for lane in script.make_lanes(home, ["0", "1", "2"], 1)] == ["16"]
    (one,) = script.make_lanes(home, [], 4)
    assert one.home == home and one.env["CALIB_HOME"] == str(home)
    assert not {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS"} & set(one.env)

    fake = calib({"niah_single@1024": 0.0})
    assert script.main(["--methods", "sale,saap", "--gpus", "2,5", "--home", str(home),
                        "--out", str(tmp_path / "m.json")]) == 0
    gpu_of: dict[str, set[str]] = {}
    for cmd, env, log in fake.calls:
        gpu = env["CUDA_VISIBLE_DEVICES"]
        assert env["CALIB_HOME"] == str(home / f"lane{gpu}") and log.parent == home / f"lane{gpu}"
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "8"
        method = next(m for m in ("sale", "saap") if log.name.startswith(m))
        gpu_of.setdefault(method, set()).add(gpu)
    assert sorted(gpu_of) == ["saap", "sale"] and all(len(g) == 1 for g in gpu_of.values())
    assert gpu_of["sale"] | gpu_of["saap"] == {"2", "5"}


def test_two_lanes_run_at_once(script, calib, tmp_path):
    calib({"niah_single@1024": 0.0}, barrier=threading.Barrier(2, timeout=1.0))
    assert script.main(["--methods", "sale,saap", "--gpus", "0,1", "--home", str(tmp_path / "h"),
                        "--out", str(tmp_path / "m.json")]) == 0
    calib({"niah_single@1024": 0.0}, barrier=threading.Barrier(2, timeout=0.2))
    with pytest.raises(threading.BrokenBarrierError):  # one lane: the runs one after the other
        script.main(["--methods", "sale,saap", "--home", str(tmp_path / "h"), "--out", str(tmp_path / "s.json")])


def test_a_second_call_resumes_and_runs_nothing_finished(script, calib, tmp_path):
    args = ["--methods", "sale,santa", "--gpus", "0,1", "--home", str(tmp_path / "h"), "--out", str(tmp_path / "m.json")]
    fake = calib({"niah_single@1024": -0.05}, confirm_lows={"niah_single@1024": 0.0}, fail="eval")
    assert script.main(args) == 1  # an errored step
    assert sorted(fake.kinds()) == ["eval", "eval", "run", "run"]
    fake = calib({"niah_single@1024": -0.05}, confirm_lows={"niah_single@1024": 0.0})
    assert script.main(args) == 0
    assert sorted(fake.kinds()) == ["confirm", "confirm", "eval", "eval"]
    rows = json.loads((tmp_path / "m.json").read_text())
    fake = calib({"niah_single@1024": -0.05}, confirm_lows={"niah_single@1024": 0.0})
    assert script.main(args) == 0
    assert fake.calls == [] and json.loads((tmp_path / "m.json").read_text()) == rows


def test_santa_trains_at_its_configured_budget_unless_a_sweep_is_asked(script, calib, tmp_path):
    fake = calib({"niah_single@1024": 0.0})
    home = str(tmp_path / "h")
    assert script.main(["--methods", "santa", "--home", home, "--out", str(tmp_path / "a.json")]) == 0
    assert fake.kinds() == ["run", "eval"]
    assert not any(a.startswith("rl.budget_per_layer=") for a in fake.calls[0][0])
    fake = calib({"niah_single@1024": 0.0})
    assert script.main(["--methods", "santa", "--santa-sweep", "1,2,4", "--home", home,
                        "--out", str(tmp_path / "b.json")]) == 0
    assert fake.kinds() == ["sweep", "run", "eval"] and "sweep=1,2,4" in fake.calls[0][0]
    assert fake.calls[1][0][-1] == "rl.budget_per_layer=2"  # uniform reward 0.45: inside 0.3-0.7


def test_run_logged_reads_the_last_json_line_the_error_and_the_timeout(script, tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    ok = script.run_logged([sys.executable, "-c", "print('progress'); print('{\"a\": 1}')"], env,
                           tmp_path / "ok.log", 30)
    assert ok["exit_code"] == 0 and ok["result"] == {"a": 1} and "error" not in ok
    assert (tmp_path / "ok.stdout.log").read_text() == 'progress\n{"a": 1}\n'  # the recipe's log lines kept
    bad = script.run_logged([sys.executable, "-c", "import sys; sys.stderr.write('x\\nValueError: boom\\n'); "
                             "sys.exit(3)"], env, tmp_path / "bad.log", 30)
    assert (bad["exit_code"], bad["error"]) == (3, "ValueError: boom") and "result" not in bad
    slow = script.run_logged([sys.executable, "-c", "import time; time.sleep(30)"], env, tmp_path / "slow.log", 0.3)
    assert slow["error"] == "timed out after 0 s" and slow["wall_s"] < 10


def test_the_script_imports_only_the_standard_library(tmp_path):
    path = ROOT / "scripts" / "research" / "smollm2_methods.py"
    code = (f"import runpy, sys; runpy.run_path({str(path)!r}, run_name='smollm2_methods'); "
            "heavy = {'torch', 'hydra', 'mlflow', 'omegaconf', 'calib'} & set(sys.modules); "
            "sys.exit(f'imported {sorted(heavy)}' if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_gpu_named_again_gets_another_lane_with_its_own_home(script, monkeypatch, tmp_path):
    monkeypatch.setattr(script, "usable_cpus", lambda: 16)
    lanes = script.make_lanes(tmp_path, ["0", "0", "1", "0"], 4)
    assert [lane.name for lane in lanes] == ["gpu0", "gpu0.1", "gpu1", "gpu0.2"]
    assert [lane.home.name for lane in lanes] == ["lane0", "lane0.1", "lane1", "lane0.2"]
    assert [lane.env["CUDA_VISIBLE_DEVICES"] for lane in lanes] == ["0", "0", "1", "0"]
    assert {lane.env["CALIB_HOME"] for lane in lanes} == {str(lane.home) for lane in lanes}
    assert {lane.env["OMP_NUM_THREADS"] for lane in lanes} == {"4"}
