"""Word pools of the synthetic tasks, and a random-number stream that never changes across versions.

Everything here is a pure function of constants: the filler-sentence bank, the pseudo-word pool used
for keys, values, variable names and list words, and the template words. The tiny model's tokenizer
(:mod:`calib.data.tokenizer`) is built from exactly these words, so every synthetic prompt tokenizes
without ``<unk>`` for it; any other tokenizer simply sees ordinary text.

Randomness goes through :class:`StableRng`: raw 64-bit outputs of numpy's PCG64 bit generator (whose
stream numpy keeps stable, unlike the distribution methods of ``numpy.random.Generator``), turned into
floats and integers by our own arithmetic. Prompts, and so ``dataset_hash``, stay the same across numpy
and Python versions.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

import numpy as np

# ---------------------------------------------------------------------------------------------------
# Random numbers


def seed_from(*parts: object) -> int:
    """A 64-bit seed from any parts (joined with '/'), via sha256: distinct parts, distinct streams."""
    key = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")


class StableRng:
    """Version-stable random draws on top of PCG64's raw stream."""

    def __init__(self, seed: int) -> None:
        self._bits = np.random.PCG64(seed)

    def random(self, size: int) -> np.ndarray:
        """``size`` floats in [0, 1) (53-bit)."""
        raw = self._bits.random_raw(size)
        return (raw >> np.uint64(11)).astype(np.float64) * (2.0**-53)

    def integers(self, high: int, size: int) -> np.ndarray:
        """``size`` integers in [0, high)."""
        return np.minimum((self.random(size) * high).astype(np.int64), high - 1)

    def integer(self, high: int) -> int:
        return int(self.integers(high, 1)[0])

    def uniform(self) -> float:
        return float(self.random(1)[0])

    def permutation(self, n: int) -> np.ndarray:
        return np.argsort(self.random(n), kind="stable")

    def sample(self, n: int, k: int) -> np.ndarray:
        """``k`` distinct integers from [0, n) in random order (k <= n)."""
        return self.permutation(n)[:k]


# ---------------------------------------------------------------------------------------------------
# Filler text: a small grammar of plain English sentences (the haystack).

DETERMINERS = (("The", "the"), ("A", "a"), ("Every", "every"), ("One", "one"), ("This", "this"))
ADJECTIVES = (
    "old", "young", "quiet", "bright", "small", "large", "green", "blue", "red", "yellow", "white",
    "dark", "warm", "cold", "busy", "lazy", "brave", "gentle", "clever", "tired", "happy", "calm",
    "strong", "narrow", "wide", "early", "late", "simple", "heavy", "light", "distant", "local",
    "ancient", "modern", "hidden", "open", "empty", "full", "careful", "patient",
)
NOUNS = (
    "fox", "river", "garden", "window", "teacher", "city", "mountain", "letter", "story", "village",
    "market", "bridge", "forest", "kitchen", "painter", "farmer", "ship", "road", "island", "house",
    "child", "doctor", "student", "train", "station", "library", "book", "song", "cloud", "field",
    "horse", "bird", "tree", "lamp", "table", "door", "wall", "boat", "lake", "hill", "street",
    "baker", "sailor", "friend", "neighbor", "dog", "cat", "engine", "clock", "map", "coat", "bell",
    "school", "office", "harbor", "valley", "tower", "wagon", "candle", "mirror",
)
VERBS = (
    "saw", "found", "carried", "painted", "followed", "visited", "watched", "crossed", "built",
    "opened", "closed", "cleaned", "moved", "passed", "reached", "left", "liked", "helped", "called",
    "remembered", "described", "noticed", "joined", "repaired", "bought", "sold", "measured",
    "counted", "praised", "ignored", "greeted", "guarded", "lifted", "pushed", "pulled", "shared",
    "studied", "explored", "admired", "forgot",
)
PREPOSITIONS = ("near", "behind", "beside", "under", "above", "across", "beyond", "around", "past", "inside")
ADVERBS = (
    "slowly", "quickly", "again", "yesterday", "today", "quietly", "gladly", "often", "rarely",
    "twice", "early", "later", "once", "together", "alone", "carefully", "suddenly", "finally",
    "soon", "still",
)
CONNECTIVES = ("and", "while", "because", "before", "after", "then", "so", "but")

SENTENCE_BANK_SIZE = 4096


def _noun_phrase(rng: StableRng, capital: bool) -> str:
    det = DETERMINERS[rng.integer(len(DETERMINERS))][0 if capital else 1]
    if rng.uniform() < 0.6:
        return f"{det} {ADJECTIVES[rng.integer(len(ADJECTIVES))]} {NOUNS[rng.integer(len(NOUNS))]}"
    return f"{det} {NOUNS[rng.integer(len(NOUNS))]}"


def _clause(rng: StableRng, capital: bool) -> str:
    words = [_noun_phrase(rng, capital), VERBS[rng.integer(len(VERBS))], _noun_phrase(rng, False)]
    if rng.uniform() < 0.4:
        words += [PREPOSITIONS[rng.integer(len(PREPOSITIONS))], _noun_phrase(rng, False)]
    if rng.uniform() < 0.4:
        words.append(ADVERBS[rng.integer(len(ADVERBS))])
    return " ".join(words)


@lru_cache(maxsize=1)
def sentence_bank() -> tuple[str, ...]:
    """4096 distinct filler sentences (6-20 words), a pure function of the constants above."""
    rng = StableRng(seed_from("calib-filler-bank", 1))
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < SENTENCE_BANK_SIZE:
        s = _clause(rng, True)
        if rng.uniform() < 0.25:
            s += f" {CONNECTIVES[rng.integer(len(CONNECTIVES))]} {_clause(rng, False)}"
        s += "."
        if s not in seen:
            seen.add(s)
            out.append(s)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------
# Pseudo-words: keys, values, variable names and list words. Two consonant-vowel syllables ("kobe",
# "rulo"), none equal to a filler or template word. Ordered by their sha256 so the pool is fixed.

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
NAME_POOL_SIZE = 3000

# Every word the task templates use (see synthetic.py); the tokenizer gets these too.
TEMPLATE_TEXT = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "The special magic number for is. What is the special magic number for mentioned in the provided "
    "text? Extract the value corresponding to the specified key in the JSON object below. JSON data: "
    "What is the value of the key? Memorize and track the chains of variable assignments hidden in the "
    "following text. VAR = VAR. Find all variables that are assigned the value in the text above. "
    "The variables assigned the value are: Read the following list of words and find the three most "
    "frequent ones. What are the three most frequently appearing words in the list above? "
    "The three most frequent words are: Question: Answer:"
)


def _word_set(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z]+", text))


def reserved_words() -> set[str]:
    """Filler and template words (names must differ from all of them, in any case)."""
    words = {w for pair in DETERMINERS for w in pair} | set(ADJECTIVES) | set(NOUNS) | set(VERBS) | set(PREPOSITIONS)
    words |= set(ADVERBS) | set(CONNECTIVES) | _word_set(TEMPLATE_TEXT)
    return words


@lru_cache(maxsize=1)
def name_pool() -> tuple[str, ...]:
    """3000 distinct lowercase pseudo-words, in a fixed order."""
    reserved = {w.lower() for w in reserved_words()}
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    names = [a + b for a in syllables for b in syllables if a + b not in reserved]
    names.sort(key=lambda w: hashlib.sha256(w.encode()).hexdigest())
    return tuple(names[:NAME_POOL_SIZE])


def all_words() -> list[str]:
    """Every word a synthetic prompt can contain, sorted (the tiny tokenizer's word vocabulary)."""
    words = reserved_words() | set(name_pool())
    for s in sentence_bank():
        words |= _word_set(s)
    return sorted(words)
