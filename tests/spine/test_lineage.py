"""What the MLflow UI is told about an experiment and a run: its kind tag, dataset inputs, run names."""

from __future__ import annotations

import json

import pytest

from calib import registry, tracking
from runtime_kernels.manifest import DataRecord

RECORD = DataRecord(source="synthetic", seed=1234, count=6, lengths=[512, 1024], content_hash="0123456789ab" + "f" * 52,
                    tasks=["kv_retrieval", "niah_single"], details={"prompt_ids": list(range(6))})


def test_new_experiment_is_tagged_model_development(calib_home):
    import mlflow

    exp_id = tracking.configure(tracking.resolve_target({"experiment": "fresh"}))
    tags = mlflow.MlflowClient().get_experiment(exp_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.parametrize("existing", [None, "genai_development"])
def test_existing_experiment_gets_the_kind_on_next_use(calib_home, existing):
    """An experiment made before calib tagged its kind (or tagged otherwise) is fixed by the next command."""
    import mlflow

    target = tracking.resolve_target({"experiment": "old"})
    mlflow.set_tracking_uri(target.tracking_uri)
    client = mlflow.MlflowClient()
    exp_id = client.create_experiment("old", artifact_location=target.artifact_root)
    if existing:
        client.set_experiment_tag(exp_id, "mlflow.experimentKind", existing)
    assert tracking.configure(target) == exp_id
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_calibration_prompts_are_a_dataset_input(calib_home):
    import mlflow

    target = tracking.resolve_target({"experiment": "test"})
    with tracking.start_run(target, "r") as run:
        tracking.log_prompt_set(RECORD, {"source": "synthetic", "tasks": ["ignored"], "seed": 1}, "calibration")
    (inp,) = mlflow.MlflowClient().get_run(run.info.run_id).inputs.dataset_inputs
    assert {t.key: t.value for t in inp.tags} == {"mlflow.data.context": "calibration"}
    ds = inp.dataset
    assert ds.name == "synthetic seed=1234" and ds.digest == "0123456789ab"
    assert ds.source_type == "code"
    assert json.loads(ds.source)["tags"] == {"source": "synthetic", "tasks": '["kv_retrieval", "niah_single"]',
                                             "lengths": "[512, 1024]", "seed": "1234"}
    assert json.loads(ds.profile) == {"content_hash": RECORD.content_hash, "num_prompts": 6,
                                      "tasks": ["kv_retrieval", "niah_single"], "lengths": [512, 1024], "seed": 1234}


def test_eval_prompts_are_hashed_like_the_manifest(calib_home):
    """The evaluation dataset's digest is the same content hash a manifest would record for those prompts."""
    import mlflow

    from calib.data import Prompt, dataset_hash

    prompts = [Prompt(prompt_id=str(i), task="niah_single", length=512, text=f"q{i}", answer=f"a{i}", input_ids=[1, 2])
               for i in range(3)]
    target = tracking.resolve_target({"experiment": "test"})
    with tracking.start_run(target, "e") as run:
        tracking.log_eval_prompts({"source": "synthetic"}, prompts, seed=99)
    (inp,) = mlflow.MlflowClient().get_run(run.info.run_id).inputs.dataset_inputs
    assert {t.key: t.value for t in inp.tags} == {"mlflow.data.context": "evaluation"}
    assert inp.dataset.name == "synthetic seed=99"
    assert inp.dataset.digest == dataset_hash(prompts)[:12]
    assert json.loads(inp.dataset.profile)["content_hash"] == dataset_hash(prompts)


def test_file_and_hub_sources_name_their_split(tmp_path):
    rows = tmp_path / "rows.jsonl"
    jsonl = {"source": "jsonl", "path": str(rows), "eval_path": None}
    assert tracking.describe_data(jsonl, "evaluation", RECORD) == (
        "rows.jsonl (evaluation hash split)", {"source": "jsonl", "path": str(rows)})
    held = {**jsonl, "eval_path": str(tmp_path / "held.jsonl")}
    assert tracking.describe_data(held, "evaluation", RECORD)[0] == "held.jsonl"
    assert tracking.describe_data(held, "calibration", RECORD)[0] == "rows.jsonl"
    hub = {"source": "hf", "name": "openai/gsm8k", "config": "main", "revision": None, "split": "train",
           "eval_split": "test"}
    name, fields = tracking.describe_data(hub, "evaluation", RECORD)
    assert name == "openai/gsm8k:test" and fields["split"] == "test"
    assert tracking.describe_data({**hub, "eval_split": None}, "evaluation", RECORD)[0] == \
        "openai/gsm8k:train (evaluation hash split)"
    assert tracking._dataset_source(fields)._get_source_type() == "hugging_face"
    local = tracking._dataset_source({"source": "jsonl", "path": str(rows)})
    assert local._get_source_type() == "local" and json.loads(local.to_json()) == {"uri": rows.as_uri()}


@pytest.mark.parametrize("artifact, name", [
    ("models:/saap-tiny@candidate", "eval saap-tiny@candidate"),
    ("models:/saap-tiny/3", "eval saap-tiny-v3"),
    ("/some/artifact/dir", "eval saap-tiny"),
    (None, "eval dense-tiny"),
])
def test_eval_run_names_say_what_ran(artifact, name):
    method = "dense" if artifact is None else "saap"
    assert registry.eval_run_name(artifact, method, "tiny") == name
