"""scripts/train_tiny.py --smoke: every stage (data workers, training, saving, evaluation, card) on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run(tmp_path):
    out = tmp_path / "tiny"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--smoke", "--out", str(out),
                           "--device", "cpu"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "training_config.json", "eval.json",
            "MODEL_CARD.md"} <= names
    arch = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())["arch"]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == arch["num_layers"]
    assert config["num_attention_heads"] == arch["num_heads"]
    assert config["num_key_value_heads"] == arch["num_kv_heads"]
    assert config["head_dim"] == arch["head_dim"] and config["hidden_size"] == arch["hidden_size"]
    assert config["max_position_embeddings"] == arch["max_position_embeddings"]
    evaluation = json.loads((out / "eval.json").read_text())
    assert set(evaluation["accuracy"]) == {f"{t}@{n}" for t in
                                           ["niah_single", "niah_multikey", "kv_retrieval", "variable_tracking",
                                            "frequent_words"] for n in evaluation["lengths"]}
    training = json.loads((out / "training_config.json").read_text())
    assert training["config"]["seed"] == 0 and training["log"]
    card = (out / "MODEL_CARD.md").read_text()
    assert "| niah_single |" in card and "Attention structure" in card

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    assert (out / "model.safetensors").stat().st_size < 12 * 2**20


def _step_batches(tokenizer):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny

    cfg = train_tiny.TrainConfig(tokens_per_step=1024, unit_fit_length=512,
                                 phases=[train_tiny.Phase("short", 4, 200, 400)])
    return train_tiny, train_tiny.StepBatches(cfg, tokenizer)


def test_training_batches_deterministic_and_labelled(tiny_tokenizer):
    tt, data = _step_batches(tiny_tokenizer)
    _, again = _step_batches(tiny_tokenizer)
    for step in (0, 3):
        a, b = data[step], again[step]
        assert all(torch_equal(a[k], b[k]) for k in a)
    batch = data[1]
    assert not torch_equal(batch["input_ids"], data[2]["input_ids"])
    eos = tiny_tokenizer.eos_token_id
    pad = tiny_tokenizer.pad_token_id
    for ids, ans, lm in zip(batch["input_ids"].tolist(), batch["answer"].tolist(), batch["lm"].tolist()):
        n = sum(t != pad for t in ids)
        assert all(t != pad for t in ids[:n]) and not any(ans[n:]) and not any(lm[n:])  # padding: no loss
        assert not any(a and m for a, m in zip(ans, lm))
        assert ids[0] == tiny_tokenizer.bos_token_id and ids[n - 1] == eos
        flagged = [t for t, f in zip(ids, ans) if f]
        assert flagged.count(eos) == sum(1 for t in ids[:n] if t == eos) >= 1  # each answer ends with EOS
        first = flagged[: flagged.index(eos)]
        assert tiny_tokenizer.unk_token_id not in ids[:n] and first


def test_example_answer_is_the_prompt_answer(tiny_tokenizer):
    from calib.data.prompt import PromptFormatter
    from calib.data.synthetic import TASK_FUNCTIONS
    from calib.data.vocab import seed_from

    tt, data = _step_batches(tiny_tokenizer)
    fmt = PromptFormatter(tiny_tokenizer)
    for task in TASK_FUNCTIONS:
        inst = TASK_FUNCTIONS[task](seed_from("t", task), 20)
        ids, flags = data.sequence(inst)
        q = inst.queries[0]
        prompt = fmt.encode(fmt.render(inst.context, q.question, q.prefix))
        assert ids[: len(prompt)] == prompt and tt.ANSWER not in flags[: len(prompt)]
        end = flags.index(tt.LM, len(prompt)) if tt.LM in flags[len(prompt):] else len(ids)
        answer = ids[len(prompt): end]  # the first answer and its EOS
        assert answer[-1] == tiny_tokenizer.eos_token_id
        assert tiny_tokenizer.decode(answer, skip_special_tokens=True) == q.answer
        # the prompt + answer tokenizes as one text the same way (no merge across the boundary)
        assert fmt.encode(fmt.render(inst.context, q.question, q.prefix) + q.completion) == prompt + answer[:-1]


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def test_phase_spec_with_its_own_task_mix(tiny_tokenizer):
    """``--phases name:steps:min:max[:task=w/...]``: a phase's mix replaces the default one in that phase only."""
    tt, _ = _step_batches(tiny_tokenizer)
    kv_only = tt.Phase.parse("kv:3:150:200:kv_retrieval=1")
    mixed = tt.Phase.parse("rest:1:150:200")
    assert (kv_only.steps, kv_only.min_len, kv_only.max_len, kv_only.task_weights) == (3, 150, 200, {"kv_retrieval": 1.0})
    assert mixed.task_weights is None
    with pytest.raises(ValueError, match="unknown tasks"):
        tt.Phase.parse("x:1:10:20:no_such_task=1")
    with pytest.raises(ValueError, match="expected name:steps"):
        tt.Phase.parse("x:1:10")
    cfg = tt.TrainConfig(tokens_per_step=800, unit_fit_length=512, phases=[kv_only, mixed])
    data = tt.StepBatches(cfg, tiny_tokenizer)
    tasks, cum = data.mix(kv_only)
    assert tasks == ["kv_retrieval"] and cum == [1.0]
    assert data.mix(mixed)[0] == list(cfg.task_weights)
    kv_intro = tiny_tokenizer("JSON data", add_special_tokens=False)["input_ids"]
    for step in range(3):  # every sequence of a kv-only step is a key-value prompt
        for row in data[step]["input_ids"].tolist():
            assert any(row[i:i + len(kv_intro)] == kv_intro for i in range(len(row)))


def test_context_tokens_carry_no_lm_loss_for_random_content_tasks(tiny_tokenizer):
    """kv/needle contexts are random content: no next-token loss there (it would teach "never copy a seen
    word" where the answer must copy one); the question, prefix and extra questions keep it."""
    from calib.data.synthetic import TASK_FUNCTIONS
    from calib.data.vocab import seed_from

    tt, data = _step_batches(tiny_tokenizer)
    assert data.cfg.context_lm_tasks == tt.TASKS  # the shipped recipe: LM loss on every context
    data.cfg.context_lm_tasks = ("variable_tracking", "frequent_words")
    for task in TASK_FUNCTIONS:
        inst = TASK_FUNCTIONS[task](seed_from("ctx", task), 30)
        ids, flags = data.sequence(inst)
        context = tiny_tokenizer(inst.context, add_special_tokens=False)["input_ids"]
        assert ids[1:1 + len(context)] == context  # BOS, then the context's own tokens
        after = flags[1 + len(context):]
        assert tt.ANSWER in after and tt.LM in after  # question tokens and answers are trained
        if task in data.cfg.context_lm_tasks:
            assert set(flags[1:1 + len(context)]) == {tt.LM}
        else:
            assert set(flags[1:1 + len(context)]) == {tt.NO_LOSS}


def test_kv_recall_block_repeats_context_pairs_as_answers(tiny_tokenizer):
    """--kv-recall-pairs: after the questions, `"k": "v"` lines of the context's own pairs (with
    replacement, at most 2 per pair); every value is an answer target and belongs to its key."""
    import re

    from calib.data.synthetic import kv_retrieval
    from calib.data.vocab import seed_from

    tt, data = _step_batches(tiny_tokenizer)
    plain = data.sequence(kv_retrieval(seed_from("recall"), 6))
    data.cfg.kv_recall_pairs = 128
    inst = kv_retrieval(seed_from("recall"), 6)
    ids, flags = data.sequence(inst)
    assert ids[: len(plain[0])] == plain[0] and flags[: len(plain[1])] == plain[1]
    pairs = dict(re.findall(r'"([^"]+)": "([^"]+)"', inst.context))
    tail_ids, tail_flags = ids[len(plain[0]):], flags[len(plain[1]):]
    keys = tiny_tokenizer.convert_ids_to_tokens([t for t, f in zip(tail_ids, tail_flags) if f == tt.NO_LOSS])
    values = tiny_tokenizer.convert_ids_to_tokens([t for t, f in zip(tail_ids, tail_flags) if f == tt.ANSWER])
    assert len(keys) == len(values) == 2 * len(pairs) == 12
    assert all(pairs[k] == v for k, v in zip(keys, values))  # each value belongs to the key before it
    assert len(set(keys)) < len(keys)  # with replacement: repeats are possible (and happen for this seed)


def test_init_from_loads_saved_weights_and_refuses_another_shape(tiny_tokenizer, tmp_path):
    """--init-from: a run continues from a saved model's weights (tied head included); a model of
    another shape is a one-line error, not a silent partial load."""
    import torch
    from safetensors.torch import load_file

    tt, _ = _step_batches(tiny_tokenizer)
    arch = tt.read_arch(ROOT / "conf" / "model" / "tiny.yaml")
    small = {**arch, "hidden_size": 64, "num_layers": 1}
    cfg = tt.TrainConfig(intermediate_size=128)
    saved = tt.build_model(cfg, small, tiny_tokenizer)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p))  # differ from any fresh init
    saved.save_pretrained(tmp_path / "a")
    cfg.seed = 1
    fresh = tt.build_model(cfg, small, tiny_tokenizer)
    tt.load_weights(fresh, tmp_path / "a")
    stored = load_file(str(tmp_path / "a" / "model.safetensors"))
    state = fresh.state_dict()
    assert all(torch.equal(state[k], v.float()) for k, v in stored.items())
    assert torch.equal(fresh.lm_head.weight, fresh.model.embed_tokens.weight)
    other = tt.build_model(tt.TrainConfig(intermediate_size=128), {**small, "hidden_size": 128}, tiny_tokenizer)
    with pytest.raises(SystemExit, match="architecture differs"):
        tt.load_weights(other, tmp_path / "a")
    with pytest.raises(SystemExit, match="no model.safetensors"):
        tt.load_weights(other, tmp_path)
