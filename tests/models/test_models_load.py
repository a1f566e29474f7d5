"""load_model: local dirs, the HF cache (offline), arch checks, weight hashes, one-line errors."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from calib import file_hashes, models
from calib.errors import UserError
from calib.models import arch_mismatches, facts_from_config, load_model, random_config, weights_hash

from tests.models.helpers import LLAMA_ARCH, QWEN2_ARCH, model_cfg

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"


def test_llama_local_dir_loads_with_facts(llama_dir, private_home):
    loaded = load_model(model_cfg(llama_dir, "llama", LLAMA_ARCH), device="cpu")
    f = loaded.facts
    assert (f.num_layers, f.num_heads, f.num_kv_heads, f.head_dim, f.hidden_size) == (2, 4, 1, 16, 64)
    assert f.rope_theta == 500000.0 and f.rope_scaling["rope_type"] == "llama3" and f.rope_scaling["factor"] == 8.0
    assert f.max_position_embeddings == 16384 and f.family == "llama"
    assert next(loaded.model.parameters()).dtype == torch.float32  # auto on CPU
    assert loaded.device == torch.device("cpu") and not loaded.model.training
    assert loaded.tokenizer("w5 w6 w7")["input_ids"] == [5, 6, 7]
    assert set(f.to_dict()) >= {"name", "family", "revision", "model_hash", "rope_scaling"}


def test_qwen2_family_by_config_alone(qwen2_dir, private_home):
    loaded = load_model(model_cfg(qwen2_dir, "qwen2", QWEN2_ARCH), device="cpu", dtype="bfloat16")
    assert type(loaded.model).__name__ == "Qwen2ForCausalLM"
    assert loaded.facts.head_dim == 16 and loaded.facts.rope_scaling is None
    assert loaded.model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's qkv bias
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_model_hash_is_sha256_of_weight_files(llama_dir, private_home):
    digest = hashlib.sha256((llama_dir / "model.safetensors").read_bytes()).hexdigest()
    expected = "sha256:" + hashlib.sha256(f"model.safetensors {digest}".encode()).hexdigest()
    assert weights_hash(llama_dir) == expected
    assert load_model(model_cfg(llama_dir, "llama", LLAMA_ARCH), device="cpu").facts.model_hash == expected


def test_model_hash_sidecar_avoids_rehashing(llama_dir, private_home, monkeypatch, tmp_path):
    copy = Path(shutil.copytree(llama_dir, tmp_path / "copy"))
    first = weights_hash(copy)
    assert (private_home / "artifacts" / "cache" / "model_hashes.json").is_file()

    def boom(path):
        raise AssertionError("weights were hashed again")

    monkeypatch.setattr(file_hashes, "_file_sha256", boom)
    assert weights_hash(copy) == first  # size + mtime unchanged: served from the sidecar
    os.utime(copy / "model.safetensors", ns=(1, 1))  # a touched file is hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        weights_hash(copy)


def test_missing_local_path_is_one_line_user_error(private_home, tmp_path):
    missing = tmp_path / "nowhere" / "llama"
    with pytest.raises(UserError) as err:
        load_model(model_cfg(missing, "llama", LLAMA_ARCH), device="cpu")
    msg = str(err.value)
    assert "\n" not in msg and str(missing) in msg and "model.path=" in msg


def test_hf_id_not_cached_names_cache_and_env_var(private_home):
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create(model_cfg("x", "llama", LLAMA_ARCH, name="llama31"))
    cfg.path = "${oc.env:CALIB_TEST_UNSET_PATH,meta-llama/Llama-3.1-8B-Instruct}"
    with pytest.raises(UserError) as err:
        load_model(cfg, device="cpu")
    msg = str(err.value)
    assert "\n" not in msg
    assert "meta-llama/Llama-3.1-8B-Instruct" in msg and str(private_home.parent / "hf") in msg
    assert "model.path=" in msg and "CALIB_TEST_UNSET_PATH" in msg


def _fake_hf_cache(src: Path, cache: Path, repo: str, commit: str) -> None:
    """The hub cache layout: blobs named by content hash, snapshot symlinks, refs/main."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob)


def test_hf_cache_offline_gives_commit_and_same_hash(llama_dir, private_home, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    _fake_hf_cache(llama_dir, private_home.parent / "hf", "org/rand-llama", commit)
    monkeypatch.setattr(file_hashes, "_file_sha256", lambda p: pytest.fail("cache blobs are named by their sha256"))
    loaded = load_model(model_cfg("org/rand-llama", "llama", LLAMA_ARCH), device="cpu")
    assert loaded.facts.revision == commit
    digest = hashlib.sha256((llama_dir / "model.safetensors").read_bytes()).hexdigest()
    assert loaded.facts.model_hash == "sha256:" + hashlib.sha256(f"model.safetensors {digest}".encode()).hexdigest()


def test_arch_mismatch_is_user_error(llama_dir, private_home):
    cfg = model_cfg(llama_dir, "llama", {**LLAMA_ARCH, "num_layers": 32, "rope_theta": 10000.0})
    with pytest.raises(UserError) as err:
        load_model(cfg, device="cpu")
    msg = str(err.value)
    assert "\n" not in msg and "num_layers: 2 in the checkpoint, 32 in the YAML" in msg and "rope_theta" in msg


def test_rope_scaling_mismatch_detected(llama_dir, private_home):
    cfg = model_cfg(llama_dir, "llama", {**LLAMA_ARCH, "rope_scaling": None})
    with pytest.raises(UserError, match="rope_scaling"):
        load_model(cfg, device="cpu")


def test_local_dir_without_config_is_user_error(private_home, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_model(model_cfg(tmp_path / "empty", "llama", LLAMA_ARCH), device="cpu")


@pytest.mark.parametrize("yaml_file", sorted(CONF_MODEL.glob("*.yaml")), ids=lambda p: p.stem)
def test_model_yaml_arch_roundtrips_through_a_transformers_config(yaml_file):
    """Each conf/model file's arch builds a config of its family whose facts match the arch exactly."""
    spec = yaml.safe_load(yaml_file.read_text())
    arch = spec["arch"]
    config = random_config(spec["family"], arch)
    facts = facts_from_config(config, name=spec["name"], family=spec["family"])
    assert arch_mismatches(facts, arch) == []
    assert facts.num_heads % facts.num_kv_heads == 0


def test_family_mismatch_is_user_error(llama_dir, private_home):
    with pytest.raises(UserError, match="family: llama in the checkpoint, qwen2 in the YAML"):
        load_model(model_cfg(llama_dir, "qwen2", LLAMA_ARCH), device="cpu")


def test_checkpoint_without_tokenizer_is_user_error(llama_dir, private_home, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, bare / name)
    with pytest.raises(UserError) as err:
        load_model(model_cfg(bare, "llama", LLAMA_ARCH), device="cpu")
    assert "\n" not in str(err.value) and "cannot load" in str(err.value)
