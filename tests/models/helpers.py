"""Random small model configs shared by tests/models and tests/collect (no download)."""

from __future__ import annotations

from pathlib import Path

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
LLAMA_ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 1, "head_dim": 16, "hidden_size": 64,
              "max_position_embeddings": 16384, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING,
              "vocab_size": 128}
QWEN2_ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
              "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rope_scaling": None, "vocab_size": 128}


def model_cfg(path: Path | str, family: str, arch: dict, name: str = "rand") -> dict:
    """A plain-dict model config shaped like conf/model/*.yaml."""
    yaml_arch = {k: v for k, v in arch.items() if k not in ("vocab_size", "intermediate_size")}
    return {"name": name, "family": family, "path": str(path), "revision": None, "dtype": "auto",
            "attn_implementation": "sdpa", "arch": yaml_arch}
