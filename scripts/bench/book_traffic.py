"""A stand-in for a user's own traffic, for ``bench_serving.py --prompts``: passages of the shipped novel
(*Persuasion*, a held-out book that no calibration reads) of lengths spread log-uniformly over a range of
words, each followed by a request of the kind a reader sends about a text (summarise, who, why, quote).

    python scripts/bench/book_traffic.py traffic.jsonl --prompts 48 --words 150,5000 --seed 0

A passage starts at a seeded paragraph and ends at the paragraph break that first reaches its length.
No answers: the traffic row compares the method's continuations with dense's, which needs none."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from calib.perplexity import real_text_path  # noqa: E402

REQUESTS = (
    "Summarise the passage above in two sentences.",
    "Who speaks most in the passage above, and what do they want?",
    "What does the passage above tell us about Anne Elliot's feelings?",
    "Quote the sentence of the passage above that you find most important, and say why.",
    "List the people named in the passage above.",
    "Why does the passage above end as it does?",
)


def paragraphs(text: str) -> list[str]:
    """The text's paragraphs (blank-line separated), each on one line, headings and empty ones dropped."""
    out = []
    for block in text.split("\n\n"):
        para = " ".join(block.split())
        if len(para.split()) >= 8:  # chapter headings and title lines are shorter
            out.append(para)
    return out


def passage(paras: list[str], start: int, words: int) -> str:
    """Paragraphs from ``start`` until the first break at or past ``words`` words (or the text's end)."""
    taken, count = [], 0
    for para in paras[start:]:
        taken.append(para)
        count += len(para.split())
        if count >= words:
            break
    return "\n\n".join(taken)


def traffic_rows(text: str, prompts: int, lo: int, hi: int, seed: int) -> list[dict]:
    """``prompts`` rows ``{"id", "prompt"}``: passages of log-uniform length in [lo, hi] words, each with a
    request after it, reproducible from ``seed``."""
    if prompts < 1 or not 0 < lo <= hi:
        raise ValueError(f"need prompts >= 1 and 0 < lo <= hi words, got {prompts}, {lo}, {hi}")
    paras = paragraphs(text)
    rng = random.Random(seed)
    rows = []
    for i in range(prompts):
        words = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        body = passage(paras, rng.randrange(len(paras)), words)
        rows.append({"id": f"persuasion-{i}", "prompt": f"{body}\n\n{rng.choice(REQUESTS)}"})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the JSONL file to write")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--words", default="150,5000", help="LO,HI words per passage")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        lo, hi = (int(w) for w in args.words.split(","))
        rows = traffic_rows(real_text_path().read_text(), args.prompts, lo, hi, args.seed)
    except ValueError as err:
        raise SystemExit(f"error: --words {args.words!r}, --prompts {args.prompts}: {err}") from None
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sizes = sorted(len(row["prompt"].split()) for row in rows)
    print(f"{args.out}: {len(rows)} prompts of {sizes[0]}-{sizes[-1]} words")


if __name__ == "__main__":
    main()
