"""Natural-text prompts from the book corpus (:mod:`calib.data.corpus`): plain text and needle retrieval
(docs/data.md, Books).

A prompt is a contiguous passage of one book, starting at a paragraph and cut at a sentence end, so
that it has at most ``length`` tokens and one more sentence would not fit. Tasks (:data:`BOOK_TASKS`):

- ``book_text``: the passage alone, no question and no answer (plain long text to calibrate on, as
  SAAP and SALE do); nothing to score, so never an ``eval`` task.
- ``book_needle``: one needle sentence tying a 5-7 digit number to an invented person ("Among the papers
  of Miss Ardley, one number was kept apart from all others: 48213.") at a sentence boundary at a depth
  drawn uniformly from 5-95 % of the passage; the question asks for the number.
- ``book_needle_word`` / ``book_needle_phrase``: the same with a single English word, or a short phrase
  ("a brass telescope"; the answer is the phrase without its article).
- ``book_multineedle``: four number needles, one per quarter of that depth range; one is asked for.

Calibration and evaluation prompts come from disjoint books with their own needle sentences and
questions (:data:`PHRASING`), so a held-out prompt shares neither text nor wording with calibration.
The people, words and nouns occur in no book and no book has a run of 5 digits, so the answer occurs
once in a prompt. Every draw depends only on (seed, task, length, index) (:class:`~calib.data.vocab.StableRng`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from calib.data.corpus import Book, books_for, token_prefix_sums
from calib.data.prompt import Prompt, PromptFormatter
from calib.data.scoring import scoring_rule
from calib.data.synthetic import TASKS
from calib.data.vocab import StableRng, seed_from
from calib.errors import UserError

# The needle kinds are tasks of their own, so a model's kept cells can name the ones it answers densely.
NEEDLE_TASKS: dict[str, tuple[str, int]] = {  # task -> (needle kind, needles in the passage)
    "book_needle": ("number", 1), "book_needle_word": ("word", 1), "book_needle_phrase": ("phrase", 1),
    "book_multineedle": ("number", 4)}
ANSWERED_TASKS = tuple(NEEDLE_TASKS)
BOOK_TASKS: tuple[str, ...] = ("book_text", *ANSWERED_TASKS)
DEPTH_RANGE = (0.05, 0.95)
NUMBER_DIGITS = (5, 6, 7)

TITLES = ("Miss", "Mrs.", "Mr.", "Captain", "Dr.", "Lady", "Colonel", "Admiral")
SURNAMES = (
    "Ardley", "Renwick", "Halloran", "Penwarden", "Tillingham", "Brackwater", "Quennell", "Fothergill",
    "Ashcombe", "Pettigrew", "Wexcombe", "Thistlewood", "Marchbank", "Pendry", "Vosper", "Grimble",
    "Lockhart", "Harrowgate", "Dunmore", "Ravensworth", "Holloway", "Tregarth", "Pilbeam", "Blackmore",
    "Winstanley", "Corbyn", "Ledbury", "Merriweather", "Fairbrass", "Ormsby", "Trelawny", "Calloway",
    "Hartwell", "Quiller", "Burrage", "Colquhoun", "Dimmock", "Farquhar", "Gillray", "Hathersage",
    "Inchbald", "Jessop", "Kimber", "Lumley", "Mowbray", "Nettleship", "Pargeter", "Redfern",
    "Upcott", "Varley", "Whitlock", "Yardley", "Zouche", "Abernethy",
)
WORDS = (
    "volcano", "pineapple", "kangaroo", "tornado", "avalanche", "cinnamon", "galaxy", "dolphin", "lighthouse",
    "tangerine", "blizzard", "meteor", "cactus", "penguin", "walrus", "glacier", "iceberg", "mango",
    "coconut", "peppermint", "acorn", "sparrow", "heron", "pelican", "flamingo", "giraffe", "tiger",
    "panther", "badger", "otter", "squirrel", "hedgehog", "lizard", "tortoise", "octopus", "lobster",
    "nutmeg", "juniper", "almond", "raspberry", "comet", "nebula", "rainbow", "canyon", "windmill",
    "waterfall", "quince",
)
PHRASE_NOUNS = (
    "telescope", "thimble", "teapot", "harpoon", "trumpet", "sextant", "astrolabe", "thermometer",
    "hourglass", "sundial", "abacus", "inkwell", "pendulum", "bicycle", "sleigh", "gondola", "clarinet",
    "mandolin", "accordion", "banjo", "cello", "parachute", "balloon", "toboggan", "carousel", "locomotive",
)
PHRASE_ADJECTIVES = ("brass", "silver", "copper", "pewter", "ivory", "ebony", "wooden", "crimson", "green",
                     "scarlet", "enamelled", "painted", "tiny", "broken", "old", "iron")


@dataclass(frozen=True)
class Phrasing:
    """One pool's wording for a needle kind: needle sentences (``{key}``, ``{value}``) and questions,
    each a ``(question, answer prefix)`` pair (``{key}``)."""

    needles: tuple[str, ...]
    questions: tuple[tuple[str, str], ...]


PHRASING: dict[str, dict[str, Phrasing]] = {
    "calibration": {
        "number": Phrasing(
            ("Among the papers of {key}, one number was kept apart from all others: {value}.",
             "{key} had the number {value} engraved on the inside of a silver ring.",
             "The number that {key} never allowed anyone to forget was {value}."),
            (("Which number is associated with {key}?", "The number associated with {key} is"),
             ("What number did the text mention in connection with {key}?", "The number connected with {key} is"),
             ("What is the number that belongs to {key}?", "The number that belongs to {key} is"))),
        "word": Phrasing(
            ("The secret word of {key} was {value}.",
             "{key} chose {value} as the password for the garden gate.",
             "Whenever a word was wanted for a game, {key} proposed {value}."),
            (("Which word is associated with {key}?", "The word associated with {key} is"),
             ("What word did the text mention in connection with {key}?", "The word connected with {key} is"),
             ("What is the word that belongs to {key}?", "The word that belongs to {key} is"))),
        "phrase": Phrasing(
            ("{key} kept {value} in the top drawer of a writing desk.",
             "The only thing {key} brought back from the voyage was {value}.",
             "Hidden behind the woodpile, {key} had left {value}."),
            (("Which object is associated with {key}?", "The object associated with {key} is"),
             ("What object did the text mention in connection with {key}?", "The object connected with {key} is"),
             ("What is the object that belongs to {key}?", "The object that belongs to {key} is"))),
    },
    "evaluation": {
        "number": Phrasing(
            ("In a locked drawer, {key} kept a card that bore the number {value}.",
             "Everyone at the coaching inn knew that {key} counted {value} a lucky number.",
             "On the flyleaf of an old almanac, {key} had written the number {value}."),
            (("According to the passage, what number goes with {key}?", "The number going with {key} is"),
             ("Recall the number tied to {key}. What is it?", "The number tied to {key} is"),
             ("What figure does the story give for {key}?", "The figure given for {key} is"))),
        "word": Phrasing(
            ("On a slip of paper in the desk of {key} stood a single word: {value}.",
             "The word that {key} whispered to the gardener at dawn was {value}.",
             "At every charade, {key} insisted on the word {value}."),
            (("According to the passage, what word goes with {key}?", "The word going with {key} is"),
             ("Recall the word tied to {key}. What is it?", "The word tied to {key} is"),
             ("Which single word does the story attach to {key}?", "The single word attached to {key} is"))),
        "phrase": Phrasing(
            ("On the windowsill of the library, {key} once set down {value}.",
             "The parcel addressed to {key} contained nothing but {value}.",
             "In the attic, {key} had long ago found {value}."),
            (("According to the passage, what object goes with {key}?", "The object going with {key} is"),
             ("Recall the object tied to {key}. What is it?", "The object tied to {key} is"),
             ("Which thing does the story place in the keeping of {key}?", "In the keeping of {key} is"))),
    },
}


# --------------------------------------------------------------------------------------------------
# Draws


@dataclass(frozen=True)
class Needle:
    key: str
    value: str     # the answer: digits, a word, or one or two words (a phrase's article stays in the sentence)
    sentence: str
    depth: float   # fraction of the passage's tokens before it


def _keys(rng: StableRng, count: int) -> list[str]:
    """``count`` people with distinct surnames."""
    return [f"{TITLES[rng.integer(len(TITLES))]} {SURNAMES[int(i)]}" for i in rng.sample(len(SURNAMES), count)]


def _values(rng: StableRng, kind: str, count: int) -> list[str]:
    """``count`` distinct values of ``kind``."""
    if kind == "word":
        return [WORDS[int(i)] for i in rng.sample(len(WORDS), count)]
    if kind == "phrase":
        phrases = []
        for i in rng.sample(len(PHRASE_NOUNS), count):
            words = [PHRASE_NOUNS[int(i)]]
            if rng.uniform() < 0.5:
                words.insert(0, PHRASE_ADJECTIVES[rng.integer(len(PHRASE_ADJECTIVES))])
            phrases.append(("an " if words[0][0] in "aeiou" else "a ") + " ".join(words))
        return phrases
    digits = NUMBER_DIGITS[rng.integer(len(NUMBER_DIGITS))]
    out: list[str] = []
    while len(out) < count:
        value = str(10 ** (digits - 1) + rng.integer(9 * 10 ** (digits - 1)))
        if value not in out:
            out.append(value)
    return out


def draw_needles(rng: StableRng, purpose: str, kind: str, count: int) -> tuple[list[Needle], Needle, str, str]:
    """``count`` needles of ``kind``, by increasing depth (one per equal share of :data:`DEPTH_RANGE`),
    the asked one, and its question and answer prefix in ``purpose``'s wording."""
    phrasing = PHRASING[purpose][kind]
    keys, values = _keys(rng, count), _values(rng, kind, count)
    lo, hi = DEPTH_RANGE
    needles = []
    for k, (key, value) in enumerate(zip(keys, values)):
        template = phrasing.needles[rng.integer(len(phrasing.needles))]
        depth = lo + (hi - lo) * (k + rng.uniform()) / count
        answer = value.split(" ", 1)[1] if kind == "phrase" else value  # "a brass telescope" -> "brass telescope"
        needles.append(Needle(key, answer, template.format(key=key, value=value), depth))
    question, prefix = phrasing.questions[rng.integer(len(phrasing.questions))]
    asked = needles[rng.integer(count)]
    return needles, asked, question.format(key=asked.key), prefix.format(key=asked.key)


# --------------------------------------------------------------------------------------------------
# Passages and length fitting


def draw_start(rng: StableRng, books: list[Book], sums: list[np.ndarray], target: int,
               purpose: str) -> tuple[int, int]:
    """``(book index, first sentence)``: a paragraph start drawn uniformly among those of every book that
    leave ``target`` tokens of text after them."""
    eligible = [np.flatnonzero(b.para_start & (cum[-1] - cum[:-1] >= target)) for b, cum in zip(books, sums)]
    total = sum(len(e) for e in eligible)
    if total == 0:
        longest = max(int(cum[-1]) for cum in sums)
        raise UserError(f"length {target} is longer than every {purpose} book (the longest has {longest} "
                        f"tokens with this tokenizer); use data.lengths <= {longest - longest // 10}")
    r = rng.integer(total)
    for i, starts in enumerate(eligible):
        if r < len(starts):
            return i, int(starts[r])
        r -= len(starts)
    raise AssertionError("unreachable")


def needle_slots(book: Book, cum: np.ndarray, s: int, e: int, depths: list[float]) -> list[int]:
    """For each depth, the sentence ``j`` in ``[s, e - 1)`` that the needle follows: the insertable
    boundary whose token position in the passage is nearest ``depth`` of its length."""
    boundaries = np.arange(s, max(s + 1, e - 1))
    allowed = boundaries[book.insertable[boundaries]]
    candidates = allowed if len(allowed) else boundaries
    positions = (cum[candidates + 1] - cum[s]) / max(1, int(cum[e] - cum[s]))
    return [int(candidates[int(np.argmin(np.abs(positions - d)))]) for d in depths]


def fit_passage(make: Callable[[int], tuple[str, list[int]]], cum: np.ndarray, s: int, overhead: int,
                target: int, task: str) -> tuple[str, list[int]]:
    """The prompt ``make(e)`` (text, ids) of the largest passage end ``e`` (sentences ``[s, e)``) with at
    most ``target`` tokens. The prefix sums give the first guess and each exact count corrects the next;
    stops once ``e`` fits and ``e + 1`` does not (or the book ends): typically two tokenizations."""
    measured: dict[int, tuple[str, list[int]]] = {}
    lo, hi = s, len(cum)  # lo: largest end known to fit (s: none yet); hi: smallest end known to overshoot
    error = 0
    while hi - lo > 1:
        guess = int(np.searchsorted(cum, cum[s] + target - overhead - error, side="right")) - 1
        e = min(max(guess, lo + 1), hi - 1)
        measured[e] = make(e)
        count = len(measured[e][1])
        error = count - overhead - int(cum[e] - cum[s])
        lo, hi = (e, hi) if count <= target else (lo, e)
    if lo == s:
        shortest = len(measured[s + 1][1])
        raise UserError(f"length {target} is too short for task {task!r}: its shortest prompt has {shortest} "
                        f"tokens with this tokenizer; use data.lengths >= {shortest}")
    return measured[lo]


def book_prompt(task: str, length: int, seed: int, index: int, purpose: str, fmt: PromptFormatter,
                books: list[Book], sums: list[np.ndarray], scoring: Any) -> Prompt:
    """Prompt ``index`` of (``task``, ``length``) from ``seed``, drawn from ``books`` (``sums``: their
    :func:`~calib.data.corpus.token_prefix_sums`)."""
    rng = StableRng(seed_from("calib-books", seed, task, length, index))
    b, s = draw_start(rng, books, sums, length, purpose)
    book, cum = books[b], sums[b]
    if task == "book_text":
        def make(e: int) -> tuple[str, list[int]]:
            text = fmt.wrap_user_text(book.passage(s, e))
            return text, fmt.encode(text)

        answer, overhead = "", len(fmt.encode(fmt.wrap_user_text("")))
    else:
        needles, asked, question, prefix = draw_needles(rng, purpose, *NEEDLE_TASKS[task])

        def make(e: int) -> tuple[str, list[int]]:
            inserts: dict[int, list[str]] = {}
            for j, needle in zip(needle_slots(book, cum, s, e, [n.depth for n in needles]), needles):
                inserts.setdefault(j, []).append(needle.sentence)
            text = fmt.render(book.passage(s, e, inserts), question, prefix)
            return text, fmt.encode(text)

        answer = asked.value
        overhead = len(fmt.encode(fmt.render("", question, prefix)))
        overhead += sum(len(fmt.tokenizer(" " + n.sentence, add_special_tokens=False)["input_ids"]) for n in needles)
    text, ids = fit_passage(make, cum, s, overhead, length, task)
    return Prompt(prompt_id=f"{task}-{length}-s{seed}-{index}", task=task, length=length, text=text, answer=answer,
                  input_ids=ids, scoring=scoring_rule(scoring, task))


def book_prompts(tokenizer: Any, jobs: list[tuple[str, int, int]], *, seed: int, purpose: str,
                 chat_template: bool | None = None, scoring: Any = None) -> list[Prompt]:
    """One prompt per ``(task, length, index)`` of ``jobs``, from ``purpose``'s books."""
    fmt = PromptFormatter(tokenizer, chat_template)
    books = books_for(purpose)
    sums = [token_prefix_sums(b, tokenizer) for b in books]
    return [book_prompt(t, n, seed, i, purpose, fmt, books, sums, scoring) for t, n, i in jobs]


# --------------------------------------------------------------------------------------------------
# Settings


def check_book_settings(tasks: list[str], lengths: list[Any], num_prompts: Any, share: Any,
                        synthetic_tasks: list[str]) -> None:
    """One-line UserErrors for a ``data=books`` config that cannot give prompts."""
    unknown = [t for t in tasks if t not in BOOK_TASKS]
    if unknown:
        hint = "; synthetic tasks go in data.synthetic_tasks" if unknown[0] in TASKS else ""
        raise UserError(f"unknown task {unknown[0]!r} in data.tasks; book tasks: {', '.join(BOOK_TASKS)}{hint}")
    if not tasks or not lengths or num_prompts is None or int(num_prompts) < 1:
        raise UserError(f"empty dataset: data.tasks={tasks}, data.lengths={lengths}, "
                        f"data.num_prompts={num_prompts}; each needs at least one entry / 1")
    bad = [n for n in lengths if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise UserError(f"data.lengths must be positive integers (got {bad[0]!r})")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise UserError(f"data.synthetic_share must lie in [0, 1] (got {share!r}): the share of calibration "
                        f"prompts replaced by synthetic-task prompts")
    unknown = [t for t in synthetic_tasks if t not in TASKS]
    if unknown or (share > 0 and not synthetic_tasks):
        raise UserError(f"data.synthetic_tasks must name synthetic tasks ({', '.join(TASKS)}) when "
                        f"data.synthetic_share > 0 (got {synthetic_tasks})")
