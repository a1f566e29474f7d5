"""Data files for the source tests, written from synthetic tiny-model prompts (no download).

The rows are RULER-style prompts the shipped tiny model was trained on, so its answers are real;
which rows a source holds out is computed here from the documented rule (sha256 of the prompt text,
first 8 bytes little-endian, below ``eval_fraction`` of 2**64), independently of ``calib.data``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from calib.paths import project_root

TINY_DIR = project_root() / "artifacts" / "models" / "tiny"


def held_out(text: str, fraction: float = 0.5) -> bool:
    """The documented hash split: True when ``text`` belongs to the held-out part."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") / 2.0**64 < fraction


def tiny_tokenizer_from_disk() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_DIR), local_files_only=True)


def token_count(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` as the tiny model reads it: the tokenizer's own special tokens (one BOS)."""
    return len(tokenizer(text)["input_ids"])


def synthetic_rows(tasks: Sequence[str], length: int, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` rows per task: ``{"prompt", "answer", "task"}`` from the synthetic generator."""
    from calib.data.sources import synthetic_prompts

    prompts = synthetic_prompts(tiny_tokenizer_from_disk(), tasks=list(tasks), lengths=[length],
                                num_prompts=count, seed=seed)
    return [{"prompt": p.text, "answer": p.answer, "task": p.task} for p in prompts]


def write_jsonl(path: Path, rows: Sequence[dict[str, Any] | str]) -> Path:
    """One line per row: a dict is dumped as JSON, a string is written as it is (blank or broken lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def expected_cells(rows: Sequence[dict[str, Any]], tokenizer: Any, per_task: int,
                   default_task: str = "jsonl") -> dict[str, int]:
    """``{"task@length": prompts}`` of the first ``per_task`` rows of each task (file order): a row's
    length is its ``length`` field, else its token count."""
    taken: dict[str, int] = {}
    cells: dict[str, int] = {}
    for r in rows:
        task = r.get("task", default_task)
        if taken.get(task, 0) >= per_task:
            continue
        taken[task] = taken.get(task, 0) + 1
        length = r.get("length") or token_count(tokenizer, r["prompt"])
        key = f"{task}@{length}"
        cells[key] = cells.get(key, 0) + 1
    return cells
