"""The capture attention function and the per-layer, per-prompt callback hook."""

from __future__ import annotations

import math

import pytest
import torch

from calib.collect import CAPTURE_IMPL, LayerCapture, capture_session, run_layer_callbacks
from calib.errors import UserError
from calib.rope import apply_rope, derope, rotary_cos_sin


def _captures(loaded, prompts, **kw) -> list[LayerCapture]:
    out: list[LayerCapture] = []
    run_layer_callbacks(loaded, prompts, lambda c: out.append(c.to("cpu")), progress=False, **kw)
    return out


def _prompts(n: int, lengths: list[int], vocab: int = 128, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (t,), generator=g) for t in lengths[:n]]


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_eager"])
def test_capture_leaves_logits_unchanged(name, request):
    loaded = request.getfixturevalue(name)
    model = loaded.model
    base_impl = model.config._attn_implementation
    ids = _prompts(1, [200])[0][None]
    with torch.no_grad():
        plain = model(ids).logits
        seen = []
        with capture_session(model, lambda c: seen.append(c.layer)):
            assert model.config._attn_implementation == CAPTURE_IMPL
            captured = model(ids, use_cache=False).logits
    assert model.config._attn_implementation == base_impl  # restored
    assert seen == [0, 1]
    assert torch.equal(plain, captured)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_pre_post_rope_consistent_beyond_8k(name, request):
    loaded = request.getfixturevalue(name)
    length = 9000 if name == "llama" else 3000  # llama: past Llama-3's original 8192 context
    caps = _captures(loaded, _prompts(1, [length]))
    assert [c.layer for c in caps] == [0, 1]
    for cap in caps:
        assert torch.equal(cap.positions, torch.arange(length))
        cos, sin = rotary_cos_sin(loaded.model, cap.positions)
        assert torch.allclose(apply_rope(cap.q_pre, cos, sin), cap.q_post, atol=1e-6)
        assert torch.allclose(apply_rope(cap.k_pre, cos, sin), cap.k_post, atol=1e-6)
        assert torch.allclose(derope(cap.q_post, cos, sin), cap.q_pre, atol=1e-5, rtol=1e-5)
        assert torch.allclose(derope(cap.k_post, cos, sin), cap.k_pre, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(cap.k_post[:, -100:], cap.k_pre[:, -100:])  # the rotation is not trivial there


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_layer0_tensors_match_an_independent_computation(name, request):
    """Layer 0: q/k/v from the embeddings by hand; attention output by a float64 causal softmax."""
    loaded = request.getfixturevalue(name)
    model, facts = loaded.model, loaded.facts
    ids = _prompts(1, [64])[0]
    cap = next(c for c in _captures(loaded, [ids], keep_attn_output=True) if c.layer == 0)
    layer = model.model.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        h = layer.input_layernorm(model.model.embed_tokens(ids))  # [T, hidden]
        q = attn.q_proj(h).view(64, facts.num_heads, facts.head_dim).transpose(0, 1)  # [Hq, T, D]
        k = attn.k_proj(h).view(64, facts.num_kv_heads, facts.head_dim).transpose(0, 1)
        v = attn.v_proj(h).view(64, facts.num_kv_heads, facts.head_dim).transpose(0, 1)
    assert torch.allclose(cap.q_pre, q, atol=1e-6) and torch.allclose(cap.k_pre, k, atol=1e-6)
    assert torch.allclose(cap.v, v, atol=1e-6)
    group = facts.num_heads // facts.num_kv_heads
    qd, kd, vd = cap.q_post.double(), cap.k_post.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) / math.sqrt(facts.head_dim)  # [Hq, T, T]
    scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    ref = scores.softmax(-1) @ vd  # [Hq, T, D]
    assert torch.allclose(cap.attn_output.double(), ref, atol=1e-5)


def test_batched_prompts_match_one_at_a_time(llama):
    prompts = _prompts(3, [120, 80, 101])
    single = {(c.layer, c.prompt_index): c for c in _captures(llama, prompts, batch_size=1, keep_attn_output=True)}
    batched = _captures(llama, prompts, batch_size=3, keep_attn_output=True)
    assert len(batched) == len(single) == 6
    for c in batched:
        ref = single[(c.layer, c.prompt_index)]
        assert c.q_post.shape == ref.q_post.shape == (4, prompts[c.prompt_index].numel(), 16)
        for field in ("q_pre", "q_post", "k_pre", "k_post", "v", "attn_output"):
            assert torch.allclose(getattr(c, field), getattr(ref, field), atol=1e-5), field


def test_layer_subset_stops_the_forward_early(llama):
    calls = []
    attn1 = llama.model.model.layers[1].self_attn
    handle = attn1.register_forward_hook(lambda *a: calls.append(1))
    try:
        caps = _captures(llama, _prompts(2, [50, 60]), layers=[0])
    finally:
        handle.remove()
    assert [(c.layer, c.prompt_index) for c in caps] == [(0, 0), (0, 1)]
    assert calls == []  # layer 1 never ran


def test_last_layer_attention_is_skipped_and_captures_are_unchanged(llama, monkeypatch):
    """The last requested layer hands over q/k/v without computing its attention; what the callback
    sees equals the capture of a pass that computes it (keep_attn_output runs every attention)."""
    import torch.nn.functional as F

    prompts = _prompts(2, [70, 90])
    full = {(c.layer, c.prompt_index): c for c in _captures(llama, prompts, layers=[0, 1], keep_attn_output=True)}
    sdpa_calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: sdpa_calls.append(1) or real_sdpa(*a, **k))
    caps = _captures(llama, prompts, layers=[0, 1])
    assert [(c.layer, c.prompt_index) for c in caps] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert len(sdpa_calls) == len(prompts)  # layer 0 only: layer 1's attention is never computed
    for c in caps:
        ref = full[(c.layer, c.prompt_index)]
        assert c.attn_output is None
        for field in ("q_pre", "q_post", "k_pre", "k_post", "v"):
            assert torch.equal(getattr(c, field), getattr(ref, field)), field


def test_prompt_longer_than_context_is_user_error(qwen2):
    with pytest.raises(UserError) as err:
        run_layer_callbacks(qwen2, [[5] * 10, [5] * 4097], lambda c: None, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "prompt 1 has 4097 tokens" in msg and "at most 4096" in msg


def test_callback_error_restores_the_model(llama):
    def fail(cap):
        raise ValueError("inside the callback")

    with pytest.raises(ValueError, match="inside the callback"):
        run_layer_callbacks(llama, _prompts(1, [20]), fail, progress=False)
    assert llama.model.config._attn_implementation == "sdpa"
    assert all(not m._forward_hooks for m in llama.model.modules())


def test_stats_report_throughput(llama):
    stats = run_layer_callbacks(llama, _prompts(2, [100, 50]), lambda c: None, progress=False)
    assert stats["tokens"] == 150 and stats["tokens_per_s"] > 0 and stats["peak_host_rss_bytes"] > 0


def test_bf16_post_rope_is_reproduced_bit_for_bit():
    """In bf16, apply_rope(pre) equals the model's post-RoPE tensors exactly; de-RoPE is bf16-close."""
    from calib.models import loaded_from_model, random_model
    from tests.models.helpers import LLAMA_ARCH

    model = random_model("llama", LLAMA_ARCH, seed=7, dtype=torch.bfloat16)
    loaded = loaded_from_model(model, name="rand", family="llama")
    cap = _captures(loaded, _prompts(1, [1500]), layers=[0])[0]
    cos, sin = rotary_cos_sin(model, cap.positions)
    assert cap.k_post.dtype == torch.bfloat16
    assert torch.equal(apply_rope(cap.k_pre, cos, sin), cap.k_post)
    assert torch.equal(apply_rope(cap.q_pre, cos, sin), cap.q_post)
    back = derope(cap.k_post, cos, sin, dtype=torch.float32)
    assert torch.allclose(back, cap.k_pre.float(), atol=0.05, rtol=0.02)  # bf16 rounding of post, not drift
