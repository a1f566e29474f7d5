"""SAAP through runtime_kernels.hf on a random Llama: every bucket visited = the dense model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime_kernels import hf
from runtime_kernels.errors import ArtifactError
from runtime_kernels.saap import SaapDecode, SaapLayerParams, derope
from tests.runtime.saap.test_saap_reference import _params
from tests.runtime.saap.through_buckets import SaapThroughBuckets

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
    from runtime_kernels.generate import cache_argument, output_cache

    out = model(ids, use_cache=True)
    past, tok, logits = output_cache(out), out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        out = model(tok, use_cache=True, **{cache_argument(model): past})
        past, tok = output_cache(out), out.logits[:, -1:].argmax(-1)
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
    rt = SaapThroughBuckets(_layers(recent=8), top_l=C)  # the runtime itself runs dense at ℓ = C
    hf.attach(model, decode=rt)
    sparse = _decode_logits(model, ids)
    assert set(rt.index) == {1, 2} and rt.index[1].length == 50 + 4
    assert torch.allclose(sparse, dense, atol=1e-4, rtol=1e-4)
    other = _model()  # a fresh model: re-attaching to the same one goes through hf.remove
    hf.attach(other, decode=SaapDecode(_layers(recent=8), top_l=1))
    assert not torch.allclose(_decode_logits(other, ids), dense, atol=1e-4)  # SAAP really ran


@torch.no_grad()
def test_per_layer_top_l():
    """``top_l_layers``: every bucket on layer 1 and one on layer 2 is neither the all-bucket model nor the
    one-bucket model; every bucket named per layer equals dense. The stats count each layer at its ℓ."""
    model = _model()
    ids = torch.randint(96, (1, 50), generator=torch.Generator().manual_seed(2))
    dense = _decode_logits(model, ids)
    outs = {}
    for name, top_l, per_layer in (("all", 1, {1: C, 2: C}), ("mixed", 1, {1: C}), ("one", 1, {})):
        m = _model()
        rt = SaapDecode(_layers(recent=8), top_l=top_l, top_l_layers=per_layer)
        hf.attach(m, decode=rt)
        outs[name] = _decode_logits(m, ids)
        assert rt.layer_top_l(1) == per_layer.get(1, top_l) and rt.layer_top_l(2) == per_layer.get(2, top_l)
    assert torch.allclose(outs["all"], dense, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(outs["mixed"], dense, atol=1e-4) and not torch.allclose(outs["mixed"], outs["one"], atol=1e-4)
    with pytest.raises(ArtifactError, match="top_l_layers"):
        SaapDecode(_layers(recent=8), top_l=1, top_l_layers={7: 2})
    with pytest.raises(ArtifactError, match="top_l_layers"):
        SaapDecode(_layers(recent=8), top_l=1, top_l_layers={1: 0})


def test_derope_inverts_model_rotary():
    model = _model()
    rot = model.model.rotary_emb
    pos = torch.arange(300)[None]
    x = torch.randn(1, 2, 300, D)
    cos, sin = rot(x, pos)
    post = x * cos.unsqueeze(1) + torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1) * sin.unsqueeze(1)
    assert torch.allclose(derope(post, cos[:, None], sin[:, None]), x, atol=1e-5)


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
    assert rt.top_l == 3 and rt.layers[0].dense and not rt.layers[2].dense and rt.top_l_layers == {}
    art.manifest.hyperparameters["top_l_layers"] = {"2": 5}  # JSON keys are strings
    rt = SaapDecode.from_artifact(art, SimpleNamespace(config=SimpleNamespace(num_hidden_layers=3)))
    assert (rt.layer_top_l(1), rt.layer_top_l(2)) == (3, 5)
    rt = SaapDecode.from_artifact(art, SimpleNamespace(config=SimpleNamespace(num_hidden_layers=3)),
                                  top_l_layers={1: 4})  # a runtime option replaces the artifact's map
    assert (rt.layer_top_l(1), rt.layer_top_l(2)) == (4, 3)
    assert rt.layers[1].recent == 8 and torch.equal(rt.layers[2].w1, layers[2].w1)
    assert not rt.stats  # serving counts nothing
    # the serving policy's groups: a dense layer never runs SAAP; layers of one ℓ share a signature
    C = rt.layers[1].w2.shape[-1]
    assert rt.cost_signature(0) is None and rt.cost_signature(1) != rt.cost_signature(2)
    rt = SaapDecode.from_artifact(art, SimpleNamespace(config=SimpleNamespace(num_hidden_layers=3)), stats=True,
                                  top_l=2, top_l_layers={2: C})  # every bucket in layer 2: all keys, i.e. dense
    assert rt.stats and rt.cost_signature(1) is not None and rt.cost_signature(2) is None
    # a setting changed on the same runtime changes the answer
    before = rt.cost_signature(1)
    rt.top_l_layers[1] = 1
    assert rt.cost_signature(1) != before and "|l1|" in rt.cost_signature(1)
    rt.stats = False
    assert "|stats0|" in rt.cost_signature(1)
    rt.top_l_layers[1] = C
    assert rt.cost_signature(1) is None
    del rt.top_l_layers[1]
    rt.stats = True
    assert rt.cost_signature(1) == before
    rt.layers[1] = replace(rt.layers[1], recent=4)  # new parameters for a layer: signed anew
    assert rt.cost_signature(1) == before.replace("|recent8|", "|recent4|")


def test_all_layers_signatures_follow_every_setting_and_layer_change():
    """``cost_signatures()`` (what the serving policy asks at each new view) is kept between calls and
    equals the per-layer signatures after any change of ℓ, per-layer ℓ, statistics or a layer's parameters."""
    rt = SaapDecode([SaapLayerParams(sink=1, recent=8, dense=True)] + [_params(4, 2, 16, 4, 8, 1, 8, seed=i)
                                                                      for i in (1, 2)], top_l=2, stats=False)
    each = lambda: tuple(rt.cost_signature(layer) for layer in range(3))  # noqa: E731
    first = rt.cost_signatures()
    assert first == each() and first[0] is None and rt.cost_signatures() is first
    for change in (lambda: setattr(rt, "top_l", 1), lambda: rt.top_l_layers.update({2: 4}),
                   lambda: setattr(rt, "stats", True),
                   lambda: rt.layers.__setitem__(1, replace(rt.layers[1], recent=4))):
        before = rt.cost_signatures()
        change()
        assert rt.cost_signatures() == each() != before


def test_stats_count_the_visited_bucket_keys_by_hand():
    """One KV head, 2 query heads, buckets holding 3/1/0/4 keys; both heads' classifiers rank bucket 3 first
    and bucket 1 second (bias only), so ℓ = 1 visits its 4 keys of 8: selectivity 1/2; with the 4 keys of
    the sink + window out of 12, (4 + 4) / 12."""
    from types import SimpleNamespace

    hq, d, c, hidden = 2, 4, 4, 3
    z = lambda *s: torch.zeros(*s)  # noqa: E731
    params = SaapLayerParams(sink=1, recent=3, centroids=z(1, c, d), w1=z(hq, d, hidden), b1=z(hq, hidden),
                             bn_mean=z(hq, hidden), bn_var=torch.ones(hq, hidden), bn_weight=torch.ones(hq, hidden),
                             bn_bias=z(hq, hidden), w2=z(hq, hidden, c), b2=torch.tensor([[0.0, 2, 0, 9]] * hq))
    rt = SaapDecode([params], top_l=1)
    idx = SimpleNamespace(bucket_count=torch.tensor([[[3, 1, 0, 4]]], dtype=torch.int32))
    rt._record(0, torch.randn(1, hq, d), idx, t=12)
    assert rt.pop_stats() == pytest.approx({"selectivity": 0.5, "selectivity_with_window": 8 / 12})
    assert rt.pop_stats() == {}  # popped
    rt.top_l = 2  # next best: bucket 1, 4 + 1 keys; then a cache whose lists are empty (all sink/window)
    rt._record(0, torch.randn(1, hq, d), idx, t=12)
    rt._record(0, torch.randn(1, hq, d), SimpleNamespace(bucket_count=torch.zeros(1, 1, c, dtype=torch.int32)), t=5)
    assert rt.pop_stats() == pytest.approx({"selectivity": (5 / 8 + 0.0) / 2, "selectivity_with_window": (9 / 12 + 1) / 2})


@torch.no_grad()
def test_stats_through_the_model():
    """Every bucket visited -> selectivity 1; one of four -> strictly between 0 and 1; stats=False -> {}."""
    model = _model()
    ids = torch.randint(96, (1, 60), generator=torch.Generator().manual_seed(1))
    rt = SaapDecode(_layers(recent=8), top_l=C)
    hf.attach(model, decode=rt)
    _decode_logits(model, ids, steps=3)
    assert rt.pop_stats() == pytest.approx({"selectivity": 1.0, "selectivity_with_window": 1.0})
    other = _model()
    rt = SaapDecode(_layers(recent=8), top_l=1)
    hf.attach(other, decode=rt)
    _decode_logits(other, ids, steps=3)
    got = rt.pop_stats()
    assert 0.0 < got["selectivity"] < 1.0 and got["selectivity"] < got["selectivity_with_window"] < 1.0
    quiet = _model()
    rt = SaapDecode(_layers(recent=8), top_l=1, stats=False)
    hf.attach(quiet, decode=rt)
    _decode_logits(quiet, ids, steps=2)
    assert rt.pop_stats() == {}
