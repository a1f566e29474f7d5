"""SAAP through runtime_kernels.hf on a random Llama: every bucket visited = the dense model."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels import hf
from runtime_kernels.saap import SaapDecode, SaapLayerParams, derope
from tests.runtime.saap.test_saap_reference import _params

transformers = pytest.importorskip("transformers")

HQ, HKV, D, C = 4, 2, 16, 4


def _model():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
                                   max_position_embeddings=512, rope_theta=10000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _decode_logits(model, ids, steps=4):
    out = model(ids, use_cache=True)
    past, tok, logits = out.past_key_values, out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def _layers(recent):
    return [SaapLayerParams(sink=1, recent=recent, dense=True)] + [_params(HQ, HKV, D, C, 8, 1, recent, seed=i)
                                                                  for i in (1, 2)]


@torch.no_grad()
def test_all_buckets_equal_dense_model():
    model = _model()
    ids = torch.randint(96, (2, 50), generator=torch.Generator().manual_seed(0))
    dense = _decode_logits(model, ids)
    rt = SaapDecode(_layers(recent=8), top_l=C)
    hf.attach(model, decode=rt)
    sparse = _decode_logits(model, ids)
    assert set(rt.index) == {1, 2} and rt.index[1].length == 50 + 4
    assert torch.allclose(sparse, dense, atol=1e-4, rtol=1e-4)
    other = _model()  # a fresh model: re-attaching to the same one goes through hf.remove
    hf.attach(other, decode=SaapDecode(_layers(recent=8), top_l=1))
    assert not torch.allclose(_decode_logits(other, ids), dense, atol=1e-4)  # SAAP really ran


def test_derope_inverts_model_rotary():
    model = _model()
    rot = model.model.rotary_emb
    pos = torch.arange(300)[None]
    x = torch.randn(1, 2, 300, D)
    cos, sin = rot(x, pos)
    post = x * cos.unsqueeze(1) + torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1) * sin.unsqueeze(1)
    assert torch.allclose(derope(post, cos, sin), x, atol=1e-5)


def test_from_artifact_layout():
    from types import SimpleNamespace

    layers = _layers(recent=8)
    tensors = {}
    for i, p in enumerate(layers):
        tensors.update(p.to_tensors(f"layers.{i}."))
    art = SimpleNamespace(manifest=SimpleNamespace(hyperparameters={"sink": 1, "window": 9, "top_l": 3,
                                                                    "dense_layers": [0], "bn_eps": 1e-5}),
                          tensors=tensors)
    rt = SaapDecode.from_artifact(art, SimpleNamespace(config=SimpleNamespace(num_hidden_layers=3)))
    assert rt.top_l == 3 and rt.layers[0].dense and not rt.layers[2].dense
    assert rt.layers[1].recent == 8 and torch.equal(rt.layers[2].w1, layers[2].w1)
