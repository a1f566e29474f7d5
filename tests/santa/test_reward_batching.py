"""SANTA's reward answers questions in batches: the same correctness as one question at a time."""

from __future__ import annotations

import numpy as np
import torch

from calib.data.tokenizer import build_tiny_backend, save_tiny_tokenizer
from calib.models import random_model

ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}


def test_batched_answers_equal_one_at_a_time(tmp_path):
    """Questions of two lengths and both scoring rules, batched by ``batch_tokens`` with one sampling seed
    per row: each question's greedy reply (and so its correctness) equals the reply it gets alone."""
    from omegaconf import OmegaConf

    import calib.santa.reward as reward
    from calib.data import Prompt
    from calib.generation import equal_length_batches
    from calib.models import load_model

    random_model("llama", {**ARCH, "vocab_size": build_tiny_backend().get_vocab_size()}, seed=0).save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    loaded = load_model(OmegaConf.create({"name": "rand", "path": str(tmp_path)}), device="cpu")
    loaded.model.double()
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"q{i}", "t", n, "q", "7", torch.randint(5, 3000, (n,), generator=gen).tolist(),
                      scoring="contains" if i % 3 == 0 else "exact_match")
               for i, n in enumerate([48, 48, 64, 48, 64, 48, 64, 48])]
    replies: dict[int, list[tuple[str, int]]] = {}
    real_decode = loaded.tokenizer.decode

    def remember(batch_tokens):
        def decode(ids, **kw):
            text = real_decode(ids, **kw)
            replies.setdefault(batch_tokens, []).append((text, len(ids)))
            return text
        return decode

    settings = reward.RewardSettings("sys", "flash", 16, ("prefill", "decode"), questions=2, max_new_tokens=None,
                                     cap_new_tokens=6)
    max_new = [6 if p.scoring == "contains" else 3 for p in prompts]
    seeds = reward.question_seeds(5, len(prompts))
    out = {}
    for batch_tokens in (0, 160):
        loaded.tokenizer.decode = remember(batch_tokens)
        out[batch_tokens] = reward.answer_correct(loaded, prompts, max_new, reward.make_runtime([1, 2], settings),
                                                  seeds=seeds, batch_tokens=batch_tokens)
    assert out[0].dtype == bool and np.array_equal(out[0], out[160])
    # the replies themselves, each list in the order its batches ran (grouped by length, rule and budget)
    keys = [(p.scoring, n) for p, n in zip(prompts, max_new)]
    in_order = {}
    for batch_tokens in (0, 160):
        batches = equal_length_batches([len(p.input_ids) for p in prompts], batch_tokens, keys)
        order = [i for b in batches for i in b]
        in_order[batch_tokens] = [replies[batch_tokens][order.index(i)] for i in range(len(prompts))]
        assert max(len(b) for b in batches) == (1 if batch_tokens == 0 else 3)  # 160 // 48 rows at most
    assert in_order[0] == in_order[160]
    assert [n for _, n in in_order[0]] == max_new  # this random model never stops early here
