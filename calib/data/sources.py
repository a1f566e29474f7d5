"""Prompt sources behind ``build_prompts``: synthetic tasks, books, a local JSONL file, an HF dataset.

All four return :class:`~calib.data.prompt.Prompt` lists and fail with a one-line
:class:`~calib.errors.UserError` on bad input (unknown task, empty dataset, missing file, ...).

Held-out data: synthetic prompts are drawn from ``seed`` (evaluation passes another seed). JSONL and
HF rows do not depend on a seed; they are split instead (:mod:`calib.data.rows`): ``purpose="evaluation"``
reads ``eval_path`` / ``eval_split`` when set (checked not to share a prompt with calibration),
otherwise both purposes share one file or split and a row goes to evaluation iff a hash of its prompt
text falls below ``eval_fraction`` — so the two sets never overlap. For these sources ``tasks`` selects
rows by their task (empty: every row) and ``lengths`` only matters to HF's ``truncate_to_lengths``.
Book prompts (:mod:`calib.data.books`) are held out by book: each purpose reads its own novels.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from tqdm import tqdm

from calib.data.books import ANSWERED_TASKS, BOOK_TASKS, book_prompts, check_book_settings
from calib.data.prompt import Prompt, PromptFormatter
from calib.data.rows import PURPOSES, SourceRow, cap_per_task, cfg_get, select_tasks, source_rows
from calib.data.scoring import scoring_rule
from calib.data.synthetic import TASKS, fit_to_length
from calib.data.vocab import seed_from
from calib.errors import UserError


def _as_list(value: Any, key: str) -> list:
    if value is None:
        return []
    if isinstance(value, (str, int)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise UserError(f"data.{key} must be a list (got {value!r})") from None


def _progress(items: list, desc: str) -> Iterable:
    return tqdm(items, desc=desc, disable=len(items) < 8 or None, leave=False)


def _check_context_limit(tokenizer, lengths: list[int]) -> None:
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**8 and max(lengths) > limit:
        raise UserError(f"data.lengths has {max(lengths)} tokens but the tokenizer's context is {limit}; "
                        f"use lengths <= {limit}")


def synthetic_prompts(tokenizer, *, tasks: list[str], lengths: list[int], num_prompts: int, seed: int,
                      chat_template: bool | None = None, scoring: Any = None,
                      cells: set[tuple[str, int]] | None = None) -> list[Prompt]:
    """``num_prompts`` prompts per (task, length), task-major order, deterministic in ``seed``;
    ``scoring`` is ``data.scoring`` (a rule, or ``{task: rule}``). ``cells``: build only these (task,
    length) pairs of the grid; each prompt is seeded by its own (task, length, index), so they are the
    prompts the full grid holds, without fitting the others."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown task {unknown[0]!r} in data.tasks; built-in tasks: {', '.join(TASKS)}")
    if not tasks or not lengths or num_prompts < 1:
        raise UserError(f"empty dataset: data.tasks={tasks}, data.lengths={lengths}, "
                        f"data.num_prompts={num_prompts}; each needs at least one entry / 1")
    bad = [n for n in lengths if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise UserError(f"data.lengths must be positive integers (got {bad[0]!r})")
    _check_context_limit(tokenizer, lengths)
    fmt = PromptFormatter(tokenizer, chat_template)
    jobs = [(t, n, i) for t in tasks for n in lengths for i in range(num_prompts) if cells is None or (t, n) in cells]
    prompts = []
    for task, length, i in _progress(jobs, "synthetic prompts"):
        fitted = fit_to_length(task, seed_from("calib-synthetic", seed, task, length, i), length, fmt)
        prompts.append(Prompt(prompt_id=f"{task}-{length}-s{seed}-{i}", task=task, length=length,
                              text=fitted.text, answer=fitted.instance.queries[0].answer,
                              input_ids=fitted.input_ids, scoring=scoring_rule(scoring, task)))
    return prompts


# --------------------------------------------------------------------------------------------------
# Rows from files and hubs


def _rows_to_prompts(rows: list[SourceRow], tokenizer, chat_template: bool | None, scoring: Any) -> list[Prompt]:
    fmt = PromptFormatter(tokenizer, chat_template)
    prompts = []
    for r in _progress(rows, "prompts"):
        text = fmt.wrap_user_text(r.prompt) + r.prefix
        ids = fmt.encode(text)
        prompts.append(Prompt(prompt_id=r.row_id, task=r.task, length=int(r.length or len(ids)), text=text,
                              answer=r.answer, input_ids=ids, scoring=scoring_rule(scoring, r.task)))
    return prompts


def file_prompts(data_cfg, tokenizer, *, tasks: list[str], lengths: list[int], num_prompts: int | None,
                 purpose: str) -> list[Prompt]:
    """Prompts of a ``jsonl`` or ``hf`` source: the ``purpose`` rows of ``tasks`` (all when empty), the
    first ``num_prompts`` of each task; HF with ``truncate_to_lengths`` cuts each row to ``lengths``."""
    source = cfg_get(data_cfg, "source")
    origin = f"JSONL file {cfg_get(data_cfg, 'path')}" if source == "jsonl" else f"HF dataset {cfg_get(data_cfg, 'name')}"
    rows = select_tasks(source_rows(data_cfg, purpose, num_prompts), tasks, origin)
    rows = cap_per_task(rows, num_prompts)
    prompts = _rows_to_prompts(rows, tokenizer, cfg_get(data_cfg, "chat_template"), cfg_get(data_cfg, "scoring"))
    if source == "hf" and cfg_get(data_cfg, "truncate_to_lengths", False):
        if not lengths:
            raise UserError("data.truncate_to_lengths=true needs data.lengths (the cut lengths in tokens)")
        _check_context_limit(tokenizer, lengths)
        prompts = _truncate(prompts, lengths, tokenizer)
    return prompts


def _truncate(prompts: list[Prompt], lengths: list[int], tokenizer) -> list[Prompt]:
    """One prompt per (document, length): its first ``length`` tokens (long-text calibration, PG19);
    ``text`` is their decoding (special tokens left out; ``input_ids`` are authoritative)."""
    out = []
    for p in prompts:
        for n in lengths:
            if len(p.input_ids) >= n:
                ids = p.input_ids[:n]
                out.append(Prompt(f"{p.prompt_id}-{n}", p.task, n, tokenizer.decode(ids, skip_special_tokens=True),
                                  p.answer, ids, p.scoring))
    if not out:
        raise UserError(f"empty dataset: no document has at least {min(lengths)} tokens")
    return out


# --------------------------------------------------------------------------------------------------
# Books


def in_turn_counts(names: Sequence[str], total: int) -> dict[str, int]:
    """How many of ``total`` items each name gets when ``names`` take them in turn."""
    return {name: len(range(k, total, len(names))) for k, name in enumerate(names)}


def books_source_prompts(data_cfg, tokenizer, *, tasks: list[str], lengths: list[int], num_prompts: int,
                         seed: int, purpose: str, cells: set[tuple[str, int]] | None = None) -> list[Prompt]:
    """``num_prompts`` book prompts per (task, length) from ``purpose``'s books. For calibration,
    ``data.synthetic_share`` of each length's prompts are synthetic-task prompts of ``data.synthetic_tasks``
    instead (the tasks taking the kept and the replaced places in turn); evaluation ignores the share."""
    share = cfg_get(data_cfg, "synthetic_share") or 0.0
    synthetic_tasks = [str(t) for t in _as_list(cfg_get(data_cfg, "synthetic_tasks"), "synthetic_tasks")]
    check_book_settings(tasks, lengths, num_prompts, share, synthetic_tasks)
    _check_context_limit(tokenizer, lengths)
    chat, scoring = cfg_get(data_cfg, "chat_template"), cfg_get(data_cfg, "scoring")
    mixed = purpose == "calibration" and share > 0
    jobs, synthetic = [], []
    for n in lengths:
        replaced = int(share * len(tasks) * num_prompts + 0.5) if mixed else 0
        kept = in_turn_counts(tasks, len(tasks) * num_prompts - replaced)
        jobs += [(t, n, i) for t in tasks for i in range(kept[t]) if cells is None or (t, n) in cells]
        synthetic += [(t, n, c) for t, c in in_turn_counts(synthetic_tasks, replaced).items() if c]
    jobs.sort(key=lambda job: (tasks.index(job[0]), lengths.index(job[1]), job[2]))  # task-major, as synthetic
    prompts = book_prompts(tokenizer, jobs, seed=seed, purpose=purpose, chat_template=chat, scoring=scoring)
    for t, n, c in synthetic:
        prompts += synthetic_prompts(tokenizer, tasks=[t], lengths=[n], num_prompts=c, seed=seed,
                                     chat_template=chat, scoring=scoring)
    return prompts


# --------------------------------------------------------------------------------------------------


def build_prompts(data_cfg, tokenizer, *, seed: int | None = None, lengths=None, tasks=None,
                  num_prompts: int | None = None, purpose: str = "calibration",
                  cells: set[tuple[str, int]] | None = None) -> list[Prompt]:
    """Prompts from the ``data`` config node; keyword arguments override the node's values.

    ``data_cfg``: ``source`` (synthetic | books | jsonl | hf), ``tasks``, ``lengths``, ``num_prompts`` (per
    task and length), ``seed``, plus the source's own keys (conf/data/*.yaml). ``purpose`` picks the
    held-out part of book, file and hub sources ("evaluation") — synthetic prompts are held out by seed.
    ``cells``: synthetic and book prompts are built only for these (task, length) pairs (others ignore it).
    """
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    source = cfg_get(data_cfg, "source", "synthetic")
    seed = int(cfg_get(data_cfg, "seed", 0) if seed is None else seed)
    lengths = _as_list(cfg_get(data_cfg, "lengths") if lengths is None else lengths, "lengths")
    tasks = _as_list(cfg_get(data_cfg, "tasks") if tasks is None else tasks, "tasks")
    n = cfg_get(data_cfg, "num_prompts") if num_prompts is None else num_prompts
    if n is not None and int(n) < 1:
        raise UserError(f"empty dataset: data.num_prompts={n}; use data.num_prompts >= 1")
    if source == "synthetic":
        return synthetic_prompts(tokenizer, tasks=[str(t) for t in tasks], lengths=lengths,
                                 num_prompts=int(n if n is not None else 1), seed=seed,
                                 chat_template=cfg_get(data_cfg, "chat_template"),
                                 scoring=cfg_get(data_cfg, "scoring"), cells=cells)
    if source == "books":
        return books_source_prompts(data_cfg, tokenizer, tasks=[str(t) for t in tasks], lengths=lengths,
                                    num_prompts=int(n if n is not None else 1), seed=seed, purpose=purpose,
                                    cells=cells)
    if source in ("jsonl", "hf"):
        return file_prompts(data_cfg, tokenizer, tasks=[str(t) for t in tasks], lengths=[int(x) for x in lengths],
                            num_prompts=None if n is None else int(n), purpose=purpose)
    raise UserError(f"unknown data.source {source!r}: use synthetic, books, jsonl or hf")


def evaluation_prompts(cfg: Any, tokenizer) -> list[Prompt]:
    """The held-out prompts of ``eval`` from the full config: ``eval.seed``, ``eval.lengths``,
    ``eval.tasks`` and ``eval.num_prompts`` (per task and length). File/hub sources give their held-out
    rows, of ``eval.tasks`` when set (null: every task), at most ``eval.num_prompts`` per task. Books:
    ``book_text`` has no answer to score and is refused; ``eval.cells`` naming no book task (a model's
    default cells for synthetic tasks) select nothing and are ignored."""
    ev = cfg.eval
    cells = None if cfg_get(ev, "cells") is None else parse_cells(cfg_get(ev, "cells"))
    if cfg_get(cfg.data, "source") == "books":
        tasks = _as_list(cfg_get(ev, "tasks"), "tasks")
        if "book_text" in tasks:
            raise UserError(f"eval scores answers, but eval.tasks has book_text (plain book text, no question); "
                            f"use {' or '.join(ANSWERED_TASKS)}")
        if cells is not None:
            cells = {c for c in cells if c[0] in BOOK_TASKS} or None
    prompts = build_prompts(cfg.data, tokenizer, seed=int(ev.seed), lengths=cfg_get(ev, "lengths"),
                            tasks=cfg_get(ev, "tasks"), num_prompts=int(ev.num_prompts), purpose="evaluation",
                            cells=cells)
    return prompts if cells is None else keep_cells(prompts, cells)


def parse_cells(cells: Any) -> set[tuple[str, int]]:
    """``eval.cells`` (``["niah_single@1024", ...]``, a model's default eval set) as ``{(task, length)}``."""
    out: set[tuple[str, int]] = set()
    for cell in [cells] if isinstance(cells, str) else list(cells):
        task, sep, length = str(cell).partition("@")
        if not sep or not task or not length.isdigit():
            raise UserError(f"eval.cells entries are task@length, e.g. niah_single@1024 (got {cell!r})")
        out.add((task, int(length)))
    return out


def keep_cells(prompts: list[Prompt], cells: set[tuple[str, int]]) -> list[Prompt]:
    """The prompts of the (task, length) grid that lie in ``cells`` (a model's kept tasks per length
    need not form a grid); the same prompts the full grid holds, so figures stay comparable."""
    kept = [p for p in prompts if (p.task, p.length) in cells]
    if not kept:
        raise UserError(f"eval.cells {sorted(f'{t}@{n}' for t, n in cells)} match none of eval.tasks x eval.lengths")
    return kept


def take_in_turn(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """At most ``n`` of ``prompts``, taking their (length, task) groups in turn (the first of each group,
    then the second, ...), groups in first-seen order."""
    groups: dict[tuple[int, str], list[Prompt]] = {}
    for p in prompts:
        groups.setdefault((int(p.length), str(p.task)), []).append(p)
    queues = list(groups.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)][:n]
