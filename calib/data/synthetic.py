"""RULER-style synthetic long-context tasks, generated for any tokenizer at any target length (docs/data.md).

Each task is a pure function ``(seed, n) -> TaskInstance`` where ``n`` counts the context's filler
units (sentences, key-value pairs or list words). :func:`fit_to_length` searches ``n`` so that the
formatted prompt, measured with the real tokenizer, is at most the target length and as close to it
as one unit allows. Draws that do not depend on ``n`` (keys, values, depths) come first from the
stream, so the search changes only the amount of filler. Tasks (``queries[0]`` is the prompt's
question; further queries on the same context are extra training targets of ``scripts/train_tiny.py``):

- ``niah_single``: one needle "The special magic number for <key> is <7 digits>." in filler
  sentences; answer: the 7-digit number. ``niah_multikey``: four such needles; one is asked for.
- ``kv_retrieval``: a JSON object of pseudo-word keys and values (InfiniteBench Retrieve.KV);
  answer: the value of one key. The asked key (and its value) occur exactly once.
- ``variable_tracking``: two interleaved chains ``VAR a = 12345.``, ``VAR b = VAR a.``, ... (5
  variables, 4 hops each, different values) hidden in filler; answer: the 5 names of the asked chain,
  canonical order = order of assignment along the chain, separated by single spaces.
- ``frequent_words``: a list of pseudo-words where three words occur far more often than any other,
  with distinct counts; answer: the three words, canonical order = most frequent first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from calib.data.prompt import PromptFormatter
from calib.data.vocab import StableRng, name_pool, sentence_bank
from calib.errors import UserError

TASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "kv_retrieval", "variable_tracking",
                          "frequent_words")

NIAH_DIGITS = 7
MULTIKEY_NEEDLES = 4
VT_VARIABLES = 5
VT_CHAINS = 2
VT_DIGITS = 5
FW_TOP = 3


@dataclass(frozen=True)
class Query:
    """A question about the context. ``completion`` is the exact text after ``prefix`` (answer with its
    leading separator); ``evidence`` are the context substrings that hold the answer."""

    question: str
    prefix: str
    answer: str
    completion: str
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskInstance:
    task: str
    context: str
    queries: tuple[Query, ...]


@dataclass(frozen=True)
class FittedInstance:
    instance: TaskInstance
    text: str
    input_ids: list[int]
    units: int


def _number(rng: StableRng, digits: int) -> str:
    low = 10 ** (digits - 1)
    return str(low + rng.integer(9 * low))


def _distinct_numbers(rng: StableRng, count: int, digits: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        v = _number(rng, digits)
        if v not in out:
            out.append(v)
    return out


def _insert(sentences: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert ``items`` between sentences at fractional ``depths`` (stable for equal positions)."""
    n = len(sentences)
    slots = sorted(((min(n, round(d * n)), k) for k, d in enumerate(depths)))
    out: list[str] = []
    prev = 0
    for pos, k in slots:
        out += sentences[prev:pos]
        out.append(items[k])
        prev = pos
    return out + sentences[prev:]


def _filler(rng: StableRng, n: int) -> list[str]:
    bank = sentence_bank()
    return [bank[i] for i in rng.integers(len(bank), n)] if n else []


# --------------------------------------------------------------------------------------------------
# Tasks


NIAH_INTRO = ("Some special magic numbers are hidden within the following text. "
              "Make sure to memorize them.")


def _niah(seed: int, n: int, needles: int, task: str) -> TaskInstance:
    rng = StableRng(seed)
    names = name_pool()
    keys = [names[i] for i in rng.sample(len(names), needles)]
    values = _distinct_numbers(rng, needles, NIAH_DIGITS)
    depths = [float(d) for d in rng.random(needles)]
    sentences = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values)]
    body = _insert(_filler(rng, n), sentences, depths)
    queries = tuple(
        Query(question=f"What is the special magic number for {k} mentioned in the provided text?",
              prefix=f"The special magic number for {k} is", answer=v, completion=f" {v}",
              evidence=(s,))
        for k, v, s in zip(keys, values, sentences))
    return TaskInstance(task, f"{NIAH_INTRO}\n\n{' '.join(body)}", queries)


def niah_single(seed: int, n: int) -> TaskInstance:
    return _niah(seed, n, 1, "niah_single")


def niah_multikey(seed: int, n: int) -> TaskInstance:
    return _niah(seed, n, MULTIKEY_NEEDLES, "niah_multikey")


KV_INTRO = "Extract the value corresponding to the specified key in the JSON object below."
KV_EXTRA_QUERIES = 15


def kv_retrieval(seed: int, n: int) -> TaskInstance:
    """``n`` pairs; all words distinct while the pool allows, else only the asked pair is unique."""
    rng = StableRng(seed)
    names = name_pool()
    perm = [names[i] for i in rng.permutation(len(names))]
    where = rng.integer(max(n, 1))
    n = max(n, 1)
    rest = perm[2:]  # perm[0], perm[1]: the asked key and its value, used nowhere else
    if 2 * n <= len(rest):
        keys, values = rest[:n], rest[n:2 * n]
    else:
        draws = rng.integers(len(rest), 2 * n)
        keys = [rest[i] for i in draws[:n]]
        values = [rest[i] for i in draws[n:]]
    keys[where], values[where] = perm[0], perm[1]
    lines = [f'"{k}": "{v}"' for k, v in zip(keys, values)]
    counts: dict[str, int] = {}
    for w in keys + values:
        counts[w] = counts.get(w, 0) + 1
    others = [int(i) for i in rng.permutation(n) if int(i) != where and counts[keys[int(i)]] == 1]
    asked = [where] + others[:KV_EXTRA_QUERIES]
    queries = tuple(
        Query(question=f'What is the value of the key "{keys[i]}"?', prefix=f'"{keys[i]}": "',
              answer=values[i], completion=values[i], evidence=(lines[i],))
        for i in asked)
    context = f"{KV_INTRO}\n\nJSON data:\n{{" + ",\n ".join(lines) + "}"
    return TaskInstance("kv_retrieval", context, queries)


VT_INTRO = "Memorize and track the chains of variable assignments hidden in the following text."


def variable_tracking(seed: int, n: int) -> TaskInstance:
    """Two interleaved chains of ``VT_VARIABLES`` names (different values): following one chain takes
    multi-hop lookups, not just listing every ``VAR`` in order. ``queries[1]`` asks for the other one."""
    rng = StableRng(seed)
    names = name_pool()
    picked = [names[i] for i in rng.sample(len(names), VT_CHAINS * VT_VARIABLES)]
    chains = [picked[c * VT_VARIABLES:(c + 1) * VT_VARIABLES] for c in range(VT_CHAINS)]
    values = _distinct_numbers(rng, VT_CHAINS, VT_DIGITS)
    depths = sorted(float(d) for d in rng.random(VT_CHAINS * VT_VARIABLES))
    owner = rng.permutation(VT_CHAINS * VT_VARIABLES)  # slot -> chain, in order within each chain
    items, item_depths, statements = [], [], []
    for c, (chain, value) in enumerate(zip(chains, values)):
        slots = sorted(int(s) for s in owner[c * VT_VARIABLES:(c + 1) * VT_VARIABLES])
        lines = [f"VAR {chain[0]} = {value}."]
        lines += [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, VT_VARIABLES)]
        items += lines
        item_depths += [depths[s] for s in slots]
        statements.append(tuple(lines))
    body = _insert(_filler(rng, n), items, item_depths)
    queries = tuple(
        Query(question=f"Find all variables that are assigned the value {value} in the text above.",
              prefix=f"The variables assigned the value {value} are:", answer=" ".join(chain),
              completion=" " + " ".join(chain), evidence=lines)
        for chain, value, lines in zip(chains, values, statements))
    return TaskInstance("variable_tracking", f"{VT_INTRO}\n\n{' '.join(body)}", queries)


FW_INTRO = "Read the following list of words and find the three most frequent ones."


def frequent_word_counts(n: int, pool: int) -> tuple[int, int, int]:
    """Counts of the three frequent words in a list of ``n`` words: strictly decreasing and above
    ``ceil(n / pool)``, the most any other word can occur."""
    floor_count = math.ceil(n / pool)
    c3 = max(floor_count + 2, round(0.03 * n))
    step = max(2, round(0.015 * n))
    return c3 + 2 * step, c3 + step, c3


def frequent_words(seed: int, n: int) -> TaskInstance:
    rng = StableRng(seed)
    names = name_pool()
    perm = [names[i] for i in rng.permutation(len(names))]
    top, noise_pool = perm[:FW_TOP], perm[FW_TOP:]
    counts = frequent_word_counts(n, len(noise_pool))
    n_noise = max(0, n - sum(counts))
    words = [w for w, c in zip(top, counts) for _ in range(c)]
    words += [noise_pool[i % len(noise_pool)] for i in range(n_noise)]
    words = [words[i] for i in rng.permutation(len(words))]
    answer = " ".join(top)
    query = Query(question="What are the three most frequently appearing words in the list above?",
                  prefix="The three most frequent words are:", answer=answer, completion=f" {answer}")
    return TaskInstance("frequent_words", f"{FW_INTRO}\n\n{' '.join(words)}", (query,))


TASK_FUNCTIONS: dict[str, Callable[[int, int], TaskInstance]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "kv_retrieval": kv_retrieval,
    "variable_tracking": variable_tracking,
    "frequent_words": frequent_words,
}
MIN_UNITS = {"niah_single": 0, "niah_multikey": 0, "kv_retrieval": 1, "variable_tracking": 0,
             "frequent_words": 20}  # fewest units of a valid instance (20 words hold the 7+5+3 frequent)


# --------------------------------------------------------------------------------------------------
# Length fitting


def fit_to_length(task: str, seed: int, target: int, formatter: PromptFormatter) -> FittedInstance:
    """The instance of ``task`` whose prompt has the most filler with ``len(input_ids) <= target``.

    Secant steps on the (near-linear) token count, bisection when they stall; stops once one more
    unit would overshoot. Typically one short probe and one or two full-length tokenizations.
    """
    make = TASK_FUNCTIONS[task]
    cache: dict[int, FittedInstance] = {}

    def measure(n: int) -> FittedInstance:
        if n not in cache:
            inst = make(seed, n)
            text = formatter.render(inst.context, inst.queries[0].question, inst.queries[0].prefix)
            cache[n] = FittedInstance(inst, text, formatter.encode(text), n)
        return cache[n]

    lo0 = MIN_UNITS[task]
    base = len(measure(lo0).input_ids)
    if base > target:
        raise UserError(f"length {target} is too short for task {task!r}: its shortest prompt has "
                        f"{base} tokens with this tokenizer; use data.lengths >= {base}")
    lo, hi = lo0, None  # largest n known to fit, smallest n known to overshoot
    n = lo0 + 32        # probe for the tokens per unit
    for _ in range(40):
        if hi is not None and hi - lo <= 1:
            break
        n = max(n, lo + 1) if hi is None else min(max(n, lo + 1), hi - 1)
        count = len(measure(n).input_ids)
        per_unit = max(0.25, (count - base) / (n - lo0))
        estimate = lo0 + int((target - base) / per_unit)
        if count > target:
            hi, n = n, min(estimate, n - 1)
        else:
            lo = n
            if target - count < per_unit:
                break
            n = max(estimate, n + 1)
    return measure(lo)

