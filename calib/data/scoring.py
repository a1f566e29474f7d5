"""Answer scoring (exact match, or the answer contained in a sentence) and the content hash of a prompt set.

``exact_match(prediction, answer)`` compares canonical forms. Normalization, applied to both sides:

1. leading whitespace dropped, then the text is cut at the first newline or end-of-sequence marker
   (``</s>``, ``<|eot_id|>``, ``<|end_of_text|>``, ``<|im_end|>``, ``<|endoftext|>``, ``<eos>``,
   ``<end_of_turn>``): the answer is the first line of the reply;
2. lowercased; commas and semicolons become spaces; runs of whitespace become one space;
3. leading/trailing ``. , ; : ! ? " '`` and spaces stripped (``"1234567."`` matches ``1234567``).

Multi-answer tasks have one canonical answer string: the items separated by single spaces in a fixed
order (variable tracking: order of assignment along the chain; frequent words: most frequent first),
so "a, b, c" matches "a b c" but "b a c" does not.

``contains_answer(prediction, answer)`` is RULER's string match for models that answer in a sentence
("The special magic number is 1234567."): the reply up to its first end-of-sequence marker, lowercased,
must contain every item of the canonical answer as a whole word (not inside a longer word or number),
in any order. :func:`score_answer` picks the rule by name (``eval.scoring``: ``exact`` | ``contains``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable, Iterable

EOS_MARKERS = ("</s>", "<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<eos>",
               "<end_of_turn>")
_EDGE = " .,;:!?\"'"


def normalize_answer(text: str) -> str:
    """The canonical form compared by :func:`exact_match`."""
    text = text.lstrip()
    cut = len(text)
    for marker in ("\n", "\r", *EOS_MARKERS):
        i = text.find(marker)
        if i != -1:
            cut = min(cut, i)
    text = text[:cut].lower()
    text = re.sub(r"[,;]", " ", text)
    text = re.sub(r"\s+", " ", text)
    return text.strip(_EDGE)


def exact_match(prediction: str, answer: str) -> bool:
    """True when the first line of ``prediction`` equals ``answer`` after :func:`normalize_answer`."""
    return normalize_answer(prediction) == normalize_answer(answer)


def contains_answer(prediction: str, answer: str) -> bool:
    """True when every space-separated item of ``normalize_answer(answer)`` occurs in ``prediction`` (cut at
    the first end-of-sequence marker, lowercased) as a whole word: no letter or digit right before or after."""
    cut = len(prediction)
    for marker in EOS_MARKERS:
        i = prediction.find(marker)
        if i != -1:
            cut = min(cut, i)
    text = prediction[:cut].lower()
    items = normalize_answer(answer).split(" ")
    return all(item and re.search(rf"(?<![0-9a-z]){re.escape(item)}(?![0-9a-z])", text) for item in items)


SCORING_RULES: dict[str, Callable[[str, str], bool]] = {"exact": exact_match, "contains": contains_answer}


def score_answer(prediction: str, answer: str, rule: str = "exact") -> bool:
    """``prediction`` scored against ``answer`` by the rule named ``rule`` (a key of ``SCORING_RULES``)."""
    try:
        return SCORING_RULES[rule](prediction, answer)
    except KeyError:
        raise ValueError(f"unknown scoring rule {rule!r}: one of {', '.join(SCORING_RULES)}") from None


def dataset_hash(prompts: Iterable) -> str:
    """sha256 over each prompt's text and answer, in order (length-prefixed, so unambiguous)."""
    h = hashlib.sha256()
    for p in prompts:
        for part in (p.text, p.answer):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()
