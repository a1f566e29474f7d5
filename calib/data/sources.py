"""Prompt sources behind ``build_prompts``: synthetic tasks, a local JSONL file, an HF dataset.

All three return :class:`~calib.data.prompt.Prompt` lists and fail with a one-line
:class:`~calib.errors.UserError` on bad input (unknown task, empty dataset, missing file, ...).

Held-out data: synthetic prompts are drawn from ``seed`` (evaluation passes another seed). JSONL and
HF rows do not depend on a seed; they are split instead: ``purpose="evaluation"`` reads
``eval_path`` / ``eval_split`` when set, otherwise both purposes share one file or split and a row
goes to evaluation iff a hash of its prompt text falls below ``eval_fraction`` — so the two sets never
overlap.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from calib.data.prompt import Prompt, PromptFormatter
from calib.data.synthetic import TASKS, fit_to_length
from calib.data.vocab import seed_from
from calib.errors import UserError

PURPOSES = ("calibration", "evaluation")


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
    from tqdm import tqdm

    return tqdm(items, desc=desc, disable=len(items) < 8 or None, leave=False)


def _check_context_limit(tokenizer, lengths: list[int]) -> None:
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**8 and max(lengths) > limit:
        raise UserError(f"data.lengths has {max(lengths)} tokens but the tokenizer's context is {limit}; "
                        f"use lengths <= {limit}")


def synthetic_prompts(tokenizer, *, tasks: list[str], lengths: list[int], num_prompts: int, seed: int,
                      chat_template: bool | None = None) -> list[Prompt]:
    """``num_prompts`` prompts per (task, length), task-major order, deterministic in ``seed``."""
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
    jobs = [(t, n, i) for t in tasks for n in lengths for i in range(num_prompts)]
    prompts = []
    for task, length, i in _progress(jobs, "synthetic prompts"):
        fitted = fit_to_length(task, seed_from("calib-synthetic", seed, task, length, i), length, fmt)
        prompts.append(Prompt(prompt_id=f"{task}-{length}-s{seed}-{i}", task=task, length=length,
                              text=fitted.text, answer=fitted.instance.queries[0].answer,
                              input_ids=fitted.input_ids))
    return prompts


# --------------------------------------------------------------------------------------------------
# Rows from files and hubs


def _in_eval_part(text: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
    return h / 2.0**64 < fraction


def _holdout(rows: list[dict], purpose: str, separate: bool, fraction: float) -> list[dict]:
    """Rows for ``purpose``: all of them when the purposes have separate sources, else a hash split."""
    if separate:
        return rows
    want_eval = purpose == "evaluation"
    return [r for r in rows if _in_eval_part(r["prompt"], fraction) == want_eval]


def _cap_per_task(rows: list[dict], num_prompts: int | None) -> list[dict]:
    if num_prompts is None:
        return rows
    taken: dict[str, int] = {}
    out = []
    for r in rows:
        if taken.get(r["task"], 0) < num_prompts:
            taken[r["task"]] = taken.get(r["task"], 0) + 1
            out.append(r)
    return out


def _rows_to_prompts(rows: list[dict], tokenizer, chat_template: bool | None, origin: str) -> list[Prompt]:
    if not rows:
        raise UserError(f"empty dataset: {origin} gave no prompts (check the file/split, "
                        f"data.num_prompts and data.eval_fraction)")
    fmt = PromptFormatter(tokenizer, chat_template)
    prompts = []
    for r in _progress(rows, "prompts"):
        text = fmt.wrap_user_text(r["prompt"]) + r.get("prefix", "")
        ids = fmt.encode(text)
        prompts.append(Prompt(prompt_id=r["id"], task=r["task"], length=int(r.get("length") or len(ids)),
                              text=text, answer=str(r["answer"]).strip(), input_ids=ids))
    return prompts


def read_jsonl(path: str | Path, default_task: str = "jsonl") -> list[dict]:
    """Rows ``{"prompt"|"text", "answer", "task"?, "length"?, "id"?}``, one JSON object per line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"JSONL file not found: {p} (set data.path=/path/to/prompts.jsonl)")
    rows = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{p}:{lineno}: not valid JSON ({exc.msg}); one object per line") from None
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{p}:{lineno}: needs a string field \"prompt\" (or \"text\")")
            rows.append({"prompt": text, "answer": obj.get("answer", ""),
                         "task": str(obj.get("task", default_task)), "length": obj.get("length"),
                         "id": str(obj.get("id", f"{p.stem}-{lineno}"))})
    return rows


def jsonl_prompts(data_cfg, tokenizer, *, num_prompts: int | None, purpose: str) -> list[Prompt]:
    path = cfg_get(data_cfg, "path")
    eval_path = cfg_get(data_cfg, "eval_path")
    if not path:
        raise UserError("data=jsonl needs data.path=/path/to/prompts.jsonl")
    source = eval_path if (purpose == "evaluation" and eval_path) else path
    rows = read_jsonl(source, str(cfg_get(data_cfg, "task", "jsonl")))
    rows = _holdout(rows, purpose, bool(eval_path), float(cfg_get(data_cfg, "eval_fraction", 0.5)))
    rows = _cap_per_task(rows, num_prompts)
    return _rows_to_prompts(rows, tokenizer, cfg_get(data_cfg, "chat_template"), f"JSONL file {source}")


def extract_answer(raw: Any, pattern: str | None) -> str | None:
    """The answer from a dataset field: the regex's first group (commas removed) or the whole text."""
    text = str(raw)
    if not pattern:
        return text.strip()
    m = re.search(pattern, text)
    if not m:
        return None
    return (m.group(1) if m.groups() else m.group(0)).replace(",", "").strip().rstrip(".")


def _load_hf_split(name: str, config: str | None, split: str, revision: str | None, data_files=None):
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the `datasets` package: pip install 'calib[hf]'") from None
    try:
        kwargs = {"data_files": data_files} if data_files else {}
        return datasets.load_dataset(name, config, split=split, revision=revision, **kwargs)
    except Exception as exc:  # offline cache miss, unknown split, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"could not load HF dataset {name!r} (config {config!r}, split {split!r}): {first}; "
                        f"it must be in the local HF cache when offline (HF_HUB_OFFLINE=1)") from None


def hf_prompts(data_cfg, tokenizer, *, lengths: list[int], num_prompts: int | None,
               purpose: str) -> list[Prompt]:
    name = cfg_get(data_cfg, "name")
    if not name:
        raise UserError("data=hf needs data.name=<dataset id>, e.g. openai/gsm8k")
    split, eval_split = cfg_get(data_cfg, "split", "test"), cfg_get(data_cfg, "eval_split")
    use_split = eval_split if (purpose == "evaluation" and eval_split) else split
    ds = _load_hf_split(name, cfg_get(data_cfg, "config"), use_split, cfg_get(data_cfg, "revision"),
                        cfg_get(data_cfg, "data_files"))
    qf, af = cfg_get(data_cfg, "question_field", "question"), cfg_get(data_cfg, "answer_field")
    template, pattern = cfg_get(data_cfg, "prompt_template", "{question}"), cfg_get(data_cfg, "answer_regex")
    task = str(cfg_get(data_cfg, "task", name.split("/")[-1]))
    missing = [f for f in (qf, af) if f and f not in ds.column_names]
    if missing:
        raise UserError(f"HF dataset {name!r} has no field {missing[0]!r}; fields: {', '.join(ds.column_names)}")
    rows, limit = [], None if num_prompts is None else int(num_prompts)
    for i, row in enumerate(ds):
        if limit is not None and len(rows) >= (limit if eval_split else limit * 4):
            break  # enough rows (4x the cap before a hash split)
        answer = extract_answer(row[af], pattern) if af else ""
        if answer is None:
            raise UserError(f"HF dataset {name!r} row {i}: answer_regex {pattern!r} matched nothing in "
                            f"{str(row[af])[:60]!r}")
        rows.append({"prompt": template.format(question=row[qf]), "answer": answer, "task": task,
                     "id": f"{task}-{use_split}-{i}", "prefix": cfg_get(data_cfg, "answer_prefix", "") or ""})
    rows = _holdout(rows, purpose, bool(eval_split), float(cfg_get(data_cfg, "eval_fraction", 0.5)))
    rows = _cap_per_task(rows, limit)
    prompts = _rows_to_prompts(rows, tokenizer, cfg_get(data_cfg, "chat_template"), f"HF dataset {name}")
    if cfg_get(data_cfg, "truncate_to_lengths", False):
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
                                  p.answer, ids))
    if not out:
        raise UserError(f"empty dataset: no document has at least {min(lengths)} tokens")
    return out


# --------------------------------------------------------------------------------------------------


def build_prompts(data_cfg, tokenizer, *, seed: int | None = None, lengths=None, tasks=None,
                  num_prompts: int | None = None, purpose: str = "calibration") -> list[Prompt]:
    """Prompts from the ``data`` config node; keyword arguments override the node's values.

    ``data_cfg``: ``source`` (synthetic | jsonl | hf), ``tasks``, ``lengths``, ``num_prompts`` (per task
    and length), ``seed``, plus the source's own keys (conf/data/*.yaml). ``purpose`` picks the held-out
    part of file/hub sources ("evaluation") — synthetic prompts are held out by seed instead.
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
                                 chat_template=cfg_get(data_cfg, "chat_template"))
    if source == "jsonl":
        return jsonl_prompts(data_cfg, tokenizer, num_prompts=n, purpose=purpose)
    if source == "hf":
        return hf_prompts(data_cfg, tokenizer, lengths=[int(x) for x in lengths], num_prompts=n,
                          purpose=purpose)
    raise UserError(f"unknown data.source {source!r}: use synthetic, jsonl or hf")
