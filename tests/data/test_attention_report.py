"""scripts/attention_report.py's statistics on attention patterns worked out by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import attention_report as ar  # noqa: E402


def test_statistics_on_known_patterns():
    t = 128
    a = torch.zeros(1, 4, t, t)
    a[0, 0, :, 0] = 1.0                                    # sink head
    for q in range(t):
        a[0, 1, q, : q + 1] = 1.0 / (q + 1)                # uniform causal head
        a[0, 2, q, q] = 1.0                                # self (local) head
        a[0, 3, q, min(q, 10)] = 1.0                       # retrieval head: looks at token 10
    stats = ar._prompt_stats([a], needle=[9, 10, 11], queries=[120, 121])
    qs = range(ar.MIN_QUERY, t)
    assert math.isclose(stats["sink"][0, 0].item(), 1.0)
    assert math.isclose(stats["entropy"][0, 0].item(), 0.0, abs_tol=1e-6)
    assert math.isclose(stats["local"][0, 0].item(), 0.0, abs_tol=1e-6)
    expected_entropy = sum(math.log(q + 1) for q in qs) / len(qs)
    assert math.isclose(stats["entropy"][0, 1].item(), expected_entropy, rel_tol=1e-5)
    expected_local = sum(64 / (q + 1) for q in qs) / len(qs)
    assert math.isclose(stats["local"][0, 1].item(), expected_local, rel_tol=1e-5)
    assert math.isclose(stats["sink"][0, 1].item(), sum(1 / (q + 1) for q in qs) / len(qs), rel_tol=1e-5)
    assert math.isclose(stats["local"][0, 2].item(), 1.0)
    assert math.isclose(stats["retrieval"][0, 3].item(), 1.0)
    assert math.isclose(stats["retrieval"][0, 1].item(), (3 / 121 + 3 / 122) / 2, rel_tol=1e-5)
    table = {k: v.tolist() for k, v in stats.items()} | {"needle_tokens": 3, "length": t}
    assert ar.tags(table, 0, 0) == "sink" and ar.tags(table, 0, 2) == "local" and ar.tags(table, 0, 3) == "retrieval"
    assert "1 sink heads" in ar.summarize(table) and "layer" in ar.format_table(table)


def test_needle_positions_cover_the_needle(tiny_tokenizer):
    ids, needle, queries = ar.needle_prompt(tiny_tokenizer, 400, 0)
    pieces = tiny_tokenizer.convert_ids_to_tokens([ids[i] for i in needle])
    assert pieces[:5] == ["The", "special", "magic", "number", "for"] and pieces[-1] == "."
    assert len(needle) == 15  # 7 words, 7 digits, the full stop
    answer = tiny_tokenizer.convert_ids_to_tokens(ids[queries[0] + 1:])
    assert answer == pieces[7:14]
    assert ids[0] == tiny_tokenizer.bos_token_id
