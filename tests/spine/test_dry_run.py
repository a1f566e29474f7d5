"""``model.init=random``: a dry run built from the YAML alone, marked in the manifest and MLflow, never champion."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from calib import registry, tracking
from calib.errors import UserError
from calib.paths import project_root
from runtime_kernels.manifest import ModelRecord, read_manifest
from tests.recipe_support import run_recipe
from tests.spine.helpers import write_test_artifact
from tests.subprocess_env import python_path

CONF_MODEL = project_root() / "conf" / "model"


def _yaml(name: str) -> dict:
    return yaml.safe_load((CONF_MODEL / f"{name}.yaml").read_text())


def _no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way of reading weights (locating a checkpoint, safetensors, from_pretrained) fail loudly."""
    import safetensors.torch
    import transformers

    import calib.models

    def refuse(*_a, **_k):
        raise AssertionError("init=random read weights")

    monkeypatch.setattr(calib.models, "locate_model", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_llama31_random_init_builds_the_8b_shapes_on_meta(monkeypatch):
    """Every projection of Llama-3.1-8B (config.json: 4096 hidden, 32/8 heads x 128, 14336 MLP, 128256 vocab)."""
    from calib.models import load_model

    _no_weight_reads(monkeypatch)
    loaded = load_model({**_yaml("llama31"), "path": "/nonexistent", "init": "random"}, device="meta")
    c, f = loaded.model.config, loaded.facts
    assert (f.num_layers, f.num_heads, f.num_kv_heads, f.head_dim, f.hidden_size) == (32, 32, 8, 128, 4096)
    assert f.rope_theta == 500000.0 and f.rope_scaling["rope_type"] == "llama3" and f.rope_scaling["factor"] == 8.0
    assert f.max_position_embeddings == 131072 and f.dry_run is True and f.model_hash.startswith("random:sha256:")
    assert c.vocab_size == 128256 and c.intermediate_size == 14336 and c.tie_word_embeddings is False
    layer = loaded.model.model.layers[31]
    assert layer.self_attn.q_proj.weight.shape == (32 * 128, 4096)
    assert layer.self_attn.k_proj.weight.shape == (8 * 128, 4096)
    assert layer.self_attn.o_proj.weight.shape == (4096, 32 * 128)
    assert layer.mlp.gate_proj.weight.shape == (14336, 4096)
    assert loaded.model.lm_head.weight.shape == (128256, 4096)
    # 8.03e9 parameters: the published size of Llama-3.1-8B
    n = sum(p.numel() for p in loaded.model.parameters())
    assert n == 8_030_261_248
    assert len(loaded.tokenizer) <= c.vocab_size
    # the tokenizer takes prompts as long as the architecture's context (the tiny one's own file says 10240)
    assert loaded.tokenizer.model_max_length == 131072


def test_composed_llama31_with_a_layer_override_builds_that_model(monkeypatch):
    """``model=llama31 model.init=random model.arch.num_layers=2`` through Hydra: the env-var path is never used."""
    from calib.config import compose
    from calib.models import load_model

    _no_weight_reads(monkeypatch)
    cfg = compose(["+method=sale", "model=llama31", "model.init=random", "model.arch.num_layers=2"])
    loaded = load_model(cfg.model, device="meta")
    assert loaded.facts.num_layers == 2 and len(loaded.model.model.layers) == 2
    assert loaded.model.model.layers[1].self_attn.k_proj.weight.shape == (1024, 4096)
    assert loaded.facts.name == "llama31" and loaded.facts.family == "llama"


def test_random_init_is_seeded_and_never_reads_weights(monkeypatch):
    from calib.models import load_model

    _no_weight_reads(monkeypatch)
    spec = {**_yaml("tiny"), "path": "/nonexistent", "init": "random"}
    a, b = load_model(spec, device="cpu"), load_model(spec, device="cpu")
    assert a.model.dtype == torch.float32 and a.facts.model_hash == b.facts.model_hash
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    ids = a.tokenizer("the key is 42", return_tensors="pt").input_ids
    assert a.model(ids).logits.shape == (1, ids.shape[1], 3296)


def test_random_init_names_missing_arch_keys():
    from calib.models import load_model

    spec = _yaml("tiny")
    spec["arch"] = {k: v for k, v in spec["arch"].items() if k != "intermediate_size"}
    with pytest.raises(UserError, match="lacks intermediate_size"):
        load_model({**spec, "init": "random"}, device="cpu")
    with pytest.raises(UserError, match="model.init='zeros' is not one of pretrained, random"):
        load_model({**spec, "init": "zeros"}, device="cpu")


def test_old_manifest_without_dry_run_loads_as_real():
    record = {"name": "tiny", "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "rope_theta": 1e4}
    assert ModelRecord(**record).dry_run is False


@pytest.fixture(scope="module")
def dry_run_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SALE (the fastest method) on a random tiny-architecture model, through ``calib.run.run``."""
    home = tmp_path_factory.mktemp("home")
    result = run_recipe(home, [
        "+method=sale", "model=tiny", "model.init=random", "model.path=/nonexistent", "device=cpu",
        "model.lengths=[256,320]", "method.block_q=32", "method.block_k=16", "method.sink=16", "method.local=64",
        "method.num_samples=1", "data.tasks=[niah_single]", "method.sparsity_prompts=1",
        "method.ablation_prompts=1", "eval.max_new_tokens=2", "eval.bootstrap=50"])
    return {**result, "home": home}


def test_dry_run_end_to_end_is_marked(dry_run_result):
    import mlflow

    man = read_manifest(dry_run_result["artifact_dir"])
    assert man.model.dry_run is True and man.model.model_hash.startswith("random:sha256:")
    assert man.model.num_layers == 4 and man.model.num_heads == 8
    assert dry_run_result["metrics"]["peak_host_rss_gb"] > 0.1
    assert any(k.startswith("time_") for k in dry_run_result["metrics"])
    home = dry_run_result["home"]
    mlflow.set_tracking_uri(f"sqlite:///{home / 'artifacts' / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    assert client.get_run(dry_run_result["run_id"]).data.tags[tracking.DRY_RUN_TAG] == "true"
    mv = client.get_model_version("sale-tiny", "1")
    assert mv.tags[tracking.DRY_RUN_TAG] == "true"


def _publish(tmp_path: Path, name: str, **model_overrides) -> str:
    target = tracking.resolve_target({"experiment": "test"})
    with tracking.start_run(target, "t") as run:
        pub = registry.publish(write_test_artifact(tmp_path / name, **model_overrides), run.info.run_id)
    return pub.version


def test_promote_refuses_champion_for_a_dry_run(calib_home, tmp_path):
    dry = _publish(tmp_path, "dry", dry_run=True)
    real = _publish(tmp_path, "real")
    with pytest.raises(UserError, match="is a dry run"):
        registry.promote("sale-tiny", dry)
    assert registry.promote("sale-tiny", real) == "models:/sale-tiny@champion"
    assert registry.promote("sale-tiny", dry, "scale-test") == "models:/sale-tiny@scale-test"


def test_cli_promote_dry_run(calib_home, tmp_path):
    _publish(tmp_path, "dry", dry_run=True)
    env = {"CALIB_HOME": str(calib_home), "PATH": "/usr/bin:/bin", "PYTHONPATH": python_path()}

    def promote(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "calib", "promote", "sale-tiny", "1", *words],
                              capture_output=True, text=True, env=env, timeout=120)

    refused = promote()
    assert refused.returncode == 2 and refused.stdout == ""
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "dry run" in lines[0]
    ok = promote("alias=scale-test")
    assert ok.returncode == 0 and "models:/sale-tiny@scale-test" in ok.stdout
    assert sum("dry run (random weights)" in ln for ln in ok.stderr.splitlines()) == 1


def test_apply_warns_once_for_a_dry_run_artifact(dry_run_result, caplog):
    from calib.models import load_model
    from runtime_kernels import hf

    spec = {**_yaml("tiny"), "init": "random"}
    model = load_model(spec, device="cpu").model
    caplog.set_level(logging.WARNING, logger="runtime_kernels.hf")
    for _ in range(2):
        hf.apply(model, dry_run_result["artifact_dir"])
        hf.remove(model)
    warned = [r for r in caplog.records if "calibrated on random weights: for measuring cost only" in r.getMessage()]
    assert len(warned) == 1
    assert json.loads(Path(dry_run_result["artifact_dir"], "manifest.json").read_text())["model"]["dry_run"] is True
