"""A tiny Llama written as a GGUF file the way llama.cpp's converter writes one (no download, no wheel).

The weights are a random transformers Llama's; q and k rows are permuted as llama.cpp's
``convert_hf_to_gguf.py`` does (its rotary layout interleaves the two halves of each head), so a
correct GGUF reader must undo exactly that to give back the original model. The tokenizer is byte-level
BPE ("gpt2" in GGUF terms): the 256 byte symbols, two merges and the ChatML control tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY_GGUF_ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
                  "intermediate_size": 96, "max_position_embeddings": 512, "rope_theta": 100000.0,
                  "rope_scaling": None}
MERGES = ["Ġ t", "h e"]
SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def vocabulary() -> list[str]:
    return byte_symbols() + [m.replace(" ", "") for m in MERGES] + SPECIAL


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (``convert_hf_to_gguf.LlamaModel.permute``)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tensors(model: torch.nn.Module) -> dict[str, np.ndarray]:
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{gguf_name}.weight"] = np.ascontiguousarray(w)
    return out


def write_tiny_gguf(path: Path, seed: int = 0) -> torch.nn.Module:
    """Write the GGUF file to ``path``; returns the transformers model it encodes."""
    import gguf

    from calib.models import random_model

    vocab = vocabulary()
    model = random_model("llama", {**TINY_GGUF_ARCH, "vocab_size": len(vocab)}, seed=seed)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(TINY_GGUF_ARCH["rope_theta"]))
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([1] * (len(vocab) - len(SPECIAL)) + [3] * len(SPECIAL))  # 1 normal, 3 control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(vocab.index("<|im_start|>"))
    w.add_eos_token_id(vocab.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in _tensors(model).items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def tiny_gguf_model_cfg(gguf_path: Path, name: str = "tinygguf") -> dict:
    """A model config shaped like conf/model/smollm2.yaml, pointing ``gguf.path`` at the file."""
    arch = {k: v for k, v in TINY_GGUF_ARCH.items() if k != "intermediate_size"}
    return {"name": name, "family": "llama", "path": None, "revision": None, "dtype": "auto",
            "attn_implementation": "sdpa", "gguf": {"distribution": None, "file": None, "path": str(gguf_path)},
            "arch": arch}
