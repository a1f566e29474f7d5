"""scripts/kv_probe.py on the shipped tiny model: the table's columns mean what its docstring says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "artifacts" / "models" / "tiny"


@pytest.fixture(scope="module")
def kv_probe():
    sys.path.insert(0, str(ROOT / "scripts"))
    import kv_probe

    return kv_probe


def test_probe_rows_are_consistent(kv_probe):
    model, tok = kv_probe.load(TINY)
    rows = kv_probe.probe(model, tok, [3, 6], prompts=3)
    assert [r["pairs"] for r in rows] == [3, 6]
    for r in rows:
        assert 0 <= r["acc"] <= r["copied"] <= 1  # a right answer is also a copied value
        assert r["rank"] >= 0 and r["tokens"] > 8 * r["pairs"]


def test_value_positions_point_at_values_and_keys(kv_probe):
    from calib.data.prompt import PromptFormatter
    from calib.data.synthetic import kv_retrieval
    from calib.data.vocab import seed_from

    _, tok = kv_probe.load(TINY)
    fmt = PromptFormatter(tok, chat_template=False)
    ids, answer, values, pos = kv_probe.prompt(tok, fmt, 5, 0)
    inst = kv_retrieval(seed_from("kv-probe", 5, 0), 5)
    pairs = [line.split('": "') for line in inst.context.split("{", 1)[1].rstrip("}").split(",\n ")]
    words = tok.convert_ids_to_tokens(ids)
    assert [(words[p - kv_probe.KEY_TO_VALUE], words[p]) for p in pos] == [(k.strip('"'), v.strip('"')) for k, v in pairs]
    assert answer in values and len(values) == 5
    assert words[-1 - kv_probe.PREFIX_TO_KEY] == inst.queries[0].prefix.split('"')[1]


def test_lookup_heads_cover_two_layers(kv_probe):
    model, tok = kv_probe.load(TINY)
    rows = kv_probe.lookup_heads(model, tok, 6)
    heads = model.config.num_attention_heads
    assert len(rows) == 2 * heads
    assert all(0 <= r["value_to_key"] <= 1 and 0 <= r["final_to_asked_key"] <= 1 for r in rows)
