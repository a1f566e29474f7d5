"""Small builders shared by the spine tests (an artifact that needs no model)."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime_kernels.manifest import DataRecord, Manifest, ModelRecord, ProducerRecord, write_artifact

TINY_FACTS = dict(name="tiny", num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                  rope_scaling=None, hidden_size=256, max_position_embeddings=10240, family="llama",
                  model_hash="ab" * 32)


def make_manifest(method: str = "sale", **model_overrides) -> Manifest:
    return Manifest(
        method=method, abi_version=1, model=ModelRecord(**{**TINY_FACTS, **model_overrides}),
        hyperparameters={"theta": 0.05, "tau0": 0.008},
        data=DataRecord(source="synthetic", seed=1234, count=5, lengths=[1024], content_hash="cd" * 32,
                        tasks=["niah_single"]),
        producer=ProducerRecord(package="calib", version="0.1.0", git_sha=None, created_at="2026-11-21T00:00:00Z",
                                config={"method": {"name": method}}),
        metrics={"sparsity": 0.5},
        payload={"note": "test"},
    )


def make_tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "thresholds": {"tau": torch.rand(4, 8, generator=g), "layers": torch.arange(4, dtype=torch.int32)},
        "extra": {"weights": torch.randn(3, 5, generator=g).to(torch.bfloat16)},
    }


def write_test_artifact(path: Path, method: str = "sale", **model_overrides) -> Path:
    return write_artifact(path, make_manifest(method, **model_overrides), make_tensors())
