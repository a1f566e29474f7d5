"""Rows of a local JSONL file or a Hugging Face dataset, split into calibration and held-out parts.

Reading needs no tokenizer and no model, so a bad file fails in one line before anything heavy loads
(:func:`calib.data.checks.check_data`); :func:`calib.data.sources.build_prompts` turns rows into prompts.

Held-out rows (``purpose="evaluation"``) come from ``eval_path`` / ``eval_split`` when set; those are
checked against the calibration rows and any shared prompt is an error. Without them both purposes
read one file or split and a row is held out iff a hash of its prompt text falls below
``eval_fraction``: identical prompts land on the same side, so the two parts never overlap.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from calib.errors import UserError

# datasets and pyarrow (the optional `hf` extra) and omegaconf are imported where used: calib.data
# imports without them, for scripts that build prompts from plain dicts.

PURPOSES = ("calibration", "evaluation")


@dataclass(frozen=True)
class SourceRow:
    """One row: ``prompt`` is the user text (before any chat template), ``answer`` the stripped gold
    answer (``""``: the row has none), ``length`` the row's declared length (``None``: its token count)
    and ``where`` names the row in error messages (``/path/rows.jsonl:3``)."""

    prompt: str
    answer: str
    task: str
    length: int | None
    row_id: str
    where: str
    prefix: str = ""  # appended after the (chat-templated) prompt: HF ``answer_prefix``


def cfg_get(cfg: Mapping[str, Any] | Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for dicts and OmegaConf nodes alike; a missing or ``???`` value gives ``default``."""
    try:
        value = cfg.get(key, default)
    except Exception as exc:  # omegaconf.MissingMandatoryValue for `???`
        if type(exc).__name__ == "MissingMandatoryValue":
            return default
        raise
    if hasattr(value, "_content") or type(value).__name__ in ("ListConfig", "DictConfig"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


# --------------------------------------------------------------------------------------------------
# JSONL


def _answer_text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{where}: \"answer\" must be a string or a number (got {type(value).__name__})")


def _jsonl_row(line: str, where: str, default_id: str, default_task: str) -> SourceRow:
    """One parsed and checked line (see :func:`read_jsonl` for the fields)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg}); one object per line") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: a row must be a JSON object, e.g. {{\"prompt\": \"...\", \"answer\": \"...\"}}")
    text = obj.get("prompt", obj.get("text"))
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{where}: needs a non-empty string field \"prompt\" (or \"text\")")
    task = obj.get("task", default_task)
    if not isinstance(task, str) or not task:
        raise UserError(f"{where}: \"task\" must be a non-empty string (got {task!r})")
    length = obj.get("length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        raise UserError(f"{where}: \"length\" must be a positive integer (got {length!r})")
    return SourceRow(prompt=text, answer=_answer_text(obj.get("answer"), where), task=task, length=length,
                     row_id=str(obj.get("id", default_id)), where=where)


def read_jsonl(path: str | Path, default_task: str = "jsonl") -> list[SourceRow]:
    """Rows ``{"prompt"|"text": str, "answer"?: str|number, "task"?: str, "length"?: int, "id"?: str}``,
    one JSON object per line (blank lines skipped); a file without rows is an error."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"JSONL file not found: {p} (set data.path=/path/to/prompts.jsonl)")
    rows = []
    try:
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    rows.append(_jsonl_row(line, f"{p}:{lineno}", f"{p.stem}-{lineno}", default_task))
    except UnicodeDecodeError:
        raise UserError(f"{p}: not UTF-8 text; a JSONL file holds one JSON object per line") from None
    if not rows:
        raise UserError(f"empty dataset: {p} has no rows; write one JSON object per line, "
                        f"e.g. {{\"prompt\": \"...\", \"answer\": \"...\"}}")
    return rows


def jsonl_rows(data_cfg: Any, purpose: str) -> list[SourceRow]:
    """The rows of ``purpose`` from ``data.path`` / ``data.eval_path`` (module docstring)."""
    path, eval_path = cfg_get(data_cfg, "path"), cfg_get(data_cfg, "eval_path")
    if not path:
        raise UserError("data=jsonl needs data.path=/path/to/prompts.jsonl")
    task = str(cfg_get(data_cfg, "task", "jsonl"))
    if not eval_path:
        return hash_split(read_jsonl(path, task), purpose, eval_fraction(data_cfg), f"JSONL file {path}",
                          "add rows or give a held-out file with data.eval_path=...")
    if purpose == "calibration":
        return read_jsonl(path, task)
    held = read_jsonl(eval_path, task)
    check_disjoint(held, read_jsonl(path, task),
                   "remove them from data.eval_path, or set data.eval_path=null to hash-split data.path")
    return held


# --------------------------------------------------------------------------------------------------
# Held-out split


def eval_fraction(data_cfg: Any) -> float:
    value = cfg_get(data_cfg, "eval_fraction", 0.5)
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = -1.0
    if not 0.0 < fraction < 1.0:
        raise UserError(f"data.eval_fraction must lie in (0, 1) (got {value!r}): the share of rows held out for eval")
    return fraction


def in_held_out_part(text: str, fraction: float) -> bool:
    """True when the prompt ``text`` belongs to the held-out part (a hash of the text, not its position)."""
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
    return h / 2.0**64 < fraction


def hash_split(rows: list[SourceRow], purpose: str, fraction: float, origin: str, fix: str) -> list[SourceRow]:
    """The rows of ``purpose`` when calibration and evaluation share ``rows``."""
    want_held_out = purpose == "evaluation"
    part = [r for r in rows if in_held_out_part(r.prompt, fraction) == want_held_out]
    if not part:
        which = "held out for eval" if want_held_out else "left for calibration"
        raise UserError(f"empty dataset: none of the {len(rows)} rows of {origin} is {which} "
                        f"(data.eval_fraction={fraction:g} hash-splits them); {fix}")
    return part


def check_disjoint(held: Sequence[SourceRow], calibration: Sequence[SourceRow], fix: str) -> None:
    """Raise when a held-out prompt is also a calibration prompt (evaluation must be held out)."""
    seen = {r.prompt: r for r in calibration}
    shared = [r for r in held if r.prompt in seen]
    if shared:
        first = shared[0]
        raise UserError(f"held-out rows overlap calibration: {first.where} has the same prompt as "
                        f"{seen[first.prompt].where} ({len(shared)} of {len(held)} held-out rows shared); {fix}")


def select_tasks(rows: list[SourceRow], tasks: Sequence[str], origin: str) -> list[SourceRow]:
    """Rows of the given tasks (all rows when ``tasks`` is empty)."""
    if not tasks:
        return rows
    kept = [r for r in rows if r.task in tasks]
    if not kept:
        have = ", ".join(sorted({r.task for r in rows}))
        raise UserError(f"empty dataset: {origin} has no row of task {', '.join(tasks)} (its tasks: {have}); "
                        f"set the tasks to null or to some of these")
    return kept


def cap_per_task(rows: list[SourceRow], num_prompts: int | None) -> list[SourceRow]:
    """The first ``num_prompts`` rows of each task, in row order (all rows when None)."""
    if num_prompts is None:
        return rows
    taken: dict[str, int] = {}
    out = []
    for r in rows:
        if taken.get(r.task, 0) < num_prompts:
            taken[r.task] = taken.get(r.task, 0) + 1
            out.append(r)
    return out


# --------------------------------------------------------------------------------------------------
# Hugging Face datasets


def extract_answer(raw: Any, pattern: str | None) -> str | None:
    """The answer from a dataset field: the regex's first group (commas removed) or the whole text."""
    text = str(raw)
    if not pattern:
        return text.strip()
    m = re.search(pattern, text)
    if not m:
        return None
    return (m.group(1) if m.groups() else m.group(0)).replace(",", "").strip().rstrip(".")


def _saved_split(directory: Path, split: str) -> Any:
    """A split of a dataset written by ``save_to_disk``: a DatasetDict's split, or a lone Dataset."""
    import datasets

    saved = datasets.load_from_disk(str(directory))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise UserError(f"saved dataset {directory} has no split {split!r}; its splits: {', '.join(saved)}")
        return saved[split]
    own = str(saved.split) if saved.split is not None else "train"
    if split != own:
        raise UserError(f"saved dataset {directory} is one Dataset (split {own!r}), not {split!r}; set "
                        f"data.split={own} data.eval_split=null, or save a DatasetDict with both splits")
    return saved


def load_hf_split(data_cfg: Any, split: str) -> Any:
    """``datasets.load_dataset(name, config, split=...)``, or ``load_from_disk`` for a ``save_to_disk`` dir."""
    name = cfg_get(data_cfg, "name")
    if not name:
        raise UserError("data=hf needs data.name=<dataset id or save_to_disk directory>, e.g. openai/gsm8k")
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the `datasets` package: pip install 'calib[hf]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    local = Path(str(name)).expanduser()
    if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():
        return _saved_split(local, split)
    config, revision = cfg_get(data_cfg, "config"), cfg_get(data_cfg, "revision")
    data_files = cfg_get(data_cfg, "data_files")
    try:
        kwargs = {"data_files": data_files} if data_files else {}
        return datasets.load_dataset(name, config, split=split, revision=revision, **kwargs)
    except Exception as exc:  # offline cache miss, unknown split, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"could not load HF dataset {name!r} (config {config!r}, split {split!r}): {first}; "
                        f"it must be in the local HF cache when offline (HF_HUB_OFFLINE=1), or give a "
                        f"save_to_disk directory or name=json data_files=...") from None


def _fill_template(template: str, question: Any) -> str:
    try:
        return template.format(question=question)
    except (KeyError, IndexError, ValueError):
        raise UserError(f"data.prompt_template={template!r} may only use {{question}} "
                        f"(write {{{{ and }}}} for literal braces)") from None


def hf_dataset(data_cfg: Any, split: str) -> Any:
    """The loaded ``split`` after checking that the configured fields exist."""
    ds = load_hf_split(data_cfg, split)
    qf, af = cfg_get(data_cfg, "question_field", "question"), cfg_get(data_cfg, "answer_field")
    missing = [f for f in (qf, af) if f and f not in ds.column_names]
    if missing:
        raise UserError(f"HF dataset {cfg_get(data_cfg, 'name')!r} has no field {missing[0]!r}; "
                        f"fields: {', '.join(ds.column_names)}")
    return ds


def hf_split_rows(data_cfg: Any, ds: Any, split: str, limit: int | None) -> list[SourceRow]:
    """The first ``limit`` rows (all when None) of the loaded ``split`` as :class:`SourceRow`."""
    name = str(cfg_get(data_cfg, "name"))
    qf, af = cfg_get(data_cfg, "question_field", "question"), cfg_get(data_cfg, "answer_field")
    template, pattern = cfg_get(data_cfg, "prompt_template", "{question}"), cfg_get(data_cfg, "answer_regex")
    task = str(cfg_get(data_cfg, "task") or Path(name).name)
    prefix = cfg_get(data_cfg, "answer_prefix", "") or ""
    rows: list[SourceRow] = []
    for i, row in enumerate(ds):
        if limit is not None and len(rows) >= limit:
            break
        where = f"HF dataset {name!r} split {split!r} row {i}"
        answer = extract_answer(row[af], pattern) if af else ""
        if answer is None:
            raise UserError(f"{where}: answer_regex {pattern!r} matched nothing in {str(row[af])[:60]!r}")
        rows.append(SourceRow(prompt=_fill_template(template, row[qf]), answer=answer, task=task, length=None,
                              row_id=f"{task}-{split}-{i}", where=where, prefix=prefix))
    if not rows:
        raise UserError(f"empty dataset: HF dataset {name!r} split {split!r} has no rows")
    return rows


def _first_shared_question(calibration: Any, held: Any, field: str) -> tuple[int, int, int] | None:
    """``(calibration row, held-out row, shared count)`` of the first calibration row whose ``field``
    equals a held-out row's, or None. Scans the calibration column in Arrow (no Python row objects), so
    a large calibration split costs one pass over that column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    held_values = held.with_format("arrow")[field].combine_chunks()
    column = calibration.with_format("arrow")[field]
    try:
        mask = pc.is_in(column, value_set=held_values)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # e.g. column types differ between splits
        seen = set(held_values.to_pylist())
        mask = pa.array([v in seen for v in column.to_pylist()])
    count = int(pc.sum(mask).as_py() or 0)
    if count == 0:
        return None
    i = int(pc.index(mask, True).as_py())
    return i, held_values.to_pylist().index(column[i].as_py()), count


def hf_rows(data_cfg: Any, purpose: str, limit: int | None) -> list[SourceRow]:
    """The rows of ``purpose`` (module docstring); ``limit`` rows per purpose are enough (4x that are read
    before a hash split)."""
    name, qf = cfg_get(data_cfg, "name"), cfg_get(data_cfg, "question_field", "question")
    split, eval_split = cfg_get(data_cfg, "split", "train"), cfg_get(data_cfg, "eval_split")
    if not eval_split:
        rows = hf_split_rows(data_cfg, hf_dataset(data_cfg, split), split, None if limit is None else 4 * limit)
        return hash_split(rows, purpose, eval_fraction(data_cfg), f"HF dataset {name!r} split {split!r}",
                          "read more rows (data.num_prompts) or set data.eval_split")
    if purpose == "calibration":
        return hf_split_rows(data_cfg, hf_dataset(data_cfg, split), split, limit)
    fix = "pick a disjoint data.eval_split, or data.eval_split=null to hash-split data.split"
    if eval_split == split:
        raise UserError(f"held-out rows overlap calibration: data.eval_split={eval_split!r} is data.split; {fix}")
    held_ds = hf_dataset(data_cfg, eval_split)
    held = hf_split_rows(data_cfg, held_ds, eval_split, limit)
    shared = _first_shared_question(hf_dataset(data_cfg, split), held_ds.select(range(len(held))), qf)
    if shared is not None:
        i, j, count = shared
        raise UserError(f"held-out rows overlap calibration: {held[j].where} has the same {qf!r} as split "
                        f"{split!r} row {i} ({count} calibration rows repeat a held-out one); {fix}")
    return held


def source_rows(data_cfg: Any, purpose: str, limit: int | None = None) -> list[SourceRow]:
    """The ``purpose`` rows of a ``jsonl`` or ``hf`` data config (``limit`` bounds what HF reads)."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    source = cfg_get(data_cfg, "source", "synthetic")
    if source == "jsonl":
        return jsonl_rows(data_cfg, purpose)
    if source == "hf":
        return hf_rows(data_cfg, purpose, limit)
    raise UserError(f"unknown data.source {source!r}: use synthetic, jsonl or hf")
