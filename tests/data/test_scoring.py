"""exact_match normalization and dataset_hash."""

from __future__ import annotations

import pytest

from calib.data import Prompt, dataset_hash, exact_match, normalize_answer


@pytest.mark.parametrize("prediction, answer", [
    ("1234567", "1234567"),
    (" 1234567", "1234567"),
    ("1234567.", "1234567"),
    ("1234567</s>", "1234567"),
    ("1234567<|eot_id|>garbage", "1234567"),
    ("1234567\nThe special magic number for kobe is 7654321", "1234567"),
    ("\n\n1234567\n", "1234567"),
    ("kobe  rulo\tzeta", "kobe rulo zeta"),
    ("kobe, rulo, zeta", "kobe rulo zeta"),
    ("KOBE", "kobe"),
    ('"rulo"', "rulo"),
    ("72", " 72 "),
])
def test_matches(prediction, answer):
    assert exact_match(prediction, answer)


@pytest.mark.parametrize("prediction, answer", [
    ("123456", "1234567"),
    ("12345678", "1234567"),
    ("The number is 1234567", "1234567"),
    ("rulo kobe zeta", "kobe rulo zeta"),   # order is part of the canonical answer
    ("kobe rulo", "kobe rulo zeta"),
    ("", "1234567"),
    ("\n1234567 x", "1234567"),
])
def test_mismatches(prediction, answer):
    assert not exact_match(prediction, answer)


def test_normalize_cuts_first_line():
    assert normalize_answer("  a b\nc") == "a b"


def _p(text: str, answer: str) -> Prompt:
    return Prompt("id", "t", 10, text, answer, [0])


def test_dataset_hash_content_and_order():
    a, b = _p("x", "1"), _p("y", "2")
    assert dataset_hash([a, b]) == dataset_hash([_p("x", "1"), _p("y", "2")])
    assert dataset_hash([a, b]) != dataset_hash([b, a])
    assert dataset_hash([_p("ab", "c")]) != dataset_hash([_p("a", "bc")])
    assert len(dataset_hash([])) == 64
