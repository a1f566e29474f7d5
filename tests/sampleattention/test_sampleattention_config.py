"""conf/method/sampleattention/ composes with every model file into a usable search grid."""

from __future__ import annotations

import pytest

from calib.config import available, compose
from calib.sampleattention.recipe import Settings
from calib.sampleattention.tuning import lengths_by_bucket
from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable


@pytest.mark.parametrize("model", available("model"))
def test_method_config_resolves_per_model(model: str) -> None:
    cfg = compose(["+method=sampleattention", f"model={model}"])
    s = Settings.from_cfg(cfg)
    assert cfg.method.name == "sampleattention"
    assert all(0 < a < 1 for a in s.alphas_c + s.alphas_s)
    assert s.min_relative_score == 0.99 and s.table3_chunk_ns == [1, 2, 4, 6]  # paper Table 3
    # the tiny model searches chunk_n = 1 only (its CPU default); the rest the paper's grid
    assert s.chunk_ns == ([1] if model == "tiny" else [1, 2, 4, 6])
    table = BucketTable(s.bucket_edges, [BucketRow(1.0, 1.0, 1)] * (len(s.bucket_edges) + 1), blk=s.blk)
    groups = lengths_by_bucket(s.bucket_edges, s.profiling.lengths)
    assert len(groups) == len(table.rows) and sum(map(len, groups)) == len(s.profiling.lengths)
    assert s.profiling.lengths == list(cfg.model.lengths)
    # exact-match profiling generates as long as eval does: SmolLM2's sentence-long answers need 32 tokens
    assert s.profiling.max_new_tokens == cfg.eval.max_new_tokens == (32 if model == "smollm2" else 16)
    # SmolLM2 profiles by greedy exact match (its answer probability missed a loss at 8k), in batches of 64k
    # tokens; the other models keep the continuous answer-probability score and eval's batch size
    assert s.score == ("exact_match" if model == "smollm2" else "answer_prob")
    assert s.profiling.batch_tokens == (65536 if model == "smollm2" else cfg.eval.batch_tokens)
    if model == "llama31":  # the paper's five buckets
        assert s.bucket_edges == [16 * 1024, 48 * 1024, 80 * 1024, 112 * 1024]
    if model in ("tiny", "smollm2"):  # one bucket per profiled length
        assert [len(g) for g in groups] == [1, 1, 1, 1]


def test_profiling_budgets_follow_eval_unless_a_model_sets_them() -> None:
    cfg = compose(["+method=sampleattention", "eval.max_new_tokens=7", "eval.batch_tokens=1000"])
    s = Settings.from_cfg(cfg)
    assert (s.profiling.max_new_tokens, s.profiling.batch_tokens) == (7, 1000)
    smol = Settings.from_cfg(compose(["+method=sampleattention", "model=smollm2", "eval.batch_tokens=1000"]))
    assert smol.profiling.batch_tokens == 65536
