"""exact_match normalization, the contains rule, per-task rules and dataset_hash."""

from __future__ import annotations

import pytest

from calib.data import Prompt, contains_answer, dataset_hash, exact_match, is_correct, normalize_answer
from calib.data.scoring import scoring_rule
from calib.errors import UserError


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


@pytest.mark.parametrize("prediction, answer, expected", [
    ("The special magic number is 1234567.", "1234567", True),     # wrapped in a sentence
    ("Sure!\nThe answer: KOBE RULO", "kobe rulo", True),            # any line, any case
    ("kobe,  rulo", "kobe rulo", True),                             # commas and spaces canonical
    ("the value is 42", "4", False),                                # whole items, not substrings
    ("1234567</s>", "1234567.", True),                              # the answer's edge punctuation stripped
    ("</s>1234567", "1234567", False),                              # nothing after end of sequence counts
    ("rulo kobe", "kobe rulo", True),                               # items in any order (RULER)
    ("rulo only", "kobe rulo", False),                              # every item needed
    ("anything", "", False),                                        # no answer never matches
    ("123456", "1234567", False),
])
def test_contains(prediction, answer, expected):
    assert contains_answer(prediction, answer) is expected


def test_is_correct_follows_the_prompts_rule():
    wrapped = "The number is 72."
    assert not is_correct(wrapped, _p("q", "72"))  # exact_match by default: first line must be the answer
    assert is_correct(wrapped, Prompt("id", "t", 10, "q", "72", [0], scoring="contains"))
    assert is_correct("72", _p("q", "72"))


def test_scoring_rule_setting():
    assert scoring_rule(None, "qa") == "exact_match"
    assert scoring_rule("contains", "qa") == "contains"
    assert scoring_rule({"qa": "contains"}, "qa") == "contains"
    assert scoring_rule({"qa": "contains"}, "kv") == "exact_match"
    with pytest.raises(UserError, match="data.scoring must be exact_match or contains"):
        scoring_rule({"qa": "regex"}, "qa")
