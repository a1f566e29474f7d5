"""The GPU benchmark scripts end to end on tiny shapes (``--smoke``: CPU, Triton interpreter).

Times printed here are meaningless; what is checked is that every part runs, the table and the target
lines are printed, and nothing crashes, so a refactor of a kernel API cannot silently break a bench.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")  # the benches time the Triton kernels (the `dev` extra installs triton)


def _smoke(script: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script, must", [
    ("bench_decode.py", ["saap", "santa-prop", "santa-flash", "sdpa", "targets"]),
    ("bench_prefill.py", ["blocksparse", "sale", "sampleattention", "sdpa", "targets"]),
    ("bench_santa_stages.py", ["prop", "flash", "scores", "gather"]),
])
def test_bench_smoke_runs_every_part(script, must):
    out = _smoke(script)
    missing = [word for word in must if word not in out]
    assert not missing, f"{script} --smoke printed no {missing}:\n{out[-2000:]}"
    assert "Traceback" not in out
