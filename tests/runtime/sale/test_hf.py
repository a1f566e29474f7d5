"""SalePrefill: the runtime object behind ``hf.apply(model, sale_artifact)`` (prefill only, decode dense)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime_kernels.errors import ArtifactError
from runtime_kernels.manifest import (DataRecord, Manifest, ModelRecord, ProducerRecord, facts_from_hf_config,
                                      write_artifact)
from runtime_kernels.sale.api import SalePrefill, sale_prefill_attention, sale_select
from runtime_kernels.sale.reference import SaleSelectionConfig
from tests.runtime.small_models import small_llama

CFG = SaleSelectionConfig(block_q=16, block_k=16, sink=16, local=32, bits=4)


def _qkv(b: int = 2, hq: int = 4, hkv: int = 2, t: int = 200, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g) * 2
    k = torch.randn(b, hkv, t, d, generator=g) * 2
    return q, k, torch.randn(b, hkv, t, d, generator=g)


def test_prefill_is_sale_attention_with_the_layer_row_and_dense_layers_return_none():
    tau = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.9, 0.0, 0.5, 0.3]])
    rt = SalePrefill(tau, CFG)
    q, k, v = _qkv()
    assert rt.method == "sale" and rt.phase == "prefill"
    assert rt.prefill(0, q, k, v, 0.25) is None  # all-dense layer: the model's own attention runs
    out = rt.prefill(1, q, k, v, 0.25)
    want = sale_prefill_attention(q, k, v, tau[1], config=CFG, scale=0.25, backend="reference")
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_pop_stats_averages_layers_and_heads_then_resets():
    tau = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.9, 0.0, 0.5, 0.3]])
    rt = SalePrefill(tau, CFG)
    assert rt.pop_stats() == {}
    q, k, v = _qkv()
    rt.prefill(0, q, k, v, 0.25)
    rt.prefill(1, q, k, v, 0.25)
    d1 = sale_select(q, k, tau[1], config=CFG, scale=0.25).density()  # [B, H]
    expected = (8 * 1.0 + float(d1.double().sum())) / 16
    stats = rt.pop_stats()
    assert stats["density"] == pytest.approx(expected) and stats["sparsity"] == pytest.approx(1 - expected)
    assert 0 < stats["sparsity"] < 0.5  # head 1 of layer 1 and all of layer 0 are dense
    assert rt.pop_stats() == {}


def test_statistics_read_the_device_once_per_pop_and_serving_keeps_none(monkeypatch):
    tau = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.9, 0.0, 0.5, 0.3]])
    q, k, v = _qkv()
    reads = []
    real_float = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or real_float(t))
    rt = SalePrefill(tau, CFG)
    for layer in (0, 1, 1):
        rt.prefill(layer, q, k, v, 0.25)
    assert reads == []  # a host read of a GPU tensor is a sync: none while the layers run
    assert 0 < rt.pop_stats()["sparsity"] < 1 and len(reads) == 1
    served = SalePrefill(tau, CFG, stats=False)  # hf.apply's default: from_artifact(..., stats=False)
    served.prefill(1, q, k, v, 0.25)
    assert served.pop_stats() == {} and len(reads) == 1


def test_constructor_and_call_validation():
    with pytest.raises(ValueError, match=r"\[L, Hq\]"):
        SalePrefill(torch.zeros(4), CFG)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SalePrefill(torch.tensor([[0.5, 1.5]]), CFG)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="query heads"):
        SalePrefill(torch.full((2, 3), 0.01), CFG).prefill(0, q, k, v, 0.25)


# -------------------------------------------------------------------------------- through hf.apply
@pytest.fixture(scope="module")
def model():
    m = small_llama(seed=0)
    with torch.no_grad():  # local heads of different sharpness (random init attends almost uniformly):
        m.model.embed_tokens.weight += 0.04 * torch.randn(64)  # one shared offset -> keys ~ position only
        for layer in m.model.layers:
            attn = layer.self_attn
            attn.v_proj.weight.mul_(30.0)
            for h, gain in enumerate((20.0, 60.0, 120.0, 200.0)):  # query head h = gain x its KV head's key
                attn.q_proj.weight[h * 16:(h + 1) * 16] = gain * attn.k_proj.weight[(h // 2) * 16:(h // 2 + 1) * 16]
    return m


def _artifact(path: Path, model, tau: torch.Tensor) -> Path:
    facts = facts_from_hf_config(model.config, name="rt-llama")
    manifest = Manifest(
        method="sale", abi_version=1, model=ModelRecord(**facts),
        hyperparameters={"theta": 0.1, "tau0": 0.008, **{k: v for k, v in CFG.to_dict().items() if k != "precision"}},
        data=DataRecord(source="synthetic", seed=1, count=1, lengths=[256], content_hash="0" * 64),
        producer=ProducerRecord(package="calib", version="0", git_sha=None, created_at="2026-01-01T00:00:00Z"),
        payload={"selection": CFG.to_dict(), "precision": CFG.precision},
    )
    return write_artifact(path, manifest, {"thresholds": {"tau": tau, "err": torch.zeros(1, *tau.shape),
                                                          "density": torch.ones_like(tau)}})


def test_apply_zero_tau_is_bitwise_dense_and_positive_tau_is_close(model, tmp_path):
    from runtime_kernels import hf

    ids = torch.arange(3, 3 + 256)[None] % 300
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    try:
        rt = hf.apply(model, _artifact(tmp_path / "zero", model, torch.zeros(2, 4)), options={"sale": {"stats": True}})
        assert isinstance(rt.prefill, SalePrefill) and rt.decode is None
        assert rt.prefill.config == CFG
        with torch.no_grad():
            same = model(input_ids=ids).logits
        assert rt.prefill.pop_stats() == {"density": 1.0, "sparsity": 0.0}
    finally:
        hf.remove(model)
    assert torch.equal(same, dense)
    try:
        rt = hf.apply(model, _artifact(tmp_path / "sparse", model, torch.full((2, 4), 0.004)),
                      options={"sale": {"stats": True}})
        with torch.no_grad():
            sparse = model(input_ids=ids).logits
        stats = rt.prefill.pop_stats()
    finally:
        hf.remove(model)
    assert stats["sparsity"] > 0.05
    assert not torch.equal(sparse, dense)
    assert (sparse - dense).abs().max() < 0.02 * dense.abs().max()


def test_from_artifact_refuses_thresholds_of_another_shape(model, tmp_path):
    from runtime_kernels.artifact import load_artifact

    art = load_artifact(_artifact(tmp_path / "bad", model, torch.zeros(2, 5)))
    with pytest.raises(ArtifactError, match="2 layers x 4 query heads"):
        SalePrefill.from_artifact(art, model)
