"""SampleAttentionPrefill: the runtime object behind ``hf.apply(model, sampleattention_artifact)``."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.blocksparse.reference import block_sparse_attention, dense_causal_attention
from runtime_kernels.errors import ArtifactError
from runtime_kernels.manifest import (DataRecord, Manifest, ModelRecord, ProducerRecord, facts_from_hf_config,
                                      write_artifact)
from runtime_kernels.sampleattention.api import (SampleAttentionPrefill, bucket_table_tensor,
                                                 masked_dense_attention, sampleattention_prefill_attention)
from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable
from runtime_kernels.sampleattention.reference import (cumulative_residual_attention, sampled_query_rows,
                                                       sampleattention_select)
from tests.runtime.small_models import small_llama

BLK = 16
DENSE = BucketRow(1.0, 1.0, 1)
SPARSE = BucketRow(0.3, 0.3, 2)


def _qkv(t: int, *, b: int = 1, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=dtype)
    q[..., 0] += 2.0
    k[:, :, :3, 0] += 3.0  # a sink column
    return q, k, torch.randn(b, hkv, t, d, generator=g, dtype=dtype)


# ------------------------------------------------------------------------------- the CPU attention path
@pytest.mark.parametrize("tq,tk", [(200, 200), (70, 200), (33, 33)])
def test_masked_dense_attention_equals_the_block_sparse_reference(tq: int, tk: int) -> None:
    q, k, v = _qkv(tk, b=2, seed=1)
    q = q[:, :, tk - tq:]
    g = torch.Generator().manual_seed(2)
    nq, nk = -(-tq // BLK), -(-tk // 8)
    keep = torch.rand(2, 4, nq, nk, generator=g) < 0.4
    keep[0, 1, 0] = False  # a query block with nothing kept: output 0 in both
    mask = BlockMask.from_dense(keep, tq, tk, BLK, 8)
    ref = block_sparse_attention(q, k, v, mask)
    got = masked_dense_attention(q, k, v, mask)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(got[0, 1, :BLK], torch.zeros_like(got[0, 1, :BLK]))


def test_prefill_matches_the_stateless_entry_point_and_dense_rows_return_none() -> None:
    q, k, v = _qkv(150)
    scale = 0.3
    table = BucketTable([100], [DENSE, SPARSE], blk=BLK)
    rt = SampleAttentionPrefill(table)
    assert rt.method == "sampleattention" and rt.phase == "prefill"
    assert rt.prefill(0, q[:, :, :99], k[:, :, :99], v[:, :, :99], scale) is None  # bucket 0 is dense
    got = rt.prefill(1, q, k, v, scale)
    want = sampleattention_prefill_attention(q, k, v, table, scale=scale, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    ref_rt = SampleAttentionPrefill(table, backend="reference")
    torch.testing.assert_close(ref_rt.prefill(1, q, k, v, scale), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="backend"):
        SampleAttentionPrefill(table, backend="cuda")  # type: ignore[arg-type]


def test_pop_stats_average_layers_and_heads_and_reset() -> None:
    q, k, v = _qkv(160, seed=3)
    rt = SampleAttentionPrefill(SPARSE, blk=BLK)
    assert rt.pop_stats() == {}
    rt.prefill(0, q, k, v, 0.25)
    q2, k2, v2 = _qkv(160, seed=4)
    rt.prefill(1, q2, k2, v2, 0.25)
    masks = [sampleattention_select(a, b, alpha_c=0.3, alpha_s=0.3, chunk_n=2, blk=BLK, scale=0.25)
             for a, b in ((q, k), (q2, k2))]
    rows = sampled_query_rows(160, 2, BLK)
    cras = [cumulative_residual_attention(a, b, m, rows, scale=0.25) for (a, b), m in zip(((q, k), (q2, k2)), masks)]
    density = float(torch.cat([m.density() for m in masks], 1).mean())
    stats = rt.pop_stats()
    assert stats["density"] == pytest.approx(density) and stats["sparsity"] == pytest.approx(1 - density)
    assert 0.05 < stats["sparsity"] < 0.95
    assert stats["cra"] == pytest.approx(float(torch.cat(cras, 1).mean()))
    assert stats["cra_min"] == pytest.approx(float(torch.cat(cras, 1).min()))
    assert 0 < stats["cra_min"] <= stats["cra"] <= 1 and stats["bucket"] == 0.0
    assert "attn_time_s" not in stats and rt.pop_stats() == {}


def test_timing_measures_dense_rows_too() -> None:
    q, k, v = _qkv(100, dtype=torch.float32)
    rt = SampleAttentionPrefill(DENSE, blk=BLK, timing=True)
    out = rt.prefill(0, q, k, v, 0.25)  # timed dense: computed here, not left to the model
    torch.testing.assert_close(out, dense_causal_attention(q, k, v, scale=0.25), rtol=1e-5, atol=1e-5)
    stats = rt.pop_stats()
    assert stats["attn_time_s"] > 0 and stats["sparsity"] == 0.0 and stats["cra"] == 1.0


# ------------------------------------------------------------------------------- through hf.apply
@pytest.fixture(scope="module")
def model():
    """2 layers, 4 query / 2 KV heads of dim 16 with a sink and local heads (random init is near uniform)."""
    m = small_llama(seed=0)
    with torch.no_grad():
        m.model.embed_tokens.weight += 0.04 * torch.randn(64)
        for layer in m.model.layers:
            attn = layer.self_attn
            attn.v_proj.weight.mul_(30.0)
            for h, gain in enumerate((20.0, 60.0, 120.0, 200.0)):
                attn.q_proj.weight[h * 16:(h + 1) * 16] = gain * attn.k_proj.weight[(h // 2) * 16:(h // 2 + 1) * 16]
    return m


def _artifact(path: Path, model, table: BucketTable, payload: dict | None = None,
              tensor: torch.Tensor | None = None) -> Path:
    facts = facts_from_hf_config(model.config, name="rt-llama")
    manifest = Manifest(
        method="sampleattention", abi_version=1, model=ModelRecord(**facts), hyperparameters={"blk": table.blk},
        data=DataRecord(source="synthetic", seed=1, count=1, lengths=[256], content_hash="0" * 64),
        producer=ProducerRecord(package="calib", version="0", git_sha=None, created_at="2026-01-01T00:00:00Z"),
        payload={"buckets": table.to_dict()} if payload is None else payload,
    )
    t = bucket_table_tensor(table) if tensor is None else tensor
    return write_artifact(path, manifest, {"buckets": {"table": t}})


def _logits(model, length: int) -> torch.Tensor:
    ids = (torch.arange(length) * 7 % 297 + 3)[None]
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_apply_with_alpha_one_rows_is_bitwise_dense(model, tmp_path) -> None:
    from runtime_kernels import hf

    dense = _logits(model, 200)
    table = BucketTable([128], [DENSE, BucketRow(1.0, 0.5, 4)], blk=BLK, max_length=256)
    rt = hf.apply(model, _artifact(tmp_path / "dense", model, table), options={"sampleattention": {"stats": True}})
    try:
        assert isinstance(rt.prefill, SampleAttentionPrefill) and rt.decode is None
        assert rt.prefill.table == table
        same = _logits(model, 200)
        stats = rt.prefill.pop_stats()
    finally:
        hf.remove(model)
    assert torch.equal(same, dense)
    assert stats["density"] == 1.0 and stats["cra"] == 1.0 and stats["bucket"] == 1.0


def test_serving_computes_no_statistics_and_gives_the_same_output(model, tmp_path, monkeypatch) -> None:
    from runtime_kernels import hf
    from runtime_kernels.sampleattention import api

    table = BucketTable([128], [DENSE, BucketRow(0.5, 0.5, 1)], blk=BLK, max_length=256)
    path = _artifact(tmp_path / "served", model, table)
    rt = hf.apply(model, path, options={"sampleattention": {"stats": True}})
    try:
        measured = _logits(model, 192)
        assert rt.prefill.pop_stats()["cra"] < 1.0  # the eval path measures the sampled CRA
    finally:
        hf.remove(model)

    def no_cra(*args, **kwargs):
        raise AssertionError("serving computed the CRA")

    monkeypatch.setattr(api, "cumulative_residual_attention", no_cra)  # the CRA on a GPU
    monkeypatch.setattr(api.reference, "sampled_cra", no_cra)  # and from the reference's row masses
    rt = hf.apply(model, path)  # serving: hf.apply's default
    try:
        served = _logits(model, 192)
        assert rt.prefill.stats is False and rt.prefill.pop_stats() == {}
    finally:
        hf.remove(model)
    assert torch.equal(served, measured)


def test_bucket_row_follows_the_prompt_length_and_beyond_logs_once(model, tmp_path, caplog) -> None:
    from runtime_kernels import hf

    table = BucketTable([128], [DENSE, BucketRow(0.5, 0.5, 1)], blk=BLK, max_length=200)
    short, mid, long = _logits(model, 100), _logits(model, 192), _logits(model, 256)
    rt = hf.apply(model, _artifact(tmp_path / "two", model, table), options={"sampleattention": {"stats": True}})
    try:
        with caplog.at_level(logging.WARNING, logger="runtime_kernels.sampleattention.buckets"):
            got_short = _logits(model, 100)
            s_short = rt.prefill.pop_stats()
            got_mid = _logits(model, 192)
            s_mid = rt.prefill.pop_stats()
            assert not caplog.records
            got_long = [_logits(model, 256), _logits(model, 240)]  # two prompts x two layers: one line
            s_long = rt.prefill.pop_stats()
    finally:
        hf.remove(model)
    assert torch.equal(got_short, short) and s_short["bucket"] == 0.0 and s_short["sparsity"] == 0.0
    assert s_mid["bucket"] == 1.0 and s_mid["sparsity"] > 0.1 and not torch.equal(got_mid, mid)
    assert s_long["bucket"] == 1.0 and s_long["sparsity"] > 0.1 and not torch.equal(got_long[0], long)
    beyond = [r for r in caplog.records if "exceeds the longest tuned length" in r.getMessage()]
    assert len(beyond) == 1 and "256" in beyond[0].getMessage()
    assert torch.isfinite(got_long[0]).all() and math.isfinite(s_long["cra"])


def test_from_artifact_checks_payload_and_table_tensor(model, tmp_path) -> None:
    from runtime_kernels.artifact import load_artifact

    table = BucketTable([128], [DENSE, SPARSE], blk=BLK, max_length=256)
    rt = SampleAttentionPrefill.from_artifact(load_artifact(_artifact(tmp_path / "ok", model, table)), model)
    assert rt.table.to_dict() == table.to_dict()
    wrong = bucket_table_tensor(BucketTable([128], [DENSE, BucketRow(0.7, 0.6, 2)], blk=BLK))
    with pytest.raises(ArtifactError, match="disagrees with payload.buckets"):
        SampleAttentionPrefill.from_artifact(load_artifact(_artifact(tmp_path / "bad", model, table, tensor=wrong)), model)
    with pytest.raises(ArtifactError, match="no bucket table"):
        SampleAttentionPrefill.from_artifact(load_artifact(_artifact(tmp_path / "no", model, table, payload={})), model)
    broken = {"buckets": {"edges": [128], "rows": [{"alpha_c": 0.5}]}}
    with pytest.raises(ArtifactError, match="malformed"):
        SampleAttentionPrefill.from_artifact(load_artifact(_artifact(tmp_path / "b", model, table, broken)), None)


def test_statistics_read_the_device_once_per_pop(monkeypatch) -> None:
    """Density and sampled CRA are summed where they are computed: the layers' calls read nothing back
    (on a GPU a host read is a sync per layer), and a pop reads each sum once; the figures are those of
    the per-call masks (the test above)."""
    reads: list[str] = []
    real_float, real_item = torch.Tensor.__float__, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append("float") or real_float(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or real_item(t))
    rt = SampleAttentionPrefill(SPARSE, blk=BLK)
    for seed in (3, 4, 5):
        q, k, v = _qkv(160, seed=seed)
        rt.prefill(0, q, k, v, 0.25)
    assert reads == []
    stats = rt.pop_stats()
    assert len(reads) == 3  # the density sum, the CRA sum, the CRA minimum
    assert 0 < stats["cra_min"] <= stats["cra"] <= 1 and 0 < stats["sparsity"] < 1


def test_dense_and_sparse_rows_average_together() -> None:
    """A dense bucket's call counts density and CRA 1 for each of its heads beside a sparse call's measured
    ones: the means are over every (call, head), the minimum CRA the sparse call's."""
    table = BucketTable([100], [DENSE, SPARSE], blk=BLK)
    rt = SampleAttentionPrefill(table, blk=BLK)
    q, k, v = _qkv(160, seed=6)
    rt.prefill(0, q[:, :, :90], k[:, :, :90], v[:, :, :90], 0.25)  # bucket 0: dense, 4 heads
    rt.prefill(1, q, k, v, 0.25)  # bucket 1: sparse, 4 heads
    mask = sampleattention_select(q, k, alpha_c=0.3, alpha_s=0.3, chunk_n=2, blk=BLK, scale=0.25)
    cra = cumulative_residual_attention(q, k, mask, sampled_query_rows(160, 2, BLK), scale=0.25)
    stats = rt.pop_stats()
    assert stats["density"] == pytest.approx((4 + float(mask.density().sum())) / 8)
    assert stats["cra"] == pytest.approx((4 + float(cra.sum())) / 8)
    assert stats["cra_min"] == pytest.approx(float(cra.min())) and stats["bucket"] == 1.0
