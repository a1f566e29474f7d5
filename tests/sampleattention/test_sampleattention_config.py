"""conf/method/sampleattention.yaml resolves against every model file into a usable search grid."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calib.sampleattention.tuning import lengths_by_bucket
from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("model", ["tiny", "llama31", "smollm2"])
def test_method_config_resolves_per_model(model: str) -> None:
    cfg = OmegaConf.create({"model": OmegaConf.load(CONF / "model" / f"{model}.yaml"),
                            "method": OmegaConf.load(CONF / "method" / "sampleattention.yaml")})
    method = OmegaConf.to_container(cfg.method, resolve=True)
    assert method["name"] == "sampleattention" and method["abi_version"] >= 1
    edges = method["bucket_edges"]
    assert edges == list(cfg.model.method_defaults.sampleattention.bucket_edges)
    assert all(0 < a < 1 for a in method["alphas_c"] + method["alphas_s"])
    assert method["min_relative_score"] == 0.99 and method["table3_chunk_ns"] == [1, 2, 4, 6]  # paper Table 3
    # the tiny model searches chunk_n = 1 only (its CPU default); the rest the paper's grid
    assert method["chunk_ns"] == ([1] if model == "tiny" else [1, 2, 4, 6])
    table = BucketTable(edges, [BucketRow(1.0, 1.0, 1)] * (len(edges) + 1), blk=method["blk"])
    groups = lengths_by_bucket(edges, method["profiling"]["lengths"])
    assert len(groups) == len(table.rows) and sum(map(len, groups)) == len(method["profiling"]["lengths"])
    # exact-match profiling generates as long as eval does: SmolLM2's sentence-long answers need 32 tokens
    assert method["profiling"]["max_new_tokens"] == {"tiny": 16, "llama31": 16, "smollm2": 32}[model]
    # SmolLM2 profiles by greedy exact match (its answer probability missed a 5-point loss at 8k), in batches
    # of 64k tokens; the other models keep the continuous answer-probability score and eval's batch size
    assert method["score"] == ("exact_match" if model == "smollm2" else "answer_prob")
    assert method["profiling"]["batch_tokens"] == (65536 if model == "smollm2" else 16384)
    if model == "llama31":  # the paper's five buckets
        assert edges == [16 * 1024, 48 * 1024, 80 * 1024, 112 * 1024]
