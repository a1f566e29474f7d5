"""Sibling projections as one GEMM (runtime_kernels.fused_linears): the fused model computes what the
unfused one did, shares its weights instead of copying them, and keeps what other code sees of it
(state_dict, hooks on a projection, torch.compile without graph breaks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime_kernels.fused_linears import FusedPart, fuse_projections
from runtime_kernels.generate import StaticGenerator

transformers = pytest.importorskip("transformers")


def _llama(seed: int = 0, dtype: torch.dtype = torch.float64):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False).to(dtype)


def _qwen2(seed: int = 0):
    """q/k/v with biases (Qwen2's attention), o_proj without."""
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval().requires_grad_(False).double()
    for layer in model.model.layers:  # random biases: a zero bias would hide a bias dropped by fusing
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.normal_()
    return model


def _ids(b: int = 2, t: int = 11) -> torch.Tensor:
    return torch.randint(96, (b, t), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama", "qwen2-biases"])
def test_the_fused_model_computes_the_unfused_logits(make):
    model, ids = make(), _ids()
    before = model(ids).logits
    assert fuse_projections(model) == 2 * 2  # per layer: q/k/v and gate/up
    after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)
    attn = model.model.layers[0].self_attn
    assert all(isinstance(getattr(attn, n), FusedPart) for n in ("q_proj", "k_proj", "v_proj"))
    assert attn.q_proj.group._input is None  # the last sibling released the group's output


def test_fusing_shares_the_weights_and_keeps_the_state_dict():
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storages_before = sum(p.untyped_storage().nbytes() for p in model.parameters())
    fuse_projections(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    attn = model.model.layers[1].self_attn
    group = attn.q_proj.group.weight
    for start, proj in zip((0, 64, 96), (attn.q_proj, attn.k_proj, attn.v_proj)):
        assert proj.weight.untyped_storage().data_ptr() == group.untyped_storage().data_ptr()
        assert proj.weight.data_ptr() == group[start:].data_ptr()
    # one storage per group instead of one per projection: the bytes do not grow
    distinct = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(distinct.values()) == storages_before


def test_loading_weights_into_a_fused_model_reaches_its_gemm():
    model, other, ids = _llama(seed=0), _llama(seed=1), _ids()
    fuse_projections(model)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(model(ids).logits, other(ids).logits, rtol=0, atol=1e-12)


def test_each_projection_answers_for_its_own_input_in_any_order():
    model = _llama()
    mlp = model.model.layers[0].mlp
    weights = {n: getattr(mlp, n).weight.clone() for n in ("gate_proj", "up_proj")}
    fuse_projections(model)
    x, y = torch.randn(3, 64, dtype=torch.float64), torch.randn(3, 64, dtype=torch.float64)
    for name, inp in [("up_proj", x), ("gate_proj", x), ("gate_proj", y), ("up_proj", x), ("up_proj", y)]:
        torch.testing.assert_close(getattr(mlp, name)(inp), inp @ weights[name].T, rtol=0, atol=1e-12)


def test_hooks_on_a_projection_see_its_own_output():
    """calib's capture hooks ``q_proj`` / ``k_proj``: a fused projection still hands them its slice."""
    model, ids = _llama(), _ids()
    seen = {}
    attn = model.model.layers[1].self_attn

    def run():
        hooks = [getattr(attn, n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out.clone()))
                 for n in ("q_proj", "k_proj")]
        model(ids)
        for h in hooks:
            h.remove()
        return dict(seen)

    before = run()
    fuse_projections(model)
    after = run()
    assert after["q_proj"].shape == (2, 11, 64) and after["k_proj"].shape == (2, 11, 32)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-12)


def test_a_moved_model_falls_back_to_its_own_weights_and_unlike_siblings_are_left_alone():
    model, ids = _llama(), _ids()
    fuse_projections(model)
    reference = _llama().float()
    model.float()  # casts every parameter: no longer views of the (float64) group
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert fuse_projections(model) == 0  # idempotent: fused siblings are not nn.Linear any more

    mixed = _llama()
    attn = mixed.model.layers[0].self_attn
    attn.k_proj = nn.Linear(64, 32, bias=True, dtype=torch.float64)  # one sibling with a bias
    assert fuse_projections(mixed) == 3  # that layer's q/k/v stay apart, everything else fuses
    assert type(attn.q_proj) is nn.Linear


def test_the_fused_projections_compile_without_graph_breaks():
    model, ids = _llama(), _ids()
    fuse_projections(model)
    explained = torch._dynamo.explain(lambda x: model(x).logits)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert model.model.layers[0].self_attn.q_proj.group._input is None


def test_the_static_loop_fuses_by_default_and_decodes_what_an_unfused_loop_decodes():
    ids = _ids(2, 9)
    fused, plain = _llama(dtype=torch.float32), _llama(dtype=torch.float32)
    got = StaticGenerator(fused, batch=2, max_len=40, graphs=False, bucket=8).generate(ids, 12)
    want = StaticGenerator(plain, batch=2, max_len=40, graphs=False, bucket=8, fuse_projections=False).generate(ids, 12)
    assert isinstance(fused.model.layers[0].mlp.up_proj, FusedPart)
    assert type(plain.model.layers[0].mlp.up_proj) is nn.Linear
    assert torch.equal(got, want)


def test_a_fused_model_saves_and_loads_as_the_plain_model(tmp_path):
    """``save_pretrained`` writes the projections' own weights (views of the group's matrix), which load
    into an unfused model that computes the same logits."""
    model, ids = _llama(dtype=torch.float32), _ids()
    want = model(ids).logits
    fuse_projections(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded.model.layers[0].self_attn.k_proj) is nn.Linear
    torch.testing.assert_close(loaded(ids).logits, want)
