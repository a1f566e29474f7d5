"""``calib ui``: the server command (one worker, no job runner), the printed URLs, the headline view, and
that stopping it stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calib import ui
from tests.subprocess_env import python_path


def test_server_command_is_light_by_default():
    command = ui.server_command("sqlite:////x/mlflow.db", "sqlite:////x/mlflow.db", "file:///x/mlruns", ui.UiSettings())
    assert command[1:4] == ["-m", "mlflow", "server"]
    assert command[command.index("--workers") + 1] == "1"
    assert command[command.index("--backend-store-uri") + 1] == "sqlite:////x/mlflow.db"
    assert "--registry-store-uri" not in command
    assert ui.server_env(ui.UiSettings())[ui.JOB_EXECUTION_ENV] == "false"
    assert ui.server_env(ui.UiSettings(jobs=True))[ui.JOB_EXECUTION_ENV] == "true"
    other = ui.server_command("sqlite:////x/a.db", "sqlite:////x/b.db", None, ui.UiSettings(workers=3))
    assert other[other.index("--registry-store-uri") + 1] == "sqlite:////x/b.db" and "--default-artifact-root" not in other


@pytest.mark.parametrize("host, shown", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::1", "[::1]"),
                                         ("box.lan", "box.lan")])
def test_runs_table_url(host, shown):
    assert ui.runs_table_url(host, 5001, "7") == f"http://{shown}:5001/#/experiments/7/runs?workflowType=machine_learning"
    assert ui.runs_table_url(host, 5001, "7", "v") == \
        f"http://{shown}:5001/#/experiments/7/runs?viewStateShareKey=v&workflowType=machine_learning"


def test_headline_view_selects_the_summary_columns():
    state = json.loads(json.dumps(ui.headline_view_state()))
    assert state["selectedColumns"][0] == "attributes.`Dataset`"
    assert "metrics.`summary/sparsity`" in state["selectedColumns"]
    assert "metrics.`summary/acc_delta_ci_low`" in state["selectedColumns"]
    assert set(state["columnWidths"]) == set(state["selectedColumns"][1:])


def test_cli_dry_run_prints_the_runs_table_and_a_light_command(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "CALIB_HOME": str(tmp_path),
           "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, "-m", "calib", "ui", "--dry-run", "--port", "5123", "--", "--dev"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert not [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]  # loopback: no warning
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(": http://127.0.0.1:5123/#/experiments/1/runs?workflowType=machine_learning")
    assert "viewStateShareKey=calib-headlines" in lines[1]
    assert lines[2].startswith("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false ")
    assert " --workers 1 " in lines[2] and lines[2].endswith(" --dev")
    bad = subprocess.run([sys.executable, "-m", "calib", "ui", "--workers", "0"], capture_output=True, text=True,
                         env=env, timeout=180)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --workers must be >= 1 (got 0)"


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.0.1", True), ("localhost", True),
                                             ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("::", False),
                                             ("192.168.1.7", False), ("box.lan", False)])
def test_is_loopback(host, loopback):
    assert ui.is_loopback(host) is loopback


def test_cli_warns_when_the_ui_leaves_this_machine(tmp_path):
    """Any --host but loopback: one stderr line saying the UI has no authentication (127.0.0.1: none, in
    the dry run above)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "CALIB_HOME": str(tmp_path),
           "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, "-m", "calib", "ui", "--dry-run", "--host", "0.0.0.0", "--port", "5124"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "no authentication" in warnings[0] and "0.0.0.0:5124" in warnings[0]
    assert "--host 0.0.0.0" in proc.stdout.splitlines()[-1]


def _processes() -> dict[int, tuple[str, int, int]]:
    """``{pid: (state, ppid, pgid)}`` of every process, read from /proc."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state ppid pgrp ...
        except (OSError, IndexError):
            continue
        out[int(stat.parent.name)] = (fields[0], int(fields[1]), int(fields[2]))
    return out


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of group ``pgid``."""
    return [pid for pid, (state, _, group) in _processes().items() if group == pgid and state != "Z"]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process groups from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_the_whole_process_group(sig):
    """A server that forks children (a shell with two background sleeps) runs in its own process group
    and is stopped with all of them when ``serve``'s process gets SIGTERM or Ctrl-C (SIGINT)."""
    script = ("import os, sys; from calib.ui import serve; "
              "sys.exit(serve(['sh', '-c', 'sleep 300 & sleep 300 & wait'], dict(os.environ), grace_s=3))")
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": python_path()})
    try:
        deadline, pgid = time.time() + 60, None
        # until the shell is in its own group (a child seen between fork and setpgid still has its parent's,
        # whose members are the test run's own processes) and that group holds sh + 2 sleeps
        while time.time() < deadline and (pgid is None or pgid == os.getpgid(proc.pid)
                                          or len(_group_members(pgid)) < 3):
            table = _processes()
            shells = [pid for pid, (_, ppid, _) in table.items() if ppid == proc.pid]
            pgid = table[shells[0]][2] if shells else None
            time.sleep(0.1)
        assert pgid is not None and len(_group_members(pgid)) == 3, "the server and its children never started"
        assert pgid != os.getpgid(proc.pid), "the server runs in its own process group"
        started = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert _group_members(pgid) == []
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
