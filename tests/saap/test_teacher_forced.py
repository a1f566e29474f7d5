"""Answer-aware SAAP calibration (``method.classifier.teacher_forced_answer``).

* the answer's decode positions are among the training rows of every head, with causal targets;
* the sampled rows are those of the prompt alone (off = the previous selection, same seed);
* the appended tokens are exactly the gold answer's tokens, as the model emits them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from calib.saap.targets import (
    answer_query_positions,
    kl_targets,
    prompt_training_rows,
    select_training_queries,
    top1_key_distance,
)

TINY = Path(__file__).resolve().parents[2] / "artifacts" / "models" / "tiny"


def _qk(hq=4, hkv=2, t=90, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, t, d, generator=g), torch.randn(hkv, t, d, generator=g) * 2


def _brute_causal(q, k, kb, i, h, c, sink):
    """Causal, sink-excluded ``A·H_k`` row of query ``i`` of head ``h`` in float64."""
    g = q.shape[0] // k.shape[0]
    s = torch.stack([q[h, i].double() @ k[h // g, j].double() / math.sqrt(q.shape[-1]) for j in range(sink, i + 1)])
    row = torch.zeros(c, dtype=torch.float64)
    for j, pj in zip(range(sink, i + 1), torch.softmax(s, 0)):
        row[kb[h // g, j]] += pj
    return row


# ------------------------------------------------------------------------------------ pure functions
def test_answer_query_positions_are_the_decode_steps():
    # prompt of 10 tokens, answer of 3: answer tokens sit at 10, 11, 12 and their queries are decoded
    assert answer_query_positions(10, 3).tolist() == [10, 11, 12]
    assert answer_query_positions(10, 0).numel() == 0


@pytest.mark.parametrize("causal_targets", [False, True])
def test_answer_rows_for_every_head(causal_targets):
    hq, hkv, c, n, t_prompt, m, sink = 4, 2, 6, 12, 80, 7, 1
    q, k = _qk(hq, hkv, t_prompt + m)
    kb = torch.randint(c, (hkv, t_prompt + m), generator=torch.Generator().manual_seed(1))
    rows = prompt_training_rows(q, k, kb, n, 20, c, prompt_len=t_prompt, sink=sink, causal_targets=causal_targets,
                                generator=torch.Generator().manual_seed(0))
    answer = list(range(t_prompt, t_prompt + m))
    assert rows.positions.shape == (hq, n + m) and rows.targets.shape == (hq, n + m, c)
    for h in range(hq):  # every head: the sampled rows inside the prompt, then all answer positions
        assert rows.positions[h, n:].tolist() == answer
        assert (rows.positions[h, :n] < t_prompt).all()
        assert rows.answer[h].tolist() == [False] * n + [True] * m
        for col, i in enumerate(answer):  # the decode step's attention: causal whatever causal_targets
            torch.testing.assert_close(rows.targets[h, n + col].double(), _brute_causal(q, k, kb, i, h, c, sink),
                                       rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.targets.sum(-1), torch.ones(hq, n + m))
    dist = top1_key_distance(q, k, positions=torch.tensor(answer), sink=sink)
    assert torch.equal(rows.long_range[:, n:], dist > 20)


@pytest.mark.parametrize("candidates", [None, 30])
def test_sampled_rows_are_those_of_the_prompt_alone(candidates):
    """With the answer appended the sampled rows (positions and targets) equal the prompt-only ones,
    and the prompt-only call (option off) is the previous select_training_queries + kl_targets."""
    hq, hkv, c, n, t_prompt, m = 4, 2, 6, 16, 80, 5
    q, k = _qk(hq, hkv, t_prompt + m, seed=3)
    kb = torch.randint(c, (hkv, t_prompt + m), generator=torch.Generator().manual_seed(2))
    qp, kp, kbp = q[:, :t_prompt], k[:, :t_prompt], kb[:, :t_prompt]

    old_pos, old_lr = select_training_queries(qp, kp, n, 20, candidates=candidates,
                                              generator=torch.Generator().manual_seed(7))
    old_tgt = kl_targets(qp, kp, kbp, old_pos, c)
    off = prompt_training_rows(qp, kp, kbp, n, 20, c, candidates=candidates, generator=torch.Generator().manual_seed(7))
    on = prompt_training_rows(q, k, kb, n, 20, c, prompt_len=t_prompt, candidates=candidates,
                              generator=torch.Generator().manual_seed(7))
    assert torch.equal(off.positions, old_pos) and torch.equal(off.long_range, old_lr)
    assert torch.equal(off.targets, old_tgt) and not off.answer.any()
    assert torch.equal(on.positions[:, :n], old_pos) and torch.equal(on.long_range[:, :n], old_lr)
    torch.testing.assert_close(on.targets[:, :n], old_tgt)
    assert on.positions.shape[1] == n + m


def test_prompt_len_is_checked():
    q, k = _qk(t=20)
    with pytest.raises(ValueError, match="prompt_len"):
        prompt_training_rows(q, k, torch.zeros(2, 20, dtype=torch.long), 4, 5, 3, prompt_len=21)


# ------------------------------------------------------------------------------ tokens and settings
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def test_answer_tokens_are_the_completion_tokens(tokenizer):
    """For every synthetic task the appended ids are the task's completion, tokenized as in training
    (scripts/train_tiny.py) and as a suffix of the prompt text + completion."""
    from calib.data import build_prompts
    from calib.data.prompt import PromptFormatter
    from calib.data.synthetic import TASKS, fit_to_length
    from calib.data.vocab import seed_from
    from calib.saap.recipe import answer_token_ids, calibration_sequences

    prompts = build_prompts({"source": "synthetic", "chat_template": None}, tokenizer, seed=5, lengths=[256],
                            tasks=list(TASKS), num_prompts=1)
    fmt = PromptFormatter(tokenizer, None)
    for p in prompts:
        fitted = fit_to_length(p.task, seed_from("calib-synthetic", 5, p.task, 256, 0), 256, fmt)
        assert fitted.text == p.text
        completion = fitted.instance.queries[0].completion
        ids = answer_token_ids(tokenizer, p)
        assert ids == list(tokenizer(completion, add_special_tokens=False)["input_ids"]), p.task
        assert fmt.encode(p.text + completion) == list(p.input_ids) + ids, p.task
        assert tokenizer.decode(ids, skip_special_tokens=True) == p.answer, p.task
    on, lengths = calibration_sequences(tokenizer, prompts, True)
    off, _ = calibration_sequences(tokenizer, prompts, False)
    assert lengths == [len(p.input_ids) for p in prompts]
    assert off == [list(p.input_ids) for p in prompts]
    for p, seq in zip(prompts, on):
        assert seq == list(p.input_ids) + answer_token_ids(tokenizer, p)


def test_separator_rule(tokenizer):
    from types import SimpleNamespace

    from calib.saap.recipe import answer_token_ids

    calls = []

    def tok(text, add_special_tokens=True):
        calls.append((text, add_special_tokens))
        return {"input_ids": [len(text)]}

    for text, want in (("... is", " 42"), ('"key": "', "42"), ("Answer: ", "42"), ("", "42")):
        answer_token_ids(tok, SimpleNamespace(text=text, answer="42"))
        assert calls[-1] == (want, False)
    assert answer_token_ids(tok, SimpleNamespace(text="x", answer="")) == []


def test_option_default_on_and_recorded():
    from calib.config import compose
    from calib.saap.recipe import Settings, hyperparameters

    s = Settings.from_cfg(compose(["+method=saap"]))
    assert s.teacher_forced_answer is True
    off = Settings.from_cfg(compose(["+method=saap", "method.classifier.teacher_forced_answer=false"]))
    assert off.teacher_forced_answer is False
    hyper = hyperparameters(s, 10, [1024], 2048, 1e-5)
    assert hyper["classifier"]["teacher_forced_answer"] is True


def test_default_calibration_lengths_leave_room_for_the_answer():
    """SmolLM2's data lengths end at its 8192-token context: calibration lengths left null (the data's
    without the eval length 4096) cut 8192 to 8192 - 64, so prompt + teacher-forced answer fit; without
    teacher forcing, and for explicit lengths, nothing is cut."""
    from calib.config import compose
    from calib.saap.recipe import ANSWER_ROOM, Settings, prompt_lengths

    def lengths(*extra):
        cfg = compose(["+method=saap", "model=smollm2", *extra])
        return prompt_lengths(cfg, Settings.from_cfg(cfg))

    assert lengths() == ([4096, 8192 - ANSWER_ROOM], 4096)  # smollm2's own choice (its long recipe)
    assert lengths("method.calib_lengths=null") == ([1024, 2048, 8192 - ANSWER_ROOM], 4096)
    assert lengths("method.calib_lengths=null", "method.classifier.teacher_forced_answer=false") == (
        [1024, 2048, 8192], 4096)
    assert lengths("method.calib_lengths=[2048,8192]") == ([2048, 8192], 4096)
    assert lengths("model=tiny")[0] == [1024, 2048, 8192]  # its context is 10240: room left


def test_answer_past_the_context_fails_before_collection(tokenizer):
    """A calibration prompt whose answer would pass the model's positions fails in one line while the
    prompts are built (it used to fail in the targets pass, after collection and k-means)."""
    from calib.config import compose
    from calib.errors import UserError
    from calib.saap.recipe import Settings, answer_token_ids, build_prompt_sets

    def prompt_sets(*extra):
        cfg = compose(["+method=saap", "model.arch.max_position_embeddings=300", "data.lengths=[128,256,300]",
                       "method.prompts=2", "method.eval.prompts=1", *extra])
        return build_prompt_sets(cfg, Settings.from_cfg(cfg), tokenizer)

    with pytest.raises(UserError, match=r"method.calib_lengths <= 236 or .*teacher_forced_answer=false") as info:
        prompt_sets("method.calib_lengths=[300]")
    assert "\n" not in str(info.value)
    calib, held, calib_lengths, eval_length = prompt_sets()
    assert (calib_lengths, eval_length) == ([128, 236], 256)
    assert 128 < max(len(p.input_ids) for p in calib) <= 236
    assert all(len(p.input_ids) + len(answer_token_ids(tokenizer, p)) <= 300 for p in calib)
    prompt_sets("method.calib_lengths=[300]", "method.classifier.teacher_forced_answer=false")


def test_tiny_model_emits_the_appended_tokens(tokenizer):
    """Greedy dense decoding of the tiny model emits exactly the teacher-forced tokens, and the queries
    at the answer positions predict the next answer token (the last one the stop token)."""
    from calib.config import compose
    from calib.data import build_prompts
    from calib.evaluate import greedy_generate, stop_token_ids
    from calib.models import load_model
    from calib.saap.recipe import answer_token_ids

    torch.set_num_threads(1)
    loaded = load_model(compose(["device=cpu"]).model, device="cpu")
    stops = stop_token_ids(loaded.tokenizer)
    prompts = build_prompts({"source": "synthetic", "chat_template": None}, loaded.tokenizer, seed=11,
                            lengths=[512], tasks=["niah_single", "kv_retrieval"], num_prompts=1)
    for p in prompts:
        ids = answer_token_ids(loaded.tokenizer, p)
        assert greedy_generate(loaded.model, p.input_ids, 12, stops) == ids, p.task
        t = len(p.input_ids)
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([list(p.input_ids) + ids])).logits[0]
        nxt = logits.argmax(-1)
        assert nxt[t - 1].item() == ids[0]  # the prefill's last position emits the first answer token
        decode = answer_query_positions(t, len(ids)).tolist()
        assert nxt[decode[:-1]].tolist() == ids[1:] and nxt[decode[-1]].item() in stops, p.task


# ------------------------------------------------------------------------------- recipe second pass
ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory):
    from calib.config import compose
    from calib.data.tokenizer import build_tiny_backend, save_tiny_tokenizer
    from calib.models import load_model, random_model

    out = tmp_path_factory.mktemp("saap_tf_llama")
    random_model("llama", {**ARCH, "vocab_size": build_tiny_backend().get_vocab_size()}, seed=5).save_pretrained(out)
    save_tiny_tokenizer(out)
    arch = [f"model.arch.{k}={'null' if v is None else v}" for k, v in ARCH.items()]
    base = ["+method=saap", f"model.path={out}", "model.name=rand-saap-tf", *arch, "model.lengths=[256]",
            "device=cpu", "method.clusters=8", "method.window=32", "method.long_range=64", "method.top_l_layers=null",
            "method.classifier.queries_per_prompt=24", "method.classifier.query_candidates=null"]
    return load_model(compose(base).model, device="cpu"), base


def test_training_rows_on_off(random_llama):
    """Every layer and head trains on the answer positions when on; the sampled rows match off's."""
    from calib.config import compose
    from calib.data import build_prompts
    from calib.saap.recipe import Settings, answer_token_ids, training_rows

    loaded, base = random_llama
    torch.set_num_threads(1)
    prompts = build_prompts({"source": "synthetic", "chat_template": None}, loaded.tokenizer, seed=2,
                            lengths=[256], tasks=["niah_single", "kv_retrieval"], num_prompts=1)
    centroids = {l: torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(l)) for l in (1,)}
    s_on = Settings.from_cfg(compose(base))
    s_off = Settings.from_cfg(compose([*base, "method.classifier.teacher_forced_answer=false"]))
    on, off = training_rows(loaded, prompts, centroids, s_on, 0)[1], training_rows(loaded, prompts, centroids, s_off, 0)[1]
    n = s_on.queries_per_prompt
    for k, p in enumerate(prompts):
        t, m = len(p.input_ids), len(answer_token_ids(loaded.tokenizer, p))
        assert m >= 1
        assert on.x[k].shape == (4, n + m, 16) and off.x[k].shape == (4, n, 16)
        assert torch.equal(on.positions[k][:, n:], torch.arange(t, t + m).expand(4, -1))
        assert on.answer[k][:, n:].all() and not on.answer[k][:, :n].any() and not off.answer[k].any()
        assert torch.equal(on.positions[k][:, :n], off.positions[k])
        torch.testing.assert_close(on.x[k][:, :n], off.x[k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(on.targets[k][:, :n], off.targets[k], rtol=1e-4, atol=1e-5)
    # the rows' inputs are the de-RoPE'd queries: the model's own pre-RoPE queries at those positions
    from calib.collect import run_layer_callbacks

    q_pre: dict[int, torch.Tensor] = {}
    run_layer_callbacks(loaded, [list(p.input_ids) for p in prompts],
                        lambda c: q_pre.__setitem__(c.prompt_index, c.q_pre.float().cpu()), layers=[1], progress=False)
    for k in range(len(prompts)):
        expect = q_pre[k].gather(1, off.positions[k].unsqueeze(-1).expand(-1, -1, 16))
        torch.testing.assert_close(off.x[k], expect, rtol=1e-4, atol=1e-4)
