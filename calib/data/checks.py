"""Checks of a file or hub data source before anything heavy loads (no tokenizer, no model).

A command states what it reads as ``{purpose: reason}``: the purposes (``calibration``,
``evaluation``) whose rows it uses and, for each, why those rows need a gold answer (``None``: they
need none). ``eval`` scores held-out answers; each method recipe says its own in ``data_needs(cfg)``
(SANTA's reward and SampleAttention's tuning score answers, SAAP and SALE's calibration do not).

:func:`check_data` reads those rows and raises a one-line ``UserError`` for an empty or malformed
file, a held-out part that shares a prompt with calibration, a dataset missing from the offline
cache, or rows without an answer where one is needed. Synthetic prompts always have answers and are
held out by seed (checked by ``calib.config.validate_common``), so they need no check here.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

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
    limit = cfg_get(data_cfg, "num_prompts")
    tasks = cfg_get(data_cfg, "tasks") or []
    tasks = [str(t) for t in ([tasks] if isinstance(tasks, str) else tasks)]
    origin = f"JSONL file {cfg_get(data_cfg, 'path')}" if source == "jsonl" else f"HF dataset {cfg_get(data_cfg, 'name')}"
    for purpose, reason in needs.items():
        rows = select_tasks(source_rows(data_cfg, purpose, None if limit is None else int(limit)), tasks, origin)
        if reason:
            require_answers(rows, reason, purpose, str(source))
