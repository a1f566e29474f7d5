"""collect(): budgets, shards, resume, reuse by content hash, memory caps, the reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import calib.collect.collector as collector
from calib.collect import CollectConfig, CollectedSet, collect, run_layer_callbacks
from calib.collect.collector import sample_bytes
from calib.collect.memory import forward_bytes, model_bytes
from calib.collect.sampling import sample_generator, sample_positions
from calib.errors import UserError

CONF = Path(__file__).resolve().parents[2] / "conf" / "collect" / "default.yaml"
SMALL = {"keys_per_head": 40, "queries_per_head": 24, "progress": False}


def _prompts(lengths, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (t,), generator=g) for t in lengths]


def _full_captures(loaded, prompts):
    out = {}
    run_layer_callbacks(loaded, prompts, lambda c: out.__setitem__((c.layer, c.prompt_index), c.to("cpu")), progress=False)
    return out


def _shard_tensors(s: CollectedSet) -> dict:
    return {(i, l, n): t for i in range(s.num_prompts) for l in s.layers
            for n, t in s.prompt(i, l, ["q_pos", "k_pos", *s.stored]).items()}


def test_default_yaml_is_a_valid_collect_config():
    cfg = CollectConfig.from_any(yaml.safe_load(CONF.read_text()))
    assert cfg.keys_per_head >= 1 and cfg.sampling in ("reservoir", "stratified")


def test_unknown_or_bad_keys_are_user_errors():
    with pytest.raises(UserError, match="unknown collect key"):
        CollectConfig.from_any({"keys_per_heads": 3})
    with pytest.raises(UserError, match="collect.sampling"):
        CollectConfig.from_any({"sampling": "random"})
    with pytest.raises(UserError, match="collect.store"):
        CollectConfig.from_any({"store": ["q_pre", "o"]})


@pytest.mark.parametrize("mode", ["reservoir", "stratified"])
def test_budgets_and_samples_match_the_full_capture(llama, tmp_path, mode):
    prompts = _prompts([150, 30])  # the second prompt is shorter than the key budget
    s = collect(llama, prompts, {**SMALL, "sampling": mode}, tmp_path)
    full = _full_captures(llama, prompts)
    for i, t in enumerate((150, 30)):
        for layer in (0, 1):
            got = s.prompt(i, layer, ["k_pos", "q_pos", "k_pre", "k_post", "v", "q_pre", "q_post"])
            nk, nq = min(40, t), min(24, t)
            assert got["k_pre"].shape == (1, nk, 16) and got["v"].shape == (1, nk, 16)
            assert got["q_pre"].shape == (4, nq, 16) and got["q_pos"].shape == (4, nq)
            for kind in ("k", "q"):
                pos = got[f"{kind}_pos"].long()
                assert (pos.diff(dim=1) > 0).all() and pos.min() >= 0 and pos.max() < t  # distinct, sorted
            ref = full[(layer, i)]
            for name in ("k_pre", "k_post", "v", "q_pre", "q_post"):  # *_post rebuilt from *_pre by RoPE
                pos = got["q_pos" if name.startswith("q") else "k_pos"].long()
                expect = torch.stack([getattr(ref, name)[h, pos[h]] for h in range(pos.shape[0])])
                assert torch.allclose(got[name], expect, atol=1e-6), name


def test_stratified_draws_one_position_per_stratum():
    pos = sample_positions(1000, 10, 8, "stratified", sample_generator(0, 0, 0, "k"))  # [8, 10]
    assert torch.equal(pos // 100, torch.arange(10).expand(8, 10))
    assert len({tuple(p.tolist()) for p in pos}) > 1  # heads draw independently


def test_reservoir_is_uniform_over_positions():
    counts = torch.zeros(50)
    for seed in range(400):
        pos = sample_positions(50, 5, 4, "reservoir", sample_generator(seed, 1, 2, "q"))
        counts += torch.bincount(pos.flatten(), minlength=50)
    expected = 400 * 4 * 5 / 50  # 160 per position
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 100  # 49 degrees of freedom: p < 1e-4 to exceed


def test_reader_concatenates_layers_and_keeps_prompt_ids(llama, tmp_path):
    s = collect(llama, _prompts([60, 70, 80]), SMALL, tmp_path)
    out = s.layer(1, ["k_pre", "q_post", "v"])
    assert out["k_pre"].shape == (1, 120, 16) and out["v"].shape == (1, 120, 16) and out["q_post"].shape == (4, 72, 16)
    assert torch.equal(out["k_prompt"], torch.arange(3).repeat_interleave(40))
    assert torch.equal(out["q_prompt"], torch.arange(3).repeat_interleave(24))
    with pytest.raises(KeyError, match="layer 5"):
        s.prompt(0, 5)


def test_interrupted_run_resumes_at_the_next_prompt(llama, tmp_path, monkeypatch):
    prompts = _prompts([50, 60, 70, 80])
    real_write = collector.write_shard
    written = []

    def crash_after_two(directory, index, tensors, num_tokens):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        written.append(index)
        return real_write(directory, index, tensors, num_tokens)

    monkeypatch.setattr(collector, "write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        collect(llama, prompts, SMALL, tmp_path / "a")
    monkeypatch.setattr(collector, "write_shard", real_write)
    resumed = collect(llama, prompts, SMALL, tmp_path / "a")
    assert resumed.stats["prompts_resumed"] == 2 and resumed.stats["prompts_computed"] == 2
    assert resumed.stats["tokens_computed"] == 70 + 80
    fresh = collect(llama, prompts, SMALL, tmp_path / "b")
    assert fresh.stats["prompts_computed"] == 4
    a, b = _shard_tensors(resumed), _shard_tensors(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(Path(resumed.directory).glob(".*.tmp"))


def test_complete_set_is_reused_without_a_forward_pass(llama, tmp_path, monkeypatch):
    prompts = _prompts([40, 50])
    first = collect(llama, prompts, SMALL, tmp_path)
    assert first.reused is False and first.stats["tokens_per_s"] > 0

    def no_forward(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(collector, "capture_session", no_forward)
    again = collect(llama, prompts, {**SMALL, "batch_size": 2}, tmp_path)  # batch size is not content
    assert again.reused and again.stats["reused"] and again.content_hash == first.content_hash
    assert again.directory == first.directory


@pytest.mark.parametrize("change", [{"keys_per_head": 41}, {"seed": 1}, {"layers": [1]}, "prompts"])
def test_content_hash_changes_with_content(llama, tmp_path, change):
    prompts = _prompts([40, 50])
    base = collect(llama, prompts, SMALL, tmp_path)
    if change == "prompts":
        other = collect(llama, [prompts[0], prompts[1][:-1]], SMALL, tmp_path)
    else:
        other = collect(llama, prompts, {**SMALL, **change}, tmp_path)
    assert other.content_hash != base.content_hash and not other.reused


def test_memory_caps(llama, tmp_path):
    prompts = _prompts([100, 100, 100, 100])
    with pytest.raises(UserError) as err:
        collect(llama, prompts, {**SMALL, "max_host_bytes": 1000}, tmp_path)
    assert "\n" not in str(err.value) and "collect.max_host_bytes" in str(err.value)
    # a cap with room for the model and 1.5 prompts' estimated working set: one prompt per forward
    cfg = CollectConfig.from_any(SMALL)
    one = (forward_bytes(llama.model.config, 100, 1, torch.float32, "sdpa")
           + sample_bytes(llama.facts, 2, 100, cfg, 4))
    cap = model_bytes(llama.model) + int(1.5 * one)
    reduced = collect(llama, prompts, {**SMALL, "batch_size": 4, "max_host_bytes": cap}, tmp_path)
    assert reduced.stats["batch_size"] == 1 and reduced.stats["prompts_computed"] == 4


def test_empty_and_too_long_prompts(qwen2, tmp_path):
    with pytest.raises(UserError, match="no prompts"):
        collect(qwen2, [], SMALL, tmp_path)
    with pytest.raises(UserError, match="prompt 0 has 5000 tokens"):
        collect(qwen2, [[7] * 5000], SMALL, tmp_path)


def test_qwen2_collects_and_rebuilds_post_rope(qwen2, tmp_path):
    prompts = _prompts([90, 33], seed=5)
    s = collect(qwen2, prompts, {**SMALL, "store": ["q_post", "k_post", "v"], "store_dtype": "float32"}, tmp_path)
    full = _full_captures(qwen2, prompts)
    got = s.prompt(0, 1, ["k_pre", "k_pos", "q_pre", "q_pos"])  # *_pre rebuilt from *_post by de-RoPE
    ref = full[(1, 0)]
    for name, pos_name in (("k_pre", "k_pos"), ("q_pre", "q_pos")):
        pos = got[pos_name].long()
        expect = torch.stack([getattr(ref, name)[h, pos[h]] for h in range(pos.shape[0])])
        assert torch.allclose(got[name], expect, atol=1e-5)


@pytest.mark.gpu
def test_bf16_collection_on_cuda_with_a_gpu_cap(tmp_path):
    from calib.models import loaded_from_model, random_model
    from tests.models.helpers import LLAMA_ARCH

    model = random_model("llama", LLAMA_ARCH, dtype=torch.bfloat16, device="cuda")
    loaded = loaded_from_model(model, name="rand", family="llama", model_hash="x")
    s = collect(loaded, _prompts([9000, 500]), {**SMALL, "max_gpu_bytes": 2 << 30}, tmp_path)
    assert s.stats["peak_gpu_bytes"] <= 2 << 30 and s.stats["tokens_per_s"] > 0
    got = s.prompt(0, 1, ["k_pre", "k_post"])
    assert got["k_pre"].dtype == torch.bfloat16
