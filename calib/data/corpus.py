"""The book corpus: six public-domain Jane Austen novels shipped gzipped in ``artifacts/texts/austen/``.

:data:`SPLIT` is the one statement of which books calibrate and which are held out; no book is on both
sides, so no passage is either. Each file's decompressed text is checked against :data:`BOOKS`'s
sha256 when first read (``scripts/extract_austen_text.py`` rebuilds the files and prints the hashes).

A book is parsed once into sentences: paragraphs are separated by blank lines, their hard-wrapped lines
joined with single spaces, and split after ``. ! ?`` (and any closing quote) before a capital letter,
except after a title such as "Mr.". :attr:`Book.text` is the paragraphs joined by blank lines, so a
passage of sentences ``[s, e)`` is the slice ``text[starts[s]:ends[e - 1]]``. A needle may follow a
sentence outside an open quotation (an even number of ``"`` so far in its paragraph) or at a
paragraph's end, so it never lands inside a character's speech.

Token counts per sentence (with the space or blank line before it) are cached per tokenizer: their
prefix sums estimate any passage's length without tokenizing it.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import weakref
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from calib.errors import UserError
from calib.paths import project_root


@dataclass(frozen=True)
class BookFile:
    title: str
    sha256: str  # of the decompressed UTF-8 text


BOOKS: dict[str, BookFile] = {  # file stem (the janeaustenr object name) -> title, text sha256
    "sensesensibility": BookFile("Sense and Sensibility",
                                 "105e1651fe93bed7130078578efd31e0c557d68667ba672ddc876f735b30fe09"),
    "mansfieldpark": BookFile("Mansfield Park", "98bc90519cdf4ef663ad7de2734bb529435ef24f7abbde6bb1a50898871dafe9"),
    "emma": BookFile("Emma", "7c67b5985c6d0de1efaeb5d342d52cb82c38083c40e2295129e30e87ee690ebe"),
    "prideprejudice": BookFile("Pride and Prejudice",
                               "dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d"),
    "northangerabbey": BookFile("Northanger Abbey", "51f91bbe0517db8e65cff009b097ce0a1836124c4e0532ac19e6c0cad982abed"),
    "persuasion": BookFile("Persuasion", "8061549557aebd2fd6e353d18d9197cb707029112bd52d4d8b174583a925848a"),
}

SPLIT: dict[str, tuple[str, ...]] = {
    "calibration": ("sensesensibility", "mansfieldpark", "emma"),
    "evaluation": ("prideprejudice", "northangerabbey", "persuasion"),
}


def texts_dir() -> Path:
    """Where the ``<book>.txt.gz`` files live."""
    return project_root() / "artifacts" / "texts" / "austen"


def read_book(name: str) -> str:
    """The verified text of book ``name`` (a key of :data:`BOOKS`); a one-line UserError when its file is
    missing, unreadable or not the shipped text."""
    path = texts_dir() / f"{name}.txt.gz"
    try:
        st = path.stat()
    except OSError:
        raise UserError(f"book text {path} is missing: rebuild it with scripts/extract_austen_text.py "
                        f"(see artifacts/texts/README.md)") from None
    return _verified_text(str(path), st.st_mtime_ns, st.st_size, name)


@lru_cache(maxsize=16)
def _verified_text(path: str, _mtime_ns: int, _size: int, name: str) -> str:
    fix = "restore it from git or rebuild it with scripts/extract_austen_text.py"
    try:
        data = gzip.decompress(Path(path).read_bytes())
    except (OSError, EOFError, zlib.error) as exc:
        raise UserError(f"book text {path} is corrupt ({type(exc).__name__}); {fix}") from None
    if hashlib.sha256(data).hexdigest() != BOOKS[name].sha256:
        raise UserError(f"book text {path} is not the shipped {BOOKS[name].title} (sha256 differs); {fix}")
    return data.decode("utf-8")


# --------------------------------------------------------------------------------------------------
# Parsing


_SENTENCE_END = re.compile(r"[.!?][\"')\]_]*(?= [\"'(\[_]*[A-Z])")
_TITLE_END = re.compile(r"(?:^|[\s\"'(])(?:Mr|Mrs|Dr|St|Messrs|Col|Capt|Rev)\.$")


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph whose whitespace is single spaces; ``" ".join`` gives it back."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(paragraph):
        piece = paragraph[start:m.end()]
        if not _TITLE_END.search(piece):
            out.append(piece)
            start = m.end() + 1  # the one space between sentences
    out.append(paragraph[start:])
    return out


@dataclass(frozen=True)
class Book:
    """A parsed book: ``sentences[j]`` is ``text[starts[j]:ends[j]]``; ``para_start[j]``: sentence ``j``
    opens a paragraph; ``insertable[j]``: a needle may follow sentence ``j`` (module docstring)."""

    name: str
    text: str
    sentences: tuple[str, ...]
    starts: np.ndarray      # [S] int64
    ends: np.ndarray        # [S] int64
    para_start: np.ndarray  # [S] bool
    insertable: np.ndarray  # [S] bool

    def passage(self, s: int, e: int, inserts: dict[int, list[str]] | None = None) -> str:
        """Sentences ``[s, e)`` as they stand in the book, each string of ``inserts[j]`` added after
        sentence ``j`` (``s <= j < e``) with one space before it."""
        pieces, pos = [], int(self.starts[s])
        for j in sorted(inserts or {}):
            end = int(self.ends[j])
            pieces.append(self.text[pos:end])
            pieces += [" " + t for t in inserts[j]]
            pos = end
        pieces.append(self.text[pos:int(self.ends[e - 1])])
        return "".join(pieces)


def parse_book(name: str, raw: str) -> Book:
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", raw)]
    sentences: list[str] = []
    starts, para_start, insertable = [], [], []
    offset = 0
    for para in (p for p in paragraphs if p):
        pos = 0
        split = split_sentences(para)
        for k, sentence in enumerate(split):
            starts.append(offset + pos)
            pos += len(sentence)
            sentences.append(sentence)
            para_start.append(k == 0)
            insertable.append(k == len(split) - 1 or para[:pos].count('"') % 2 == 0)
            pos += 1
        offset += len(para) + 2
    text = "\n\n".join(p for p in paragraphs if p)
    start_arr = np.asarray(starts, dtype=np.int64)
    return Book(name, text, tuple(sentences), start_arr, start_arr + np.asarray([len(t) for t in sentences]),
                np.asarray(para_start, dtype=bool), np.asarray(insertable, dtype=bool))


@lru_cache(maxsize=8)
def _parsed(name: str, text_sha: str) -> Book:
    return parse_book(name, read_book(name))


def load_book(name: str) -> Book:
    """The parsed, verified book ``name``."""
    if name not in BOOKS:
        raise ValueError(f"unknown book {name!r}; books: {', '.join(BOOKS)}")
    read_book(name)  # verify the file now, even when its parse is cached
    return _parsed(name, BOOKS[name].sha256)


def books_for(purpose: str) -> list[Book]:
    """The parsed books of ``purpose`` (``calibration`` or ``evaluation``), in :data:`SPLIT` order."""
    return [load_book(name) for name in SPLIT[purpose]]


# --------------------------------------------------------------------------------------------------
# Token counts


_TOKEN_SUMS: "weakref.WeakKeyDictionary[Any, dict[str, np.ndarray]]" = weakref.WeakKeyDictionary()
_BATCH = 4096


def token_prefix_sums(book: Book, tokenizer: Any) -> np.ndarray:
    """``[S + 1]`` int64: ``cum[j]`` tokens precede sentence ``j`` (each sentence counted with the blank
    line or space before it, no special tokens); an estimate of ``len(tokenize(passage))``."""
    per_tok = _TOKEN_SUMS.setdefault(tokenizer, {})
    if book.name not in per_tok:
        seps = np.where(book.para_start, "\n\n", " ")
        pieces = [("" if j == 0 else str(seps[j])) + s for j, s in enumerate(book.sentences)]
        counts: list[int] = []
        for i in range(0, len(pieces), _BATCH):
            ids = tokenizer(pieces[i:i + _BATCH], add_special_tokens=False, verbose=False)["input_ids"]
            counts += [len(x) for x in ids]
        per_tok[book.name] = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    return per_tok[book.name]
