"""Start and read the local child processes of a SANTA run (:mod:`calib.santa.local_worker`): the
parent side, kept apart from the child's entry point so that the modules that spawn children
(:mod:`calib.santa.recipe`, :mod:`calib.santa.heldout`) and the child (which runs held-out jobs of
:mod:`calib.santa.heldout`) import one way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence

from calib.paths import project_root


def start_child(index: int, seed: int, threads: int, lines: Sequence[str], *, score: bool = False) -> subprocess.Popen:
    """Start one child with ``lines`` (JSON texts) written to its stdin, which stays open (text mode)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(project_root()), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, "-m", "calib.santa.local_worker", "--index", str(index), "--seed", str(seed),
           "--threads", str(threads), *(["--score"] if score else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in lines:
        proc.stdin.write(line.rstrip("\n") + "\n")
    proc.stdin.flush()
    return proc


def last_json(text: str | None, code: int | None) -> dict[str, Any]:
    """The child's report: the last JSON object line of its stdout."""
    for line in reversed((text or "").splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return {"error": f"exited with code {code} without a report"} if code else {}
