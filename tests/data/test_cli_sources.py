"""`calib run` and `calib eval` as a user types them, with every data source, on the shipped tiny model.

Matrix: {synthetic, jsonl, hf} x {`run` of the fastest method (SampleAttention on a one-point grid),
dense `eval`, `eval artifact=<that run's artifact>`}, each a subprocess checked on its exit code and
its last stdout line (the result JSON). The variants are spread over the cells: JSONL rows with and
without "task"/"length", with and without `eval_path`; HF as a `save_to_disk` DatasetDict and as
`name=json data_files=...`. Then bad data: one `error:` line, exit 2, no traceback.

The subprocesses share one temporary CALIB_HOME (MLflow store) and HF_HOME, run up to three at a time
(each on one thread), and each registers under its own model name, so they never race on a version.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from calib.paths import project_root
from tests.data.source_files import (expected_cells, held_out, synthetic_rows, tiny_tokenizer_from_disk,
                                     write_jsonl)
from tests.subprocess_env import python_path

COMMON = ["device=cpu", "model.lengths=[256]", "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.bootstrap=50"]
FAST_RUN = ["+method=sampleattention", "method.alphas_c=[0.95]", "method.alphas_s=[0.95]", "method.chunk_ns=[1]",
            "method.blk=32", "method.profiling.prompts_per_length=1"]
PER_TASK = 2  # eval.num_prompts: held-out rows per task of a file/hub source
PARALLEL = 3
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
SOURCES = ("synthetic", "jsonl", "hf") if HAS_DATASETS else ("synthetic", "jsonl")
needs_datasets = pytest.mark.skipif(not HAS_DATASETS, reason="needs `datasets` (pip install 'calib[hf]')")
SOURCE_PARAMS = ["synthetic", "jsonl", pytest.param("hf", marks=needs_datasets)]


@dataclass
class Workspace:
    root: Path
    rows: list[dict[str, Any]]  # rows.jsonl (hash-split), a mix of rows with and without task/length
    held: list[dict[str, Any]]  # held.jsonl (eval_path)
    hf_train: list[dict[str, Any]]
    hf_test: list[dict[str, Any]]
    hf_json: list[dict[str, Any]]  # hf.jsonl, loaded through name=json and hash-split

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HF_"))}
        env.update(CALIB_HOME=str(self.root / "home"), HF_HOME=str(self.root / "hf"), HF_HUB_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                   PYTHONPATH=python_path(project_root()))
        return env

    def path(self, name: str) -> str:
        return str(self.root / name)


def _mixed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every second row loses its "task" (-> the default task), every third gets a "length"."""
    out = []
    for i, r in enumerate(rows):
        row = dict(r)
        if i % 2:
            row.pop("task")
        if i % 3 == 0:
            row["length"] = 200
        out.append(row)
    return out


def _hf_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"question": r["prompt"], "answer": r["answer"]} for r in rows]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    root = tmp_path_factory.mktemp("cli_sources")
    (root / "home" / "artifacts").mkdir(parents=True)
    rows = _mixed_rows(synthetic_rows(["niah_single", "kv_retrieval"], 180, 4, seed=11))
    held = synthetic_rows(["niah_single"], 180, 2, seed=12)
    hf_all = _hf_rows(synthetic_rows(["niah_single"], 180, 6, seed=13))
    ws = Workspace(root, rows, held, hf_all[:3], hf_all[3:5], hf_all[:6])
    assert any(held_out(r["prompt"]) for r in rows) and not all(held_out(r["prompt"]) for r in rows)
    shapes = {("task" in r, "length" in r) for r in rows if held_out(r["prompt"])}
    assert {(True, True), (False, True), (False, False)} <= shapes  # eval sees rows with and without both
    assert any(held_out(r["question"]) for r in ws.hf_json) and not all(held_out(r["question"]) for r in ws.hf_json)
    write_jsonl(root / "rows.jsonl", rows)
    write_jsonl(root / "held.jsonl", held)
    write_jsonl(root / "hf.jsonl", ws.hf_json)
    if HAS_DATASETS:
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset.from_list(ws.hf_train),
                              "test": datasets.Dataset.from_list(ws.hf_test)}).save_to_disk(str(root / "saved"))
    return ws


def calib_cli(ws: Workspace, name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m calib <args>`` in the workspace, its Hydra output in ``out/<name>``."""
    cmd = [sys.executable, "-m", "calib", *args]
    if args[0] in ("run", "eval"):
        cmd.append(f"hydra.run.dir={ws.root / 'out' / name}")
    return subprocess.run(cmd, cwd=ws.root, env=ws.env(), capture_output=True, text=True, timeout=600)


def last_json(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- matrix
def source_args(ws: Workspace, source: str, cell: str) -> list[str]:
    """The data overrides of one (source, cell); the variants are spread over the cells."""
    hf_saved = ["data=hf", f"data.name={ws.path('saved')}", "data.config=null", "data.answer_regex=null",
                "data.task=niah", "data.split=train"]
    return {
        ("synthetic", "run"): ["data.tasks=[niah_single]"],
        ("synthetic", "dense"): ["data.tasks=[niah_single]"],
        ("synthetic", "artifact"): ["data.tasks=[niah_single]"],
        ("jsonl", "run"): ["data=jsonl", f"data.path={ws.path('rows.jsonl')}"],
        ("jsonl", "dense"): ["data=jsonl", f"data.path={ws.path('rows.jsonl')}",
                             f"data.eval_path={ws.path('held.jsonl')}"],
        ("jsonl", "artifact"): ["data=jsonl", f"data.path={ws.path('rows.jsonl')}"],
        ("hf", "run"): [*hf_saved, "data.eval_split=test"],
        ("hf", "dense"): [*hf_saved, "data.eval_split=test"],
        ("hf", "artifact"): ["data=hf", "data.name=json", f"data.data_files={ws.path('hf.jsonl')}",
                             "data.config=null", "data.answer_regex=null", "data.task=niah", "data.eval_split=null",
                             "data.num_prompts=null"],
    }[(source, cell)]


def expected_eval_cells(ws: Workspace, source: str, cell: str) -> dict[str, int]:
    """``{"task@length": prompts}`` each eval must report, worked out from the files."""
    tok = tiny_tokenizer_from_disk()
    if source == "synthetic":
        return {"niah_single@256": PER_TASK}
    if source == "jsonl":
        rows = ws.held if cell == "dense" else [r for r in ws.rows if held_out(r["prompt"])]
        return expected_cells(rows, tok, PER_TASK)
    rows = ws.hf_test if cell == "dense" else [r for r in ws.hf_json if held_out(r["question"])]
    return expected_cells([{"prompt": r["question"], "task": "niah"} for r in rows], tok, PER_TASK)


def run_chain(ws: Workspace, source: str) -> dict[str, subprocess.CompletedProcess]:
    """`run` on the source, then `eval` with the artifact it registered."""
    run = calib_cli(ws, f"run-{source}", "run", *FAST_RUN, *COMMON, f"model.name=tiny_{source}",
                    *source_args(ws, source, "run"))
    out = {"run": run}
    if run.returncode == 0:
        uri = last_json(run)["model_uri"]
        out["artifact"] = calib_cli(ws, f"artifact-{source}", "eval", *COMMON, f"model.name=tiny_{source}",
                                    f"artifact={uri}", *source_args(ws, source, "artifact"))
    return out


@pytest.fixture(scope="module")
def matrix(ws: Workspace) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every (source, cell), up to ``PARALLEL`` subprocesses at a time."""
    with ThreadPoolExecutor(PARALLEL) as pool:
        chains = {s: pool.submit(run_chain, ws, s) for s in SOURCES}
        dense = {s: pool.submit(calib_cli, ws, f"dense-{s}", "eval", *COMMON, *source_args(ws, s, "dense"))
                 for s in SOURCES}
        cells = {(s, "dense"): dense[s].result() for s in SOURCES}
        for s in SOURCES:
            cells.update({(s, cell): proc for cell, proc in chains[s].result().items()})
    return cells


@pytest.mark.parametrize("source", SOURCE_PARAMS)
def test_run_registers_an_artifact(matrix, ws, source):
    from runtime_kernels.artifact import load_artifact

    result = last_json(matrix[(source, "run")])
    assert result["model_uri"] == f"models:/sampleattention-tiny_{source}/1"
    assert result["metrics"]["grid_points"] == 1.0
    data = load_artifact(result["artifact_dir"], method="sampleattention").manifest.data
    assert data.source == source
    calibration_tasks = {"synthetic": ["niah_single"], "hf": ["niah"],
                         "jsonl": sorted({r.get("task", "jsonl") for r in ws.rows if not held_out(r["prompt"])})}
    assert data.tasks == calibration_tasks[source]
    assert data.count == len(calibration_tasks[source])  # profiling.prompts_per_length=1 per task


@pytest.mark.parametrize("source", SOURCE_PARAMS)
def test_dense_eval(matrix, ws, source):
    result = last_json(matrix[(source, "dense")])
    expected = expected_eval_cells(ws, source, "dense")
    assert result["artifact"] is None
    assert set(result["tasks"]) == set(expected)
    assert result["metrics"]["num_prompts"] == sum(expected.values())
    for entry in result["tasks"].values():
        assert set(entry) == {"dense"} and 0.0 <= entry["dense"] <= 1.0


@pytest.mark.parametrize("source", SOURCE_PARAMS)
def test_eval_with_artifact(matrix, ws, source):
    result = last_json(matrix[(source, "artifact")])
    expected = expected_eval_cells(ws, source, "artifact")
    assert result["artifact"] == f"models:/sampleattention-tiny_{source}/1"
    assert set(result["tasks"]) == set(expected)
    assert result["metrics"]["num_prompts"] == sum(expected.values())
    for entry in result["tasks"].values():
        assert set(entry) == {"dense", "sparse"} and 0.0 <= entry["sparse"] <= 1.0
    m = result["metrics"]
    assert m["diff"] == pytest.approx(m["sparse_acc"] - m["dense_acc"])


# ------------------------------------------------------------------------------------------- bad data
def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def bad_files(ws: Workspace) -> dict[str, str]:
    """Paths of the bad files (and of the good ones they are combined with), by name."""
    (ws.root / "empty.jsonl").write_text("")
    write_jsonl(ws.root / "malformed.jsonl", [ws.rows[0], "", '{"prompt": "the fox", "answer": 1', ws.rows[1]])
    write_jsonl(ws.root / "held_no_answer.jsonl", [{"prompt": r["prompt"]} for r in ws.held])
    write_jsonl(ws.root / "no_answer.jsonl", [{"prompt": r["prompt"]} for r in ws.rows])
    write_jsonl(ws.root / "overlap.jsonl", [ws.held[0], ws.rows[2]])
    names = ("empty", "malformed", "held_no_answer", "no_answer", "overlap", "rows")
    return {**{n: ws.path(f"{n}.jsonl") for n in names}, "saved": ws.path("saved")}


BAD_DATA = {
    "empty file": (["eval", "data=jsonl", "data.path={empty}"], ["empty dataset", "empty.jsonl has no rows"]),
    "malformed line": (["eval", "data=jsonl", "data.path={malformed}"], ["malformed.jsonl:3: not valid JSON"]),
    "eval needs answers": (["eval", "data=jsonl", "data.path={rows}", "data.eval_path={held_no_answer}"],
                           ["`eval` scores every held-out answer", "held_no_answer.jsonl:1 has no answer",
                            "2 of 2 held-out rows"]),
    "SANTA needs answers": (["run", "+method=santa", "data=jsonl", "data.path={no_answer}"],
                            ["SANTA's REINFORCE reward", "has no answer", "calibration rows"]),
    "held-out file overlaps": (["eval", "data=jsonl", "data.path={rows}", "data.eval_path={overlap}"],
                               ["held-out rows overlap calibration", "overlap.jsonl:2", "rows.jsonl:3"]),
    "held-out split overlaps": (["eval", "data=hf", "data.name={saved}", "data.config=null", "data.eval_split=train"],
                                ["held-out rows overlap calibration", "data.eval_split='train' is data.split"]),
    "dataset not cached": (["eval", "data=hf", "data.name=calib-test/not-in-any-cache"],
                           ["could not load HF dataset 'calib-test/not-in-any-cache'", "HF_HUB_OFFLINE"]),
}
BAD_CASES = [pytest.param(c, marks=needs_datasets) if c == "dataset not cached" else c for c in BAD_DATA]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_data_is_one_line(ws, bad_files, case):
    args, fragments = BAD_DATA[case]
    proc = calib_cli(ws, case.replace(" ", "-"), *[a.format(**bad_files) for a in args], "device=cpu")
    assert_one_line_error(proc, *fragments)
