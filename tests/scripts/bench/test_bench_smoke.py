"""The GPU benchmark scripts end to end on tiny shapes (``--smoke``: CPU, Triton interpreter).

Times printed here are meaningless; what is checked is that every part runs, the table and the target
lines are printed, and nothing crashes, so a refactor of a kernel API cannot silently break a bench.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytest.importorskip("triton")  # the benches time the Triton kernels (the `dev` extra installs triton)


def _smoke(script: str, *args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / script), "--smoke", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
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


def test_sale_launch_shapes_are_timed_and_checked_against_the_default():
    """``--sale-launch R,N,W,S`` adds a selection row per launch shape, saying whether it kept the
    default's blocks (the selection does not depend on the launch); a malformed shape is refused."""
    out = _smoke("bench_prefill.py", "--parts", "sale", "--sale-launch", "64,32,4,2")
    rows = [line for line in out.splitlines() if "select 64/32/4/2" in line]
    assert rows and all("same blocks" in line for line in rows)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_prefill.py"), "--smoke",
                           "--sale-launch", "64,32,4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "expected four positive integers R,N,W,S" in proc.stderr


def test_report_reprints_a_saved_run(tmp_path, capsys):
    """``--report`` rebuilds the table and the target verdicts from a ``--json`` file alone."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_decode

    def row(method, params, b, t, graph_us, floor_us, sdpa_us):
        return {"method": method, "params": params, "batch": b, "length": t, "eager_us": graph_us + 5,
                "graph_us": graph_us, "bytes_read": 1e6, "floor_us": floor_us, "sdpa_us": sdpa_us, "note": "",
                "extra": {}, "t_us": graph_us}

    rows = [row("sdpa", "gqa flash", 1, 131072, 130.0, 128.0, 130.0),
            row("saap", "C=1024 l=32", 1, 131072, 40.0, 128.0, 130.0),   # 3.2x under the floor: met
            row("sdpa", "gqa flash", 8, 131072, 960.0, 1000.0, 960.0),
            row("saap", "C=1024 l=32", 8, 131072, 250.0, 1000.0, 960.0)]  # 4.0x: missed by 1.25x
    path = tmp_path / "run.json"
    path.write_text(json.dumps(rows))
    assert bench_decode.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if "floor/t" in ln}
    assert "MET" in lines["saap T=131072 B=1 l=32"] and "3.20" in lines["saap T=131072 B=1 l=32"]
    assert "MISSED by 1.25x" in lines["saap T=131072 B=8 l=32"]
    assert bench_decode.load_rows(path)[1].t_us == 40.0


def test_generate_bench_runs_saap_with_a_classifier_per_kv_head():
    """``bench_generate.py --saap-classifiers kv``: the 8B-shape SAAP step with the paper's shared classifiers."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_generate.py"), "--smoke",
                           "--methods", "saap", "--saap-classifiers", "kv"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a classifier per kv head" in proc.stdout and "Traceback" not in proc.stdout


def test_generate_bench_times_the_loop_with_its_projections_unfused():
    """``bench_generate.py --unfused``: the same cell with StaticGenerator's projection fusing off, labelled."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_generate.py"), "--smoke",
                           "--methods", "dense-flash", "--points", "300x1", "--unfused"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dense-flash (projections unfused)" in proc.stdout


def test_santa_stages_take_a_model_s_attention_shapes():
    """``bench_santa_stages.py --model M`` times SANTA at M's attention shapes, read from its conf/model file:
    SmolLM2-135M has 9 query heads, 3 KV heads of head_dim 64 (its published config); Llama-3.1-8B 32 / 8 / 128."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_santa_stages as bss

    assert (bss.model_shape("smollm2").hq, bss.model_shape("smollm2").hkv, bss.model_shape("smollm2").d) == (9, 3, 64)
    assert bss.model_shape("llama31") == bss.Shape(hq=32, hkv=8, d=128)
