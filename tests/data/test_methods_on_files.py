"""Every method calibrates on a JSONL file and on a saved HF dataset (tiny model, CPU, minutes: slow).

The CLI matrix (test_cli_sources.py) runs only the fastest method; this runs the other three through
``calib.run.run`` on the same kind of rows, and checks what each manifest records about the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.data.source_files import held_out, synthetic_rows, write_jsonl
from tests.recipe_support import run_recipe

pytestmark = pytest.mark.slow

COMMON = ["device=cpu", "model.lengths=[640]", "eval.max_new_tokens=8", "eval.bootstrap=100"]
METHODS = {
    "sale": ["+method=sale", "method.num_samples=2", "method.sparsity_prompts=1", "method.ablation_prompts=1"],
    "saap": ["+method=saap", "method.clusters=16", "method.prompts=4", "method.classifier.hidden=32",
             "method.classifier.steps=20", "method.eval.prompts=2", "method.top_ls=[1,2,4]"],
    "santa": ["+method=santa", "rl.iterations=2", "rl.workers=1", "rl.episodes=2", "rl.questions_per_episode=2",
              "rl.heldout_questions=2", "method.reward.pool=4", "rl.heldout_uniform_placements=false"],
}


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    """Synthetic prompts of ~600 tokens (SAAP needs keys beyond its long-range distance); a third
    of the rows carry no "task"."""
    out = synthetic_rows(["niah_single", "kv_retrieval"], 600, 10, seed=21)
    for i, r in enumerate(out):
        if i % 3 == 0:
            r.pop("task")
    return out


@pytest.fixture(scope="module")
def data_args(rows, tmp_path_factory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("files")
    write_jsonl(root / "rows.jsonl", rows)
    args = {"jsonl": ["data=jsonl", f"data.path={root / 'rows.jsonl'}"]}
    try:
        import datasets
    except ImportError:
        return args
    hf = [{"question": r["prompt"], "answer": r["answer"]} for r in rows]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(hf[:14]),
                          "test": datasets.Dataset.from_list(hf[14:])}).save_to_disk(str(root / "saved"))
    args["hf"] = ["data=hf", f"data.name={root / 'saved'}", "data.config=null", "data.answer_regex=null",
                  "data.task=niah"]
    return args


@pytest.mark.parametrize("source", ["jsonl", "hf"])
@pytest.mark.parametrize("method", list(METHODS))
def test_method_calibrates_on_file_data(method, source, rows, data_args, tmp_path: Path):
    if source not in data_args:
        pytest.skip("needs `datasets`")
    result = run_recipe(tmp_path, [*METHODS[method], *COMMON, *data_args[source]])
    from runtime_kernels.artifact import load_artifact

    data = load_artifact(result["artifact_dir"], method=method).manifest.data
    assert data.source == source
    if source == "jsonl":
        calibration_tasks = {r.get("task", "jsonl") for r in rows if not held_out(r["prompt"])}
        assert set(data.tasks) <= calibration_tasks
    else:
        assert data.tasks == ["niah"]
