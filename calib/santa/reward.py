"""The SANTA REINFORCE reward: accuracy on a batch of questions with S²ANTA at a per-layer schedule.

Lee et al., arXiv:2605.01910, App. K: a reward is the fraction of ``rl.questions_per_episode`` questions answered
correctly when every attention layer ``l`` runs S²ANTA with ``S = max(1, s_l)`` samples, in ``method.reward.phases``
(prefill and decode, as in the paper's GSM8K runs). Questions come from a pool (:func:`reward_prompts`):
synthetic tasks (``method.reward.pool`` prompts of ``method.reward.length`` tokens, calibration seed
``data.seed``; held out: ``eval.seed``, never overlapping) or the calibration / evaluation split of a file or
hub source (``data=hf``, ``data=jsonl``).

Each question is answered greedily in the loop ``method.reward.loop`` picks (:meth:`RewardSettings.loop_on`,
:func:`answer_correct`), each batch row sampled under its own seed, so an answer does not depend on its batch
(:class:`runtime_kernels.santa.draws.SamplingSeeds`). New tokens: ``method.reward.max_new_tokens``, or when null
the answer's token count + 2 (room for a closing quote and the stop token) capped by ``eval.max_new_tokens``,
or that cap itself for a task scored by ``contains`` (:func:`new_token_budgets`). How to pick a starved N:
:mod:`calib.santa.sweep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from calib.config import require
from calib.data import build_prompts, is_correct
from calib.errors import UserError
from calib.generation import equal_length_batches, equal_length_greedy_generate, static_greedy_generate, stop_token_ids
from calib.recipe_settings import Section
from runtime_kernels import hf
from runtime_kernels.santa.reference import ESTIMATORS, TILINGS
from runtime_kernels.santa.runtime import SantaDecode

Evaluate = Callable[[list[int], np.random.Generator], float]
SEED_BOUND = 2**62  # torch.Generator.manual_seed takes a 64-bit seed
LOOPS = ("auto", "eager", "static")


@dataclass(frozen=True)
class RewardSettings:
    """What a reward episode runs (``method.*``, ``method.reward.*`` and ``rl.questions_per_episode``),
    read and range-checked once (conf/method/santa/default.yaml documents every key)."""

    estimator: str
    tiling: str
    tile: int
    phases: tuple[str, ...]
    questions: int  # per episode
    max_new_tokens: int | None  # None: answer tokens + 2, capped by cap_new_tokens
    cap_new_tokens: int
    batch_tokens: int = 0  # questions of one length answered together, up to this many prompt tokens
    loop: str = "auto"  # auto | eager | static (module docstring)
    tasks: list[str] | None = None  # synthetic tasks of the questions (None: data.tasks)
    length: int | None = None  # synthetic question length in tokens (None: the shortest data length)
    pool: int = 128  # reward questions that episodes draw from
    heldout_dense: bool = True  # also score the held-out questions densely

    @classmethod
    def from_cfg(cls, cfg: Any) -> "RewardSettings":
        m = Section(cfg.method, "method")
        r = m.section("reward")
        estimator, tiling = m.choice("estimator", ESTIMATORS), m.choice("tiling", TILINGS)
        require(tiling == "none" or estimator == "sys", f"method.tiling={tiling} samples systematically inside "
                                                        "tiles: use method.estimator=sys (or method.tiling=none)")
        phases = r.names("phases")
        require("decode" in phases and set(phases) <= {"prefill", "decode"},
                f"method.reward.phases must be [decode] or [prefill,decode] (got {phases})")
        questions = Section(cfg.rl, "rl").integer("questions_per_episode", at_least=1)
        pool = r.integer("pool")
        require(pool >= questions, f"method.reward.pool ({pool}) must be >= rl.questions_per_episode ({questions}): "
                                   "an episode draws distinct questions")
        ev = Section(cfg.eval, "eval")
        return cls(estimator=estimator, tiling=tiling, tile=m.integer("tile", at_least=1), phases=tuple(phases),
                   questions=questions, max_new_tokens=r.integer("max_new_tokens", optional=True, at_least=1),
                   cap_new_tokens=ev.integer("max_new_tokens", at_least=1),
                   batch_tokens=ev.integer("batch_tokens", at_least=0), loop=r.choice("loop", LOOPS),
                   tasks=r.names("tasks", optional=True), length=r.integer("length", optional=True, at_least=16),
                   pool=pool, heldout_dense=r.flag("heldout_dense"))

    def loop_on(self, device: Any) -> str:
        """The loop that answers on ``device``: ``auto`` is ``static`` on CUDA, else ``eager``.

        ``static`` is the serving loop (:func:`calib.generation.static_greedy_generate`: a preallocated cache
        and one CUDA graph per decode step, captured again per batch since the schedule is part of the graph;
        rows of different token counts share a batch, each decoded at its own position).
        ``eager`` is transformers' DynamicCache with a Python pass over the layers per step, launch-bound for
        a small model. Both draw the same samples (offsets keyed by seed, layer and position:
        :mod:`runtime_kernels.santa.draws`), so they answer alike up to floating-point ties; the static loop
        decodes every step of the budget (a graph cannot stop early) and cuts each reply at its stop token.
        """
        if self.loop != "auto":
            return self.loop
        return "static" if getattr(device, "type", str(device)) == "cuda" else "eager"


def reward_length(cfg: Any) -> int:
    """Prompt length of synthetic reward questions (``method.reward.length``, null: shortest data length)."""
    length = RewardSettings.from_cfg(cfg).length
    return length if length is not None else min(int(x) for x in cfg.data.lengths)


def reward_prompts(cfg: Any, tokenizer: Any, *, heldout: bool, count: int, skip: int = 0,
                   setting: str | None = None, allow_fewer: bool = False, length: int | None = None) -> list[Any]:
    """The reward pool (``heldout=False``: calibration seed/split) or the held-out questions.

    Synthetic data: ``ceil(count / tasks)`` prompts per task, taken round-robin over tasks, ``count``
    in all. File/hub data: the first ``count`` rows of the split. ``skip``: leave out the first
    ``skip`` questions of that order (synthetic: the first ``ceil(skip / tasks)`` of every task), so
    ``skip=method.reward.pool`` gives calibration-side questions the reward pool does not hold. ``length``:
    synthetic prompts of this many tokens instead of :func:`reward_length` (file data: ignored).
    Raises UserError (naming ``setting``, the config key of ``count``) if fewer exist, or, with
    ``allow_fewer`` (a file with few rows), only if none does.
    """
    data = cfg.data
    purpose = "evaluation" if heldout else "calibration"
    which = setting or ("rl.heldout_questions" if heldout else "method.reward.pool")
    if str(data.get("source", "synthetic")) == "synthetic":
        tasks = [str(t) for t in (RewardSettings.from_cfg(cfg).tasks or data.tasks)]
        per_task, skip_per_task = -(-count // len(tasks)), -(-skip // len(tasks))
        seed = int(cfg.eval.seed if heldout else data.seed)
        length = reward_length(cfg) if length is None else int(length)
        prompts = build_prompts(data, tokenizer, seed=seed, lengths=[length], tasks=tasks,
                                num_prompts=skip_per_task + per_task, purpose=purpose)
        by_task = [[p for p in prompts if p.task == t][skip_per_task:] for t in tasks]
        prompts = [q[i] for i in range(per_task) for q in by_task if i < len(q)]
    else:
        prompts = build_prompts(data, tokenizer, num_prompts=skip + count, purpose=purpose)[skip:]
    if len(prompts) < count and not (allow_fewer and prompts):
        raise UserError(f"only {len(prompts)} {purpose} questions available but {which}={count}"
                        f"{f' after the {skip} of the reward pool' if skip else ''}; "
                        f"lower {which} or provide more data")
    return prompts[:count]


def new_token_budgets(prompts: Sequence[Any], tokenizer: Any, settings: RewardSettings) -> list[int]:
    """Greedy decoding budget per prompt (see the module docstring)."""
    if settings.max_new_tokens is not None:
        return [settings.max_new_tokens] * len(prompts)
    out = []
    for p in prompts:
        if getattr(p, "scoring", "exact_match") == "contains":
            out.append(settings.cap_new_tokens)
            continue
        n = len(tokenizer(" " + p.answer, add_special_tokens=False)["input_ids"]) + 2
        out.append(max(1, min(n, settings.cap_new_tokens)))
    return out


def make_runtime(budgets: Sequence[int], settings: RewardSettings, seed: int | None = None) -> Any:
    """The S²ANTA runtime of one episode: per-layer ``S = budgets`` (0 runs as 1)."""
    return SantaDecode(list(budgets), estimator=settings.estimator, tiling=settings.tiling, tile=settings.tile,
                       phases=settings.phases, seed=seed)


def question_seeds(seed: int, count: int) -> list[int]:
    """One sampling seed per question, a function of ``(seed, position)`` only (so shards agree)."""
    state = np.random.SeedSequence([int(seed), 0x5A17A]).generate_state(count, dtype=np.uint64)
    return [int(x) % SEED_BOUND for x in state]


@torch.inference_mode()
def answer_correct(loaded: Any, prompts: Sequence[Any], max_new: Sequence[int], runtime: Any | None,
                   seeds: Sequence[int] | None = None, desc: str = "santa",
                   progress: Callable[[int], None] | None = None, batch_tokens: int = 0,
                   loop: str = "eager") -> np.ndarray:
    """Greedy answers with ``runtime`` attached (None: dense); ``[len(prompts)]`` bool, each scored by its
    task's rule (``data.scoring``: exact match, or the answer contained in the reply).

    ``batch_tokens > 0``: questions of one scoring rule and decoding budget are answered together, up to
    that many prompt tokens per batch (:func:`calib.generation.equal_length_batches`; no padding, so every
    attention call sees what it sees for one question): of one token count in the eager loop, of any
    count in the static loop (a ragged batch, each row decoded at its own position). ``seeds``: the runtime is
    reseeded with ``seeds[i]`` for question ``i``, one seed per batch row, so its sampling does not
    depend on which other questions ran before it or beside it (up to the floating-point effects of
    batched matrix products). ``loop``: ``eager`` or ``static`` (module docstring).
    """
    # an exact-match answer ends at the first newline; a contained one may come after a line break
    stops = {rule: stop_token_ids(loaded.tokenizer, newline=rule == "exact_match") for rule in ("exact_match", "contains")}
    rules = [getattr(p, "scoring", "exact_match") for p in prompts]
    batches = equal_length_batches([len(p.input_ids) for p in prompts], batch_tokens,
                                   [(rule, int(n)) for rule, n in zip(rules, max_new)], ragged=loop == "static")
    correct = np.zeros(len(prompts), dtype=bool)
    generate = static_greedy_generate if loop == "static" else equal_length_greedy_generate
    if runtime is not None:
        hf.attach(loaded.model, prefill=runtime if runtime.phase == "both" else None, decode=runtime)
    try:
        with tqdm(total=len(prompts), desc=f"score {desc}", unit="question", leave=False,
                  disable=progress is not None or len(prompts) < 64 or None) as bar:
            for batch in batches:
                if runtime is not None and seeds is not None:
                    runtime.reseed([int(seeds[i]) for i in batch])
                first = batch[0]
                rows = generate(loaded.model, [prompts[i].input_ids for i in batch],
                                int(max_new[first]), stops[rules[first]])
                for i, row in zip(batch, rows):
                    correct[i] = is_correct(loaded.tokenizer.decode(row, skip_special_tokens=True), prompts[i])
                    if progress is not None:
                        progress(1)
                bar.update(len(batch))
    finally:
        if runtime is not None:
            hf.remove(loaded.model)
    return correct


def score_schedule(loaded: Any, prompts: Sequence[Any], budgets: Sequence[int] | None, settings: RewardSettings,
                   seeds: Sequence[int], max_new: Sequence[int] | None = None,
                   progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Per-question correctness of ``prompts`` at schedule ``budgets`` (None: dense attention), question
    ``i`` sampled with ``seeds[i]``; ``progress(1)`` after each question."""
    max_new = list(max_new) if max_new is not None else new_token_budgets(prompts, loaded.tokenizer, settings)
    runtime = None if budgets is None else make_runtime(budgets, settings)
    desc = "dense" if budgets is None else "S=" + ",".join(str(int(b)) for b in budgets)
    extra = {"progress": progress} if progress is not None else {}
    return answer_correct(loaded, prompts, max_new, runtime, seeds=seeds, desc=desc,
                          batch_tokens=settings.batch_tokens, loop=settings.loop_on(loaded.device), **extra)


def make_evaluator(cfg: Any, loaded: Any, prompts: Sequence[Any]) -> Evaluate:
    """``evaluate(budgets, rng) -> reward``: ``rl.questions_per_episode`` questions of ``prompts`` drawn
    with ``rng`` (without replacement), answered with S²ANTA at ``budgets``; the fraction correct.

    The runtime's sampling seeds (one per question) are drawn from ``rng`` too, so an episode is a
    function of the rng state.
    """
    settings = RewardSettings.from_cfg(cfg)
    pool = list(prompts)
    if len(pool) < settings.questions:
        raise UserError(f"the reward pool has {len(pool)} questions but rl.questions_per_episode="
                        f"{settings.questions}; raise method.reward.pool")
    max_new = new_token_budgets(pool, loaded.tokenizer, settings)
    layers = int(loaded.model.config.num_hidden_layers)

    def evaluate(budgets: list[int], rng: np.random.Generator) -> float:
        if len(budgets) != layers:
            raise ValueError(f"a schedule for {len(budgets)} layers; the model has {layers}")
        idx = rng.choice(len(pool), size=settings.questions, replace=False)
        seeds = rng.integers(SEED_BOUND, size=settings.questions).tolist()
        correct = score_schedule(loaded, [pool[i] for i in idx], budgets, settings, seeds, [max_new[i] for i in idx])
        return float(correct.mean())

    return evaluate
