"""scripts/bench/book_traffic.py: held-out passages with a request after each, as traffic for bench_serving."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from book_traffic import REQUESTS, main, paragraphs, passage, traffic_rows  # noqa: E402

TEXT = ("Chapter 1\n\n"
        "one two three four five six seven eight\nnine ten\n\n"
        "alpha beta gamma delta epsilon zeta eta theta\n\n"
        "short line\n\n"
        "a b c d e f g h i j k l")


def test_paragraphs_join_their_lines_and_drop_headings():
    assert paragraphs(TEXT) == ["one two three four five six seven eight nine ten",
                                "alpha beta gamma delta epsilon zeta eta theta", "a b c d e f g h i j k l"]


def test_a_passage_ends_at_the_first_paragraph_break_that_reaches_its_length():
    paras = paragraphs(TEXT)
    assert passage(paras, 0, 10) == paras[0]  # exactly ten words: one paragraph
    assert passage(paras, 0, 11) == paras[0] + "\n\n" + paras[1]  # 18 words
    assert passage(paras, 2, 1000) == paras[2]  # the text's end comes first


def test_rows_are_reproducible_from_the_seed_and_within_the_word_range():
    """On the shipped novel: every passage reaches its drawn length (at least ``lo`` words) and stays under
    ``hi`` plus a paragraph; a request follows each; the same seed gives the same file, another seed another."""
    from calib.perplexity import real_text_path

    text = real_text_path().read_text()
    rows = traffic_rows(text, 12, 100, 400, seed=3)
    assert rows == traffic_rows(text, 12, 100, 400, seed=3) != traffic_rows(text, 12, 100, 400, seed=4)
    assert [row["id"] for row in rows] == [f"persuasion-{i}" for i in range(12)]
    longest_paragraph = max(len(p.split()) for p in paragraphs(text))
    for row in rows:
        body, request = row["prompt"].rsplit("\n\n", 1)
        assert request in REQUESTS
        assert 100 <= len(body.split()) < 400 + longest_paragraph
    with pytest.raises(ValueError):
        traffic_rows(text, 3, 50, 10, seed=0)


def test_the_command_writes_jsonl_that_the_bench_reads(tmp_path, capsys):
    out = tmp_path / "traffic.jsonl"
    main([str(out), "--prompts", "4", "--words", "50,60"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(set(row) == {"id", "prompt"} for row in rows)
    assert "4 prompts" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--words"):
        main([str(out), "--words", "60"])
