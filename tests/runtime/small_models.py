"""The small random Llama the runtime hf tests plug methods into (each test shapes its attention)."""

from __future__ import annotations

import torch


def small_llama(seed: int = 0) -> torch.nn.Module:
    """2 layers, hidden 64, 4 query / 2 KV heads of dim 16, vocab 300, SDPA, eval mode, no grads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)
