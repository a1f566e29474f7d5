"""SANTA's reward answers questions in batches: the same correctness as one question at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calib.errors import UserError

from calib.data.tokenizer import build_tiny_backend, save_tiny_tokenizer
from calib.models import random_model

ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}


def _random_model_and_prompts(tmp_path):
    from omegaconf import OmegaConf

    from calib.data import Prompt
    from calib.models import load_model

    random_model("llama", {**ARCH, "vocab_size": build_tiny_backend().get_vocab_size()}, seed=0).save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    loaded = load_model(OmegaConf.create({"name": "rand", "path": str(tmp_path)}), device="cpu")
    loaded.model.double()
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"q{i}", "t", n, "q", "7", torch.randint(5, 3000, (n,), generator=gen).tolist(),
                      scoring="contains" if i % 3 == 0 else "exact_match")
               for i, n in enumerate([48, 48, 64, 48, 64, 48, 64, 48])]
    return loaded, prompts


def test_batched_answers_equal_one_at_a_time(tmp_path):
    """Questions of two lengths and both scoring rules, batched by ``batch_tokens`` with one sampling seed
    per row: each question's greedy reply (and so its correctness) equals the reply it gets alone."""
    import calib.santa.reward as reward
    from calib.generation import equal_length_batches

    loaded, prompts = _random_model_and_prompts(tmp_path)
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


def test_static_loop_answers_what_the_eager_loop_answers(tmp_path):
    """The serving loop (preallocated cache; on CPU without graphs) samples the same keys as the eager
    DynamicCache loop, so batched questions under per-row seeds get the same replies through either,
    although its batches mix prompt lengths (each row decoded at its own position)."""
    import calib.santa.reward as reward
    from calib.generation import equal_length_batches

    loaded, prompts = _random_model_and_prompts(tmp_path)
    settings = reward.RewardSettings("sys", "flash", 16, ("prefill", "decode"), questions=2, max_new_tokens=None,
                                     cap_new_tokens=6, batch_tokens=160, loop="static")
    assert settings.loop_on(torch.device("cpu")) == "static"
    max_new = [6 if p.scoring == "contains" else 3 for p in prompts]
    seeds = reward.question_seeds(11, len(prompts))
    replies: dict[str, list[list[int]]] = {}
    real_decode = loaded.tokenizer.decode
    correct = {}
    for loop in ("static", "eager"):
        loaded.tokenizer.decode = lambda ids, _loop=loop, **kw: (replies.setdefault(_loop, []).append(list(ids)),
                                                               real_decode(ids, **kw))[1]
        correct[loop] = reward.answer_correct(loaded, prompts, max_new, reward.make_runtime([2, 3], settings),
                                              seeds=seeds, batch_tokens=160, loop=loop)
    assert np.array_equal(correct["static"], correct["eager"])
    keys = [(p.scoring, n) for p, n in zip(prompts, max_new)]
    lengths = [len(p.input_ids) for p in prompts]
    per_question = {}
    for loop in ("static", "eager"):  # replies come in batch order: the static loop's batches mix lengths
        batches = equal_length_batches(lengths, 160, keys, ragged=loop == "static")
        assert (max(len({lengths[i] for i in b}) for b in batches) > 1) == (loop == "static")
        order = [i for b in batches for i in b]
        per_question[loop] = [replies[loop][order.index(i)] for i in range(len(prompts))]
    assert per_question["static"] == per_question["eager"]
    # a different seed draws other samples and changes some reply: the runtime really sampled
    other = reward.question_seeds(12, len(prompts))
    replies["other"] = []
    loaded.tokenizer.decode = lambda ids, **kw: (replies["other"].append(list(ids)), real_decode(ids, **kw))[1]
    reward.answer_correct(loaded, prompts, max_new, reward.make_runtime([2, 3], settings), seeds=other,
                          batch_tokens=160, loop="static")
    assert replies["other"] != replies["static"]


def test_reward_loop_setting():
    import calib.santa.reward as reward

    def settings(loop):
        return reward.RewardSettings("sys", "flash", 16, ("decode",), questions=2, max_new_tokens=None,
                                     cap_new_tokens=6, loop=loop)
    assert settings("auto").loop_on(torch.device("cpu")) == "eager"
    assert settings("auto").loop_on(torch.device("cuda")) == "static"
    assert settings("eager").loop_on(torch.device("cuda")) == "eager"
    from calib.config import compose

    assert reward.RewardSettings.from_cfg(compose(["+method=santa"])).loop == "auto"
    with pytest.raises(UserError, match="method.reward.loop must be one of auto, eager, static"):
        reward.RewardSettings.from_cfg(compose(["+method=santa", "method.reward.loop=graph"]))
