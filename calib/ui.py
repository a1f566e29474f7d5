"""``python -m calib ui``: the MLflow UI on the project's tracking store, light by default and stoppable.

``mlflow server`` starts 4 request workers and, with a database store, MLflow's job runner (a set of
``huey`` consumer processes for GenAI jobs calib never submits). On a small machine that makes the
first page slow, so ``calib ui`` asks for one worker and turns the job runner off
(``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``) unless ``--workers`` / ``--jobs`` say otherwise.

The server runs in its own process group; on Ctrl-C or SIGTERM :func:`serve` signals the whole group,
waits up to :data:`STOP_GRACE_S` for it to exit and kills what is left, so no server worker or job
runner outlives the command. The UI has no authentication: it binds 127.0.0.1 unless ``--host`` says
otherwise, and then ``calib ui`` warns (:func:`is_loopback`).

The printed URLs open the runs table with MLflow 3's "Model training" navigation
(``workflowType=machine_learning``; older 3.x UIs pick it from the experiment's kind tag, which
:func:`calib.tracking.configure` sets). The second one opens a view of the table with the dataset and
the ``summary/*`` columns: an experiment tag in the format the UI's own *Share* button writes
(``mlflow.sharedViewState.<key>``); *Override saved view* there makes it the user's default.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Sequence

from mlflow.tracking import MlflowClient

from calib.tracking import SUMMARY_NAMES, SUMMARY_PREFIX

JOB_EXECUTION_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"  # read by `mlflow server` (mlflow 3)
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class UiSettings:
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 1
    jobs: bool = False  # MLflow's job runner (GenAI jobs; calib submits none)


def server_command(tracking_uri: str, registry_uri: str, artifact_root: str | None, settings: UiSettings) -> list[str]:
    """The ``mlflow server`` command line for the store and settings."""
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
               "--host", settings.host, "--port", str(settings.port), "--workers", str(settings.workers)]
    if registry_uri != tracking_uri:
        command += ["--registry-store-uri", registry_uri]
    if artifact_root:
        command += ["--default-artifact-root", artifact_root]
    return command


def server_env(settings: UiSettings) -> dict[str, str]:
    """The server's environment: ours, with the job runner switched per ``settings.jobs``."""
    return {**os.environ, JOB_EXECUTION_ENV: "true" if settings.jobs else "false"}


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine: ``localhost`` or a loopback address
    (``127.0.0.0/8``, ``::1``). A wildcard (``0.0.0.0``, ``::``) or any other name or address is not."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def runs_table_url(host: str, port: int, experiment_id: str, view: str | None = None) -> str:
    """``http://host:port/#/experiments/<id>/runs?workflowType=machine_learning``: the experiment's runs
    table (``view``: a shared view key). A wildcard bind address is shown as 127.0.0.1, which a
    browser on this machine can open."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    query = f"viewStateShareKey={view}&" if view else ""
    return f"http://{shown}:{port}/#/experiments/{experiment_id}/runs?{query}workflowType=machine_learning"


SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."  # experiment tags the UI reads for ?viewStateShareKey=
HEADLINE_VIEW = "calib-headlines"


def headline_view_state() -> dict[str, object]:
    """The runs-table view with the dataset and the ``summary/*`` columns (all but the CI's upper bound)
    in :data:`calib.tracking.SUMMARY_NAMES` order, newest run first, each column wide enough for its
    name: the JSON the UI's *Share* button stores (column ids ``<group>.`<name>```)."""
    metrics = [f"metrics.`{SUMMARY_PREFIX}{name}`" for name in SUMMARY_NAMES if name != "acc_delta_ci_high"]
    columns = ["attributes.`Dataset`", *metrics]
    widths = {column: 24 + 8 * len(column.split("`")[1]) for column in metrics}  # ~8 px per header character
    # The UI applies widths only to the columns named in columnOrder, and orders the metrics by name
    # without it.
    return {"selectedColumns": columns, "columnOrder": columns, "columnWidths": widths,
            "orderByKey": "attributes.start_time", "orderByAsc": False}


def save_headline_view(experiment_id: str) -> None:
    """Store :func:`headline_view_state` on the experiment under :data:`HEADLINE_VIEW`."""
    MlflowClient().set_experiment_tag(experiment_id, SHARED_VIEW_TAG_PREFIX + HEADLINE_VIEW,
                                      json.dumps(headline_view_state()))


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie (Linux: read from /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(pgid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process of group ``pgid``, wait up to ``grace_s`` for them to exit, SIGKILL the rest."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def serve(command: Sequence[str], env: dict[str, str], grace_s: float = STOP_GRACE_S) -> int:
    """Run ``command`` in a new process group until it exits or this process gets SIGINT / SIGTERM;
    then stop the whole group (:func:`stop_group`). Returns the command's exit status (0 when stopped
    by a signal)."""
    proc = subprocess.Popen(list(command), env=env, start_new_session=True)
    stopped: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopped.append(signum)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        stop_group(proc.pid, grace_s)
        proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if stopped else code
