"""Greedy generation: the left-padded batch gives each prompt's one-at-a-time answer; stop tokens."""

from __future__ import annotations

import pytest
import torch

from calib.generation import (batched_greedy_generate, equal_length_batches, equal_length_greedy_generate,
                              greedy_generate, left_padded, static_greedy_generate, stop_token_ids)
from calib.models import random_model
from tests.models.helpers import QWEN2_ARCH


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_model("qwen2", QWEN2_ARCH, seed=11)


def test_left_padding_right_aligns_each_prompt():
    ids, mask = left_padded([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batch_equals_one_prompt_at_a_time(model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (37, 30, 37, 12)]
    free = [greedy_generate(model, p, 12, set()) for p in prompts]
    stops = {free[0][4]}  # ends the first answer after at most 4 tokens
    single = [greedy_generate(model, p, 12, stops) for p in prompts]
    batched = batched_greedy_generate(model, prompts, 12, stops, pad_id=0)
    assert batched == single
    assert len(single[0]) <= 4 and len({len(s) for s in single}) > 1  # the prompts stopped at different steps


def test_a_batch_where_every_prompt_stops_at_once(model):
    prompt = list(range(3, 20))
    first = greedy_generate(model, prompt, 1, set())[0]
    assert batched_greedy_generate(model, [prompt, prompt], 8, {first}, pad_id=0) == [[], []]


class _Tok:
    eos_token_id, unk_token_id = 2, 0
    table = {"\n": 10, "Ċ": 11, "<|im_end|>": 2, "<|eot_id|>": 0}

    def convert_tokens_to_ids(self, text: str) -> int:
        return self.table.get(text, 0)


def test_stop_tokens_keep_the_newline_only_for_exact_match():
    assert stop_token_ids(_Tok()) == {2, 10, 11}
    assert stop_token_ids(_Tok(), newline=False) == {2}


def test_equal_length_batch_equals_one_prompt_at_a_time(model):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (29,), generator=gen).tolist() for _ in range(5)]
    free = [greedy_generate(model, p, 10, set()) for p in prompts]
    stops = {free[1][3]}  # ends the second answer after at most 3 tokens
    single = [greedy_generate(model, p, 10, stops) for p in prompts]
    assert equal_length_greedy_generate(model, prompts, 10, stops) == single
    assert len({len(s) for s in single}) > 1  # the prompts stopped at different steps
    with pytest.raises(ValueError, match="different lengths"):
        equal_length_greedy_generate(model, [prompts[0], prompts[1][:-1]], 4, stops)


def test_equal_length_batches_group_by_length_and_key_within_the_token_budget():
    lengths = [100, 50, 100, 100, 50, 100]
    keys = ["a", "a", "a", "b", "a", "a"]
    assert equal_length_batches(lengths, 200, keys) == [[0, 2], [5], [1, 4], [3]]
    assert equal_length_batches(lengths, 0, keys) == [[i] for i in (0, 2, 5, 1, 4, 3)]
    assert equal_length_batches([300, 300], 100) == [[0], [1]]  # a prompt longer than the budget runs alone
    assert sorted(i for b in equal_length_batches(lengths, 10_000) for i in b) == list(range(6))


def test_static_loop_equals_the_eager_loop_and_cuts_at_stops(model):
    """The serving loop (preallocated cache; no graphs on CPU) answers equal-length prompts as the eager
    loop does, each cut before its first stop token."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (33,), generator=gen).tolist() for _ in range(3)]
    free = equal_length_greedy_generate(model, prompts, 9, set())
    stops = {free[0][2]}
    assert static_greedy_generate(model, prompts, 9, set()) == free
    assert static_greedy_generate(model, prompts, 9, stops) == equal_length_greedy_generate(model, prompts, 9, stops)
    assert static_greedy_generate(model, prompts, 0, stops) == [[], [], []]


@pytest.mark.gpu
def test_static_loop_with_cuda_graphs_equals_the_eager_loop_on_the_tiny_model():
    from pathlib import Path

    from transformers import LlamaForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tiny = Path(__file__).resolve().parents[2] / "artifacts" / "models" / "tiny"
    model = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, model.config.vocab_size, (700,), generator=gen).tolist() for _ in range(4)]
    eager = equal_length_greedy_generate(model, prompts, 40, set())
    assert static_greedy_generate(model, prompts, 40, set()) == eager  # 700 + 40 crosses a 256-key view
