"""scripts/bench/traffic.py: a user's JSONL prompts as input ids, and their batches of one size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from traffic import batches, prompt_ids  # noqa: E402


class CharTokenizer:
    """One token per character (its code point), no BOS, no chat template."""

    chat_template = None
    bos_token_id = None
    bos_token = None

    def __call__(self, text, add_special_tokens=True, verbose=True):
        return {"input_ids": [ord(c) for c in text]}


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompts_become_their_ids_in_file_order(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"prompt": "hi"}, {"text": "abc", "answer": 3}])
    assert prompt_ids(path, CharTokenizer(), max_tokens=3) == [[104, 105], [97, 98, 99]]


def test_a_prompt_longer_than_the_context_allows_names_its_row(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"prompt": "ok"}, {"prompt": "too long"}, {"prompt": "also long"}])
    with pytest.raises(SystemExit, match=r"t\.jsonl:2: 8 tokens, more than the 4 .*\(and 1 more rows\)"):
        prompt_ids(path, CharTokenizer(), max_tokens=4)


def test_batches_keep_file_order_and_fill_the_last_from_the_start():
    a, b, c = [1], [2, 2], [3, 3, 3]
    assert batches([a, b, c], 2) == [[a, b], [c, a]]
    assert batches([a, b, c], 3) == [[a, b, c]]
    assert batches([a, b], 5) == [[a, b, a, b, a]]  # fewer prompts than one batch: repeated
    with pytest.raises(ValueError):
        batches([a], 0)
