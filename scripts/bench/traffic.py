"""A user's own prompts for ``bench_serving.py --prompts``: a JSONL file as ``calib eval data=jsonl`` reads
one (one object per line, the text in ``prompt`` or ``text``), each prompt as the model's input ids (in the
chat template when the tokenizer has one, as calibration and evaluation wrap them), in batches of one size."""

from __future__ import annotations

from pathlib import Path

from calib.data.prompt import PromptFormatter
from calib.data.rows import read_jsonl


def prompt_ids(path: str | Path, tokenizer, max_tokens: int) -> list[list[int]]:
    """Every prompt of ``path`` as input ids, in file order; a prompt of more than ``max_tokens`` tokens
    (no room left in the model's context to generate) is a one-line error naming the first such row."""
    fmt = PromptFormatter(tokenizer)
    rows = read_jsonl(path)
    ids = [fmt.encode(fmt.wrap_user_text(row.prompt)) for row in rows]
    long = [(row, len(x)) for row, x in zip(rows, ids) if len(x) > max_tokens]
    if long:
        (row, n), more = long[0], len(long) - 1
        raise SystemExit(f"{row.where}: {n} tokens, more than the {max_tokens} the model's context leaves for "
                         f"generating{f' (and {more} more rows)' if more else ''}; shorten or drop them")
    return ids


def batches(ids: list[list[int]], rows: int) -> list[list[list[int]]]:
    """``ids`` in batches of ``rows`` prompts each, in file order; the last batch filled from the start of
    the file (a generator serves one batch size), a file of fewer prompts repeated to fill one batch."""
    if rows < 1 or not ids:
        raise ValueError(f"batches of {rows} rows from {len(ids)} prompts")
    count = -(-len(ids) // rows)
    return [[ids[(b * rows + i) % len(ids)] for i in range(rows)] for b in range(count)]
