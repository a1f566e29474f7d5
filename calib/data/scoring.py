"""Answer scoring (exact match or contains) and the content hash of a prompt set (docs/data.md, Scoring).

Each prompt carries its task's rule (``Prompt.scoring``, from ``data.scoring``); :func:`is_correct`
applies it:

* ``exact_match`` (:func:`exact_match`) — the first line of the output equals the answer, both in the
  canonical form of :func:`normalize_answer`; the rule of the synthetic tasks, whose answers the tiny
  model emits exactly;
* ``contains`` (:func:`contains_answer`) — every item of the answer occurs anywhere in the output, in
  any order, as a whole word (RULER's string match: a chat model may wrap the answer in a sentence).

Multi-answer tasks have one canonical answer string: the items separated by single spaces in a fixed
order (variable tracking: order of assignment along the chain; frequent words: most frequent first),
so "a, b, c" matches "a b c" but "b a c" does not.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Mapping

from calib.errors import UserError

EOS_MARKERS = ("</s>", "<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<eos>",
               "<end_of_turn>")
_EDGE = " .,;:!?\"'"
SCORING_RULES = ("exact_match", "contains")


def normalize_answer(text: str) -> str:
    """The canonical form compared by :func:`exact_match`:

    1. leading whitespace dropped, then the text cut at the first newline or end-of-sequence marker
       (:data:`EOS_MARKERS`): the answer is the first line of the reply;
    2. lowercased; commas and semicolons become spaces; runs of whitespace become one space;
    3. leading/trailing ``. , ; : ! ? " '`` and spaces stripped (``"1234567."`` matches ``1234567``).
    """
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
    the first end-of-sequence marker, lowercased) as a whole word — no letter or digit right before or
    after — in any order (RULER's string match over the answer's items, without its substring false
    positives: "2715087" is not in "12715087"). An empty answer never matches."""
    cut = len(prediction)
    for marker in EOS_MARKERS:
        i = prediction.find(marker)
        if i != -1:
            cut = min(cut, i)
    text = prediction[:cut].lower()
    items = [item for item in normalize_answer(answer).split(" ") if item]
    return bool(items) and all(re.search(rf"(?<![0-9a-z]){re.escape(item)}(?![0-9a-z])", text) for item in items)


def is_correct(prediction: str, prompt: Any) -> bool:
    """``prediction`` scored against ``prompt.answer`` by the prompt's rule (``prompt.scoring``)."""
    rule = getattr(prompt, "scoring", "exact_match")
    if rule == "contains":
        return contains_answer(prediction, prompt.answer)
    if rule == "exact_match":
        return exact_match(prediction, prompt.answer)
    raise ValueError(f"unknown scoring rule {rule!r}; one of {SCORING_RULES}")


def scoring_rule(setting: Any, task: str) -> str:
    """The rule of ``task`` from ``data.scoring``: one rule for every task, or ``{task: rule}`` (tasks not
    named, and a null setting, use exact_match); an unknown rule is a one-line UserError."""
    rule = setting.get(task, "exact_match") if isinstance(setting, Mapping) else (setting or "exact_match")
    if rule not in SCORING_RULES:
        raise UserError(f"data.scoring must be {' or '.join(SCORING_RULES)} (or a map task -> rule), got {rule!r}")
    return str(rule)


def dataset_hash(prompts: Iterable) -> str:
    """sha256 over each prompt's text and answer, in order (length-prefixed, so unambiguous)."""
    h = hashlib.sha256()
    for p in prompts:
        for part in (p.text, p.answer):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()
