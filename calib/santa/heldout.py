"""Held-out scoring of SANTA schedules: learned vs uniform at the same N (docs/methods.md, SANTA, "Held out").

Both schedules (and, with ``method.reward.heldout_dense``, dense attention) answer the SAME held-out questions
(:func:`calib.santa.reward.reward_prompts` with ``heldout=True``), question ``i`` sampled with the same seed
under every schedule, so the comparison is paired. Past a few dozen answers the work is sharded over up to
``rl.workers`` local processes (:mod:`calib.santa.local_worker` ``--score``; shard ``j`` takes questions
``j::shards``), each loading the model once; per-question seeds make the scores independent of the sharding.

Metrics: ``reward_learned`` / ``reward_uniform`` with bootstrap 95% CIs (``*_ci_low``, ``*_ci_high``),
``reward_learned_minus_uniform`` with its paired-bootstrap CI, ``heldout_ci_separated`` (1 when the learned CI
lies wholly above the uniform CI), ``learned_equals_uniform`` and ``reward_dense``.

When L does not divide N, the ``N mod L`` extra samples of "uniform at N" can sit on any of ``C(L, N mod L)``
sets of layers (:func:`calib.santa.policy.uniform_placements`). ``uniform`` stays the θ = 0 schedule (extras on
the lowest layers), and with ``rl.heldout_uniform_placements`` every placement is scored too:
``reward_uniform_mean`` (the fair uniform: per question, the share of placements answering it),
``reward_uniform_best`` (the best placement on these same questions: a bound favouring uniform) with CIs,
``uniform_best_schedule.layer_<i>`` and ``heldout_ci_separated_best``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from calib.config import to_container
from calib.data import Prompt
from calib.errors import UserError
from calib.models import load_model, resolve_device
from calib.santa.children import last_json, start_child
from calib.santa.commands import RLSettings
from calib.santa.policy import uniform_placements
from calib.santa.reward import RewardSettings, new_token_budgets, question_seeds, reward_prompts, score_schedule
from calib.stats import bootstrap_mean_ci, paired_bootstrap_diff

log = logging.getLogger("calib.santa")

MIN_PER_SHARD = 64  # fewer answers (questions x schedules) than this per process are scored in this process


def _prompt_dict(p: Any) -> dict[str, Any]:
    d = asdict(p)
    d["text"] = ""  # the ids are what the model reads; the text only makes the job larger
    return d


@dataclass(frozen=True)
class ScoreGroup:
    """Questions and the schedules to score each of them under (name -> per-layer S, None = dense)."""

    prompts: Sequence[Any]
    max_new: Sequence[int]  # greedy budget per question
    seeds: Sequence[int]  # sampling seed per question
    schedules: dict[str, list[int] | None]

    def unique(self) -> tuple[dict[str, list[int] | None], dict[str, str]]:
        """``(schedules to run, name -> the name it is scored under)``: equal schedules run once."""
        unique: dict[str, list[int] | None] = {}
        alias: dict[str, str] = {}
        for name, sched in self.schedules.items():
            key = None if sched is None else [int(x) for x in sched]
            alias[name] = next((n for n, s in unique.items() if s == key), name)
            if alias[name] == name:
                unique[name] = key
        return unique, alias


def run_score_job(cfg_dict: dict[str, Any], job: dict[str, Any], threads: int,
                  progress: Callable[[int], None] | None = None) -> list[dict[str, list[bool]]]:
    """Child side (``local_worker --score``): load the model, score every group of ``job`` under each
    of its schedules; ``progress(1)`` after each question scored."""
    torch.set_num_threads(max(1, threads))
    cfg = OmegaConf.create(cfg_dict)
    loaded = load_model(cfg.model, device=str(resolve_device(str(cfg.get("device", "auto")))))
    rs = RewardSettings.from_cfg(cfg)
    out = []
    for group in job["groups"]:
        prompts = [Prompt(**p) for p in group["prompts"]]
        out.append({name: score_schedule(loaded, prompts, sched, rs, group["seeds"], group["max_new"],
                                         progress=progress).tolist()
                    for name, sched in group["schedules"].items()})
    return out


def score_schedules(cfg: Any, loaded: Any, prompts: Sequence[Any], max_new: Sequence[int], seeds: Sequence[int],
                    schedules: dict[str, list[int] | None], shards: int, desc: str = "score") -> dict[str, np.ndarray]:
    """Correctness ``[len(prompts)]`` per named schedule (None = dense), over ``shards`` processes.

    Names that share a schedule are scored once (e.g. ``uniform`` and its own placement)."""
    return score_groups(cfg, loaded, [ScoreGroup(prompts, max_new, seeds, schedules)], shards, desc)[0]


def score_groups(cfg: Any, loaded: Any, groups: Sequence[ScoreGroup], shards: int,
                 desc: str = "score") -> list[dict[str, np.ndarray]]:
    """:func:`score_schedules` for several groups at once (one set of processes, one progress bar with
    an ETA over every question x schedule)."""
    plans = [g.unique() for g in groups]
    total = sum(len(g.prompts) * len(u) for g, (u, _) in zip(groups, plans))
    with tqdm(total=total, desc=desc, unit="answer", mininterval=2.0) as bar:
        got = _score_unique(cfg, loaded, [(g, u) for g, (u, _) in zip(groups, plans)], shards, bar.update)
    return [{name: scores[alias[name]] for name in g.schedules} for g, (_, alias), scores in zip(groups, plans, got)]


def _score_unique(cfg: Any, loaded: Any, work: list[tuple[ScoreGroup, dict[str, list[int] | None]]],
                  shards: int, progress: Callable[[int], None]) -> list[dict[str, np.ndarray]]:
    answers = sum(len(g.prompts) * len(unique) for g, unique in work)
    shards = max(1, min(shards, answers // MIN_PER_SHARD, min(len(g.prompts) for g, _ in work)))
    if shards == 1:
        rs = RewardSettings.from_cfg(cfg)
        return [{name: score_schedule(loaded, g.prompts, sched, rs, g.seeds, g.max_new, progress=progress)
                 for name, sched in unique.items()} for g, unique in work]
    return _score_in_children(cfg, work, shards, progress)


def _score_in_children(cfg: Any, work: list[tuple[ScoreGroup, dict[str, list[int] | None]]], shards: int,
                       progress: Callable[[int], None]) -> list[dict[str, np.ndarray]]:
    """Shard ``j`` of every group (questions ``j::shards``) in child process ``j``; progress lines
    (``{"progress": n}``) are read as they come, the report is the last line."""
    config_line = json.dumps(to_container(cfg))
    threads = max(1, (os.cpu_count() or 1) // shards)
    procs = []
    for j in range(shards):
        groups = []
        for g, unique in work:
            idx = range(j, len(g.prompts), shards)
            groups.append({"schedules": unique, "prompts": [_prompt_dict(g.prompts[i]) for i in idx],
                           "max_new": [int(g.max_new[i]) for i in idx], "seeds": [int(g.seeds[i]) for i in idx]})
        procs.append(start_child(j, 0, threads, [config_line, json.dumps({"groups": groups})], score=True))
    log.info("scoring %d question sets in %d processes", len(work), shards)
    lock, outputs = threading.Lock(), [""] * shards

    def read(j: int) -> None:
        lines = []
        for line in procs[j].stdout:
            if line.startswith('{"progress"'):
                with lock:
                    progress(int(json.loads(line)["progress"]))
            else:
                lines.append(line)
        outputs[j] = "".join(lines)

    readers = [threading.Thread(target=read, args=(j,), daemon=True) for j in range(shards)]
    for j, proc in enumerate(procs):
        proc.stdin.close()
        readers[j].start()
    for j, proc in enumerate(procs):
        readers[j].join()
        proc.wait()
        proc.stdout.close()
    out = [{name: np.zeros(len(g.prompts), dtype=bool) for name in unique} for g, unique in work]
    errors = []
    for j, proc in enumerate(procs):
        report = last_json(outputs[j], proc.returncode)
        if "scores" not in report:
            errors.append(f"shard {j}: {report.get('error', 'no report')}")
            continue
        for k, group_scores in enumerate(report["scores"]):
            for name, got in group_scores.items():
                out[k][name][j::shards] = np.asarray(got, dtype=bool)
    if errors:
        raise UserError(f"held-out scoring failed ({'; '.join(errors)})")
    return out


def _ci_metrics(name: str, ci: Any) -> dict[str, float]:
    return {name: ci.mean, f"{name}_ci_low": ci.low, f"{name}_ci_high": ci.high}


def heldout_comparison(cfg: Any, loaded: Any, learned: np.ndarray, uniform: np.ndarray, count: int,
                       shards: int) -> dict[str, float]:
    """Held-out reward of the learned vs the uniform schedule on ``count`` questions (module docstring)."""
    rs = RewardSettings.from_cfg(cfg)
    prompts = reward_prompts(cfg, loaded.tokenizer, heldout=True, count=count)
    max_new = new_token_budgets(prompts, loaded.tokenizer, rs)
    seed, resamples = int(cfg.get("seed", 0)), int(cfg.eval.bootstrap)
    same = bool(np.array_equal(learned, uniform))
    schedules: dict[str, list[int] | None] = {"learned": [int(x) for x in learned]}
    if not same:
        schedules["uniform"] = [int(x) for x in uniform]
    placements = uniform_variants(len(uniform), int(np.sum(uniform))) \
        if RLSettings.from_cfg(cfg).heldout_uniform_placements else {}
    if len(placements) > 1:
        schedules.update(placements)
    if rs.heldout_dense:
        schedules["dense"] = None
    got = score_schedules(cfg, loaded, prompts, max_new, question_seeds(seed, len(prompts)), schedules, shards,
                          desc="heldout")
    got_uniform = got["learned"].copy() if same else got["uniform"]
    ci_l = bootstrap_mean_ci(got["learned"], resamples=resamples, seed=seed)
    ci_u = bootstrap_mean_ci(got_uniform, resamples=resamples, seed=seed)
    diff = paired_bootstrap_diff(got_uniform, got["learned"], resamples=resamples, seed=seed)  # learned - uniform
    out = {**_ci_metrics("reward_learned", ci_l), **_ci_metrics("reward_uniform", ci_u),
           **_ci_metrics("reward_learned_minus_uniform", diff),
           "heldout_ci_separated": float(ci_l.low > ci_u.high), "learned_equals_uniform": float(same),
           "heldout_questions": float(len(prompts))}
    if "dense" in got:
        out["reward_dense"] = float(got["dense"].mean())
    if len(placements) > 1:
        summary = placement_summary(got, placements, resamples=resamples, seed=seed)
        out.update(summary)
        out["heldout_ci_separated_best"] = float(ci_l.low > summary["reward_uniform_best_ci_high"])
    return out


def uniform_variants(num_layers: int, budget: int) -> dict[str, list[int]]:
    """Every uniform placement at ``budget`` by name (``uniform_placement:<s_0>-<s_1>-...``)."""
    return {"uniform_placement:" + "-".join(str(int(x)) for x in s): [int(x) for x in s]
            for s in uniform_placements(num_layers, budget)}


def placement_summary(got: dict[str, np.ndarray], placements: dict[str, list[int]], *, resamples: int,
                      seed: int) -> dict[str, float]:
    """``reward_uniform_mean`` / ``reward_uniform_best`` (+ CIs) and the best placement's schedule."""
    scores = np.stack([np.asarray(got[name], dtype=np.float64) for name in placements])  # [P, n]
    best = int(np.argmax(scores.mean(axis=1)))  # first placement on ties
    out = {**_ci_metrics("reward_uniform_mean", bootstrap_mean_ci(scores.mean(axis=0), resamples=resamples, seed=seed)),
           **_ci_metrics("reward_uniform_best", bootstrap_mean_ci(scores[best], resamples=resamples, seed=seed)),
           "uniform_placements": float(len(placements))}
    out.update({f"uniform_best_schedule.layer_{i}": float(x) for i, x in enumerate(list(placements.values())[best])})
    return out
