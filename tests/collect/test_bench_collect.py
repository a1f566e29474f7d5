"""scripts/bench/bench_collect.py runs end to end on CPU (a one-layer, short-prompt version of --smoke)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_collect.py"


@pytest.mark.slow
def test_bench_collect_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_collect", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--smoke", "--layers", "1", "--tokens", "256", "--vocab", "512", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "| collection forward" in out and "tokens/s" in out
    assert result["tokens"] == 256 and result["collect_tokens_per_s"] > 0 and result["shard_bytes"] > 0
