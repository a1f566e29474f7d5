"""Checks of a file or hub data source before anything heavy loads (no tokenizer, no model).

A command states what it reads as ``{purpose: reason}``: the purposes (``calibration``,
``evaluation``) whose rows it uses and, for each, why those rows need a gold answer (``None``: they
need none). ``eval`` scores held-out answers; each method recipe says its own in ``data_needs(cfg)``
(SANTA's reward and SampleAttention's tuning score answers, SAAP and SALE's calibration do not).

:func:`check_data` reads those rows and raises a one-line ``UserError`` for an empty or malformed
file, a held-out part that shares a prompt with calibration, a dataset missing from the offline
cache, or rows without an answer where one is needed. Synthetic prompts always have answers and are
held out by seed (checked by ``calib.config.validate_common``), so they need no check here. Book
prompts are held out by book: their settings are checked, the books of each purpose read and verified,
and ``book_text`` (no answer) refused where answers are needed.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from calib.data.books import ANSWERED_TASKS, check_book_settings
from calib.data.corpus import SPLIT, read_book
from calib.data.rows import SourceRow, cfg_get, select_tasks, source_rows
from calib.errors import UserError

DataNeeds = Mapping[str, "str | None"]

EVAL_NEEDS: dict[str, str | None] = {"evaluation": "`eval` scores every held-out answer"}


def require_answers(rows: Sequence[SourceRow], reason: str, purpose: str, source: str) -> None:
    """Raise when a row has no gold answer; ``reason`` says who scores the answers and why."""
    missing = [r for r in rows if not r.answer]
    if not missing:
        return
    fix = ("add an \"answer\" to every row" if source == "jsonl"
           else "set data.answer_field (and data.answer_regex) to where the answer is")
    part = "held-out" if purpose == "evaluation" else purpose
    raise UserError(f"{reason}, but {missing[0].where} has no answer ({len(missing)} of {len(rows)} {part} rows "
                    f"lack one); {fix}")


def check_data(data_cfg: Any, needs: DataNeeds) -> None:
    """Read the rows of every purpose in ``needs`` and check them (module docstring)."""
    source = cfg_get(data_cfg, "source", "synthetic")
    if source == "synthetic":
        return
    if source == "books":
        check_books(data_cfg, needs)
        return
    limit = cfg_get(data_cfg, "num_prompts")
    tasks = cfg_get(data_cfg, "tasks") or []
    tasks = [str(t) for t in ([tasks] if isinstance(tasks, str) else tasks)]
    origin = f"JSONL file {cfg_get(data_cfg, 'path')}" if source == "jsonl" else f"HF dataset {cfg_get(data_cfg, 'name')}"
    for purpose, reason in needs.items():
        rows = select_tasks(source_rows(data_cfg, purpose, None if limit is None else int(limit)), tasks, origin)
        if reason:
            require_answers(rows, reason, purpose, str(source))


def check_books(data_cfg: Any, needs: DataNeeds) -> None:
    """A ``data=books`` config: its settings, the shipped books of each purpose, answers where needed."""
    def as_list(key: str) -> list:
        value = cfg_get(data_cfg, key)
        return [] if value is None else [value] if isinstance(value, (str, int)) else list(value)

    tasks = [str(t) for t in as_list("tasks")]
    check_book_settings(tasks, as_list("lengths"), cfg_get(data_cfg, "num_prompts"),
                        cfg_get(data_cfg, "synthetic_share") or 0.0, [str(t) for t in as_list("synthetic_tasks")])
    for purpose, reason in needs.items():
        for name in SPLIT[purpose]:
            read_book(name)
        if reason and "book_text" in tasks:
            raise UserError(f"{reason}, but data.tasks has book_text (plain book text, no question or answer); "
                            f"use {' or '.join(ANSWERED_TASKS)}")
