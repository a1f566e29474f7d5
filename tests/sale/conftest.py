"""A small random Llama with the tiny tokenizer, and a SALE config shaped for it (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SALE_ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 1, "head_dim": 16, "hidden_size": 64,
             "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}
HEAD_GAINS = (10.0, 40.0, 80.0, 160.0)  # query head h = HEAD_GAINS[h] x the key projection
V_GAIN = 30.0  # Err in units a theta of 1e-3..1e-1 resolves


def structured_llama(seed: int = 7) -> torch.nn.Module:
    """A random Llama whose heads are local with different sharpness, so SALE has something to find.

    Random init gives near-uniform attention (every block's relative score clears tau0, sparsity 0).
    Here every token embedding gets one shared offset, so keys are nearly position-only after RoPE;
    query head ``h`` is ``HEAD_GAINS[h]`` times the key projection, so its scores peak at distance 0
    with a sharpness that grows with the gain: flat heads stay dense-ish, sharp heads are sparse.
    """
    from calib.data.tokenizer import build_tiny_backend
    from calib.models import random_model

    model = random_model("llama", {**SALE_ARCH, "vocab_size": build_tiny_backend().get_vocab_size()}, seed=seed)
    d = SALE_ARCH["head_dim"]
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        model.model.embed_tokens.weight += 0.3 * torch.randn(SALE_ARCH["hidden_size"], generator=gen) / 8
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.v_proj.weight.mul_(V_GAIN)
            for h, gain in enumerate(HEAD_GAINS):
                attn.q_proj.weight[h * d:(h + 1) * d] = gain * attn.k_proj.weight
    return model


@pytest.fixture(scope="session")
def sale_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, 4 query heads / 1 KV head, head_dim 16 (:func:`structured_llama`) + the tiny tokenizer."""
    from calib.data.tokenizer import save_tiny_tokenizer

    out = tmp_path_factory.mktemp("sale_llama")
    structured_llama().save_pretrained(out)
    save_tiny_tokenizer(out)
    return out


def sale_overrides(model_dir: Path, theta: float, *extra: str) -> list[str]:
    """Hydra overrides for a fast SALE run on the small model (blocks 32x16, sink 16, local 64)."""
    arch = [f"model.arch.{k}={'null' if v is None else v}" for k, v in SALE_ARCH.items()]
    return ["+method=sale", f"model.path={model_dir}", "model.name=rand-sale", *arch, "model.lengths=[384,512]",
            "device=cpu", f"method.theta={theta}", "method.block_q=32", "method.block_k=16", "method.sink=16",
            "method.local=64", "method.num_samples=3", "data.tasks=[niah_single,kv_retrieval]",
            "method.sparsity_prompts=1", "method.ablation_prompts=1", "eval.max_new_tokens=2", "eval.bootstrap=200",
            *extra]
