"""scripts/research/saap_selectivity_curve.py: the eval command of each point (a uniform ℓ on every sparse layer,
through Hydra and calib's option parsing into the runtime), the figures read from an eval result built by calib's
own summary code, resuming, the table's order and one-line errors; a fake calib stands in for the GPU evals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime_kernels.manifest import DataRecord, Manifest, ModelRecord, ProducerRecord, write_artifact

from tests.scripts.research.loader import load_script

ROOT = Path(__file__).resolve().parents[3]
CELLS = ["book_needle@1024", "niah_single@4096"]


@pytest.fixture(scope="module")
def script():
    return load_script("saap_selectivity_curve")


def _artifact(path: Path, method: str = "saap", top_l: int = 32, top_l_layers: dict | None = None) -> Path:
    """A 6-layer artifact, layers 0 and 2 dense, the others small classifiers of 8 buckets, with ``top_l`` and
    the per-layer map a layer profile writes."""
    hq, hkv, d, c, hd = 2, 1, 4, 8, 4
    shapes = {"centroids": (hkv, c, d), "w1": (hq, d, hd), "b1": (hq, hd), "bn_mean": (hq, hd), "bn_var": (hq, hd),
              "bn_weight": (hq, hd), "bn_bias": (hq, hd), "w2": (hq, hd, c), "b2": (hq, c)}
    tensors = {f"layers.{layer}.{name}": torch.ones(shape) for layer in (1, 3, 4, 5) for name, shape in shapes.items()}
    manifest = Manifest(
        method=method, abi_version=1,
        model=ModelRecord(name="smollm2", num_layers=6, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                          rope_theta=100000.0),
        hyperparameters={"sink": 1, "window": 256, "top_l": top_l, "dense_layers": [0, 2], "clusters": c,
                         "top_l_layers": {str(k): v for k, v in (top_l_layers or {}).items()}},
        data=DataRecord(source="books", seed=1234, count=4, lengths=[1024], content_hash="ab" * 32),
        producer=ProducerRecord(package="calib", version="0", git_sha=None, created_at="2026-01-01T00:00:00Z"))
    return write_artifact(path, manifest, {"classifier": tensors})


def _args(script, tmp_path: Path, artifact: Path, *extra: str):
    return script.parse_args(["--artifact", str(artifact), "--home", str(tmp_path / "h"),
                              "--out", str(tmp_path / "c.json"), *extra])


def test_a_uniform_point_sets_its_l_on_every_sparse_layer_in_the_runtime(script, tmp_path):
    from calib.config import compose
    from calib.evaluate import runtime_options
    from runtime_kernels.manifest import read_artifact
    from runtime_kernels.saap.api import SaapDecode

    artifact = _artifact(tmp_path / "a", top_l_layers={3: 6, 4: 7})
    settings = script.read_settings(artifact)
    assert settings.sparse_layers() == [1, 3, 4, 5]
    args = _args(script, tmp_path, artifact, "--top-l", "64,16,32", "--prompts", "7", "--cells",
                 "book_needle@1024,niah_single@4096")
    points = script.plan_points(args.top_l, settings)
    assert [(p.label, p.top_l) for p in points] == [("artifact", None), ("l16", 16), ("l32", 32), ("l64", 64)]
    assert not any(a.startswith("eval.top_l") for a in script.eval_command(args, points[0], settings))

    cmd = script.eval_command(args, points[1], settings)
    assert cmd[1:4] == ["-m", "calib", "eval"]
    cfg = compose(cmd[4:])  # the overrides as `calib eval` composes them
    assert (cfg.model.name, cfg.artifact, cfg.eval.num_prompts) == ("smollm2", str(artifact), 7)
    assert list(cfg.eval.cells) == CELLS and list(cfg.eval.suites) == ["synthetic", "books"]
    assert cfg.eval.nll.chunks == 0
    art = read_artifact(artifact)
    runtime = SaapDecode.from_artifact(art, None, **runtime_options(cfg, "saap")["saap"])  # what hf.apply builds
    assert {layer: runtime.layer_top_l(layer) for layer in (1, 3, 4, 5)} == {1: 16, 3: 16, 4: 16, 5: 16}
    alone = SaapDecode.from_artifact(art, None, top_l=16)  # eval.top_l alone keeps the artifact's per-layer ℓ
    assert (alone.layer_top_l(1), alone.layer_top_l(3)) == (16, 6)


def test_an_l_equal_to_a_single_l_artifact_is_its_own_point_and_suites_follow_the_cells(script, tmp_path):
    settings = script.read_settings(_artifact(tmp_path / "a", top_l=32))
    assert [p.label for p in script.plan_points([16, 32, 64], settings)] == ["artifact", "l16", "l64"]
    args = _args(script, tmp_path, tmp_path / "a", "--cells", "book_needle@1024,2048", "--eval-set", "eval.suites=[x]")
    cmd = script.eval_command(args, script.Point("l16", 16), settings)
    assert "eval.cells=[book_needle@1024,book_needle@2048]" in cmd
    assert cmd.index("eval.suites=[books]") < cmd.index("eval.suites=[x]")  # the user's comes later: it wins


def test_cells_take_bare_lengths_from_the_task_before_them(script):
    assert script.parse_cells(" book_needle@1024,2048,niah_single@4096,08192,book_needle@02048") == [
        "book_needle@1024", "book_needle@2048", "niah_single@4096", "niah_single@8192"]
    assert script.parse_cells(script.DEFAULT_CELLS)[3:5] == ["book_needle@8192", "niah_single@4096"]


def _eval_result(cells: dict[str, tuple[list[bool], list[bool], list[float]]]) -> dict:
    """A ``calib eval`` result JSON from calib's own summary code: per cell dense / sparse correctness and each
    prompt's selectivity (with window: selectivity + 0.5)."""
    from calib.evaluate import PromptResult, summarize
    from calib.tracking import EVAL_HEADLINES, eval_sparsity, headline_metrics

    dense, sparse = [], []
    for cell, (d, s, sel) in cells.items():
        task, length = cell.split("@")
        dense += [PromptResult(task, int(length), "", ok, {}) for ok in d]
        sparse += [PromptResult(task, int(length), "", ok, {"selectivity": x, "selectivity_with_window": x + 0.5})
                   for ok, x in zip(s, sel)]
    tasks, metrics = summarize(dense, sparse, resamples=200, seed=0)
    summary = {**headline_metrics(EVAL_HEADLINES, metrics),
               "summary/sparsity": eval_sparsity("saap", [r.stats for r in sparse])}
    return {"artifact": "/a", "tasks": tasks, "metrics": metrics, "summary": summary, "run_id": "r"}


def test_figures_are_read_per_cell_from_a_real_result(script, tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_eval_result({
        "book_needle@1024": ([True, True, True, False], [True, False, True, False], [0.1, 0.2, 0.3, 0.4]),
        "niah_single@4096": ([True, True], [True, True], [0.05, 0.15])})))
    got = script.point_figures(json.loads(path.read_text()), CELLS)
    book, niah = got["cells"]["book_needle@1024"], got["cells"]["niah_single@4096"]
    assert (book["dense"], book["sparse"], book["diff"]) == pytest.approx((0.75, 0.5, -0.25))
    assert (book["selectivity"], book["selectivity_with_window"]) == pytest.approx((0.25, 0.75))
    assert book["low"] <= -0.25 <= book["high"] and book["low"] < book["high"]
    assert (niah["diff"], niah["low"], niah["high"], niah["selectivity"]) == pytest.approx((0.0, 0.0, 0.0, 0.1))
    assert got["selectivity"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4 + 0.05 + 0.15) / 6)  # every prompt's mean
    with pytest.raises(KeyError, match="niah_single@8192"):
        script.point_figures(json.loads(path.read_text()), ["niah_single@8192"])


class FakeCalib:
    """Stands in for ``run_logged``: answers each eval with selectivity ℓ / 256 (the artifact's ℓ = 32)."""

    def __init__(self, fail: str = "") -> None:
        self.fail, self.calls = fail, []

    def __call__(self, cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> dict:
        self.calls.append(cmd)
        top_l = next((int(a.split("=")[1]) for a in cmd if a.startswith("eval.top_l=")), 32)
        done = {"exit_code": 0, "wall_s": 1.0, "log": str(log_path)}
        if f"eval.top_l={self.fail}" in cmd:
            return {**done, "exit_code": 1, "error": "RuntimeError: CUDA out of memory"}
        sel = top_l / 256
        return {**done, "result": _eval_result({c: ([True] * 4, [True, True, top_l >= 32, True], [sel] * 4)
                                                for c in CELLS})}

    def labels(self) -> list[str]:
        return [next((a.split("=")[1] for a in cmd if a.startswith("eval.top_l=")), "artifact") for cmd in self.calls]


def test_a_finished_point_is_not_run_again_unless_its_settings_change(script, tmp_path, monkeypatch):
    artifact, out = _artifact(tmp_path / "a", top_l=32), tmp_path / "c.json"
    argv = ["--artifact", str(artifact), "--home", str(tmp_path / "h"), "--out", str(out), "--top-l", "16,64",
            "--cells", ",".join(CELLS)]
    fake = FakeCalib(fail="64")
    monkeypatch.setitem(script.json_step.__globals__, "run_logged", fake)
    assert script.main(argv) == 1  # a point errored
    rows = json.loads(out.read_text())
    assert "error" in rows["l64"]["eval"] and rows["l16"]["eval"]["cells"]["book_needle@1024"]["sparse"] == 0.75
    fake.fail = ""
    assert script.main(argv) == 0
    assert fake.labels() == ["artifact", "16", "64", "64"]
    assert script.main([*argv, "--prompts", "50"]) == 0  # another prompt count: every point again
    assert fake.labels()[4:] == ["artifact", "16", "64"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = out.with_suffix(".md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in table if line.startswith("| l") or line.startswith("| a")] == [
        "| l16", "| artifact", "| l64"]


def _row(label: str, selectivity: float | None, error: str = "") -> dict:
    if error:
        return {"label": label, "error": error, "log": f"/h/curve_{label}.log"}
    cell = {"dense": 0.9, "sparse": 0.85, "diff": -0.05, "low": -0.1, "high": 0.0, "selectivity": selectivity,
            "selectivity_with_window": 0.5}
    return {"label": label, "top_l": 32, "top_l_layers": {"1": 32, "16": 256, "17": 256, "19": 256},
            "settings": {"prompts": 100}, "selectivity": selectivity, "cells": {"book_needle@1024": cell}}


def test_the_table_lists_points_least_selective_first_and_errors_below(script):
    rows = {"artifact": _row("artifact", 0.2), "l16": _row("l16", 0.1), "l64": _row("l64", 0.3),
            "l8": _row("l8", None), "l128": _row("l128", None, error="timed out after 3600 s")}
    lines = script.markdown(rows, ["book_needle@1024"]).splitlines()
    assert lines[0] == "dense accuracy: book_needle@1024 0.900"
    body = [line for line in lines if line.startswith("| l") or line.startswith("| a")]
    assert [line.split(" | ")[0] for line in body] == ["| l16", "| artifact", "| l64", "| l8"]
    assert body[0] == "| l16 | 32; 256 on 16-17,19 | 0.100 | -0.050 [-0.100, +0.000] | 0.100 (0.500) |"
    assert lines[-1] == "l128: timed out after 3600 s (log: /h/curve_l128.log)"


@pytest.mark.parametrize("argv, message", [
    (["--top-l", "16,abc"], "--top-l takes comma-separated integers >= 1"),
    (["--top-l", "16,0"], "--top-l takes comma-separated integers >= 1"),
    (["--top-l", ","], "--top-l takes comma-separated integers >= 1"),
    (["--cells", "1024,book_needle@2048"], "--cells takes task@length entries"),
    (["--eval-set", "eval.top_l=8"], "--eval-set takes KEY=VALUE and not"),
    (["--out", "curve.md"], "--out is the JSON"),
], ids=["letters", "zero", "empty", "length-first", "owned-key", "md-out"])
def test_bad_arguments_end_in_one_line(script, tmp_path, capsys, argv, message):
    base = {"--artifact": str(_artifact(tmp_path / "a")), "--home": str(tmp_path / "h"),
            "--out": str(tmp_path / "c.json")}
    given = dict(zip(argv[::2], argv[1::2]))
    assert script.main([x for k, v in {**base, **given}.items() for x in (k, v)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "h").exists()  # nothing ran


def test_an_artifact_of_another_method_or_no_artifact_ends_in_one_line(script, tmp_path, capsys):
    for artifact, message in [(_artifact(tmp_path / "s", method="sale"), "is a 'sale' artifact"),
                              (tmp_path, "is not an artifact directory")]:
        assert script.main(["--artifact", str(artifact), "--home", str(tmp_path / "h"),
                            "--out", str(tmp_path / "c.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_importing_the_script_pulls_in_neither_hydra_mlflow_nor_torch():
    code = ("import importlib.util, sys; p = sys.argv[1]; "
            "spec = importlib.util.spec_from_file_location('curve', p); m = importlib.util.module_from_spec(spec); "
            "sys.modules['curve'] = m; spec.loader.exec_module(m); "
            "print(sorted({'hydra', 'mlflow', 'omegaconf', 'torch', 'calib'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts" / "research" / "saap_selectivity_curve.py")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
