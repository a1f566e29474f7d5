"""The ``contains`` scoring rule (RULER's string match, whole items) and the per-prompt rule switch."""

from __future__ import annotations

import pytest

from calib.data import SCORING_RULES, Prompt, contains_answer, is_correct


@pytest.mark.parametrize("prediction, answer", [
    (" 1841451. This is the number of the ancient book.", "1841451"),      # the sentence answers of SmolLM2
    ("The special magic number mentioned in the text is 2715087.", "2715087"),
    ("\n\n1. 2715087", "2715087"),                                          # leading blank lines are fine
    ("Sure!\nThe answer is 2715087", "2715087"),                             # any line of the reply
    ("The words are ZUTI, voge and mupa.", "zuti voge mupa"),                # case and punctuation ignored
    ("mupa voge zuti", "zuti voge mupa"),                                    # order does not matter
    ('"gami"', "gami"),
])
def test_contains_accepts_the_answer_anywhere(prediction, answer):
    assert contains_answer(prediction, answer)


@pytest.mark.parametrize("prediction, answer", [
    ("The number is 12715087.", "2715087"),         # inside a longer number
    ("The number is 27150871.", "2715087"),
    ("gamis", "gami"),                               # inside a longer word
    ("zuti and voge", "zuti voge mupa"),             # one item missing
    ("<|im_end|>2715087", "2715087"),                # after the end of the reply
    ("", "2715087"),
])
def test_contains_rejects(prediction, answer):
    assert not contains_answer(prediction, answer)


def test_is_correct_switches_rules():
    sentence = " 1841451. This is the number."
    prompt = lambda rule: Prompt("id", "t", 10, "q", "1841451", [0], scoring=rule)  # noqa: E731
    assert is_correct(sentence, prompt("contains"))
    assert not is_correct(sentence, prompt("exact_match"))  # exact match reads the first line as the answer
    assert is_correct("1841451", prompt("exact_match"))
    assert set(SCORING_RULES) == {"exact_match", "contains"}
    with pytest.raises(ValueError, match="unknown scoring rule 'fuzzy'"):
        is_correct("x", prompt("fuzzy"))
