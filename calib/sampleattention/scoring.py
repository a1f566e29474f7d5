"""Scoring SampleAttention grid points on one length bucket's profiling prompts (docs/methods.md, SampleAttention).

A point ``(alpha_c, alpha_s, chunk_n)`` is scored by plugging :class:`SampleAttentionPrefill` with that
one fixed row into the model (``runtime_kernels.hf.attach``) and answering the bucket's prompts. Two
task scores (``method.score``), both in ``[0, 1]`` per prompt and averaged over the prompts:

* ``answer_prob``: the gold answer's per-token geometric-mean probability under teacher forcing
  (:func:`teacher_forced_score`). Only the prompt's prefill runs SampleAttention; the answer tokens
  then attend densely to the sparse-prefilled KV cache, as greedy decode steps do. Continuous, so a
  threshold relative to dense bounds the *degradation* of the answers; it also gives ``tf_exact``
  (every answer token and the stop are the argmax: what greedy decoding would produce).
* ``exact_match``: greedy generation scored with ``calib.data.is_correct`` (the task's rule, as
  ``calib eval`` scores it): the paper's accuracy criterion (§4.2.6), and SmolLM2's choice
  (conf/method/sampleattention/smollm2.yaml; why: docs/notes/smollm2-investigations.md). With
  ``loop="static"`` (the recipe's choice on CUDA) prompts are answered ``batch_tokens`` at a time
  through the serving loop (``calib.generation.static_greedy_generate``, as in ``calib eval``).

A point's score is relative and per task (:meth:`BucketEvaluator.relative_score`): the worst task's
retention of its dense score, each prompt counting at most what dense scored on it. The paper tunes on
several tasks at once (§4.2.6, "multi-task tuning"): a point must keep each of them, not their average,
where a gain on one task would hide a loss on another; and within a task a sparse path that answers one
prompt dense missed and misses one dense answered has lost an answer, not broken even (such flips are the
approximation's noise, and on text it was not tuned on they fall on the losing side).
:class:`BucketEvaluator` stops a point early once it cannot reach the feasibility threshold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from calib.data import is_correct
from calib.data.prompt import answer_token_ids
from calib.generation import greedy_generate, static_greedy_generate, stop_token_ids
from calib.sampleattention.tuning import GridPoint, PointResult
from runtime_kernels import hf
from runtime_kernels.sampleattention.api import SampleAttentionPrefill
from runtime_kernels.sampleattention.buckets import BucketRow

# runtime_kernels.generate is imported where used: it imports transformers, whose import is heavy, and the
# CLI imports this module (through the recipe) for checks that must fail fast.

SCORES = ("answer_prob", "exact_match")


@dataclass(frozen=True)
class PromptScore:
    """One prompt's score and the runtime's statistics for it (empty for dense)."""

    score: float  # in [0, 1]
    exact: bool  # tf_exact (answer_prob) or exact match (exact_match)
    stats: dict[str, float]


@dataclass
class PointEval:
    """Everything measured for one grid point (the tuner sees only :meth:`result`)."""

    point: GridPoint
    scores: list[PromptScore]
    num_prompts: int  # prompts of the bucket
    score: float  # the worst task's relative score, or the early-stop upper bound when incomplete
    complete: bool  # False: stopped early (``score`` is an upper bound below the threshold)

    @property
    def mean(self) -> float:
        """Mean score of the prompts scored (absolute, the scale of the dense mean)."""
        return float(sum(s.score for s in self.scores) / max(1, len(self.scores)))

    def _mean(self, key: str) -> float | None:
        vals = [s.stats[key] for s in self.scores if key in s.stats]
        return float(sum(vals) / len(vals)) if vals else None

    @property
    def sparsity(self) -> float:
        value = self._mean("sparsity")
        return 0.0 if value is None else value

    def result(self) -> PointResult:
        return PointResult(self.score, self.sparsity, self._mean("attn_time_s"))

    def record(self) -> dict[str, Any]:
        """A flat JSON row for the tuning log."""
        return {"alpha_c": self.point.alpha_c, "alpha_s": self.point.alpha_s, "chunk_n": self.point.chunk_n,
                "score": self.score, "mean_score": self.mean, "complete": self.complete,
                "prompts_scored": len(self.scores),
                "exact": float(sum(s.exact for s in self.scores) / max(1, len(self.scores))),
                "sparsity": self.sparsity, "cra": self._mean("cra"), "cra_min": self._mean("cra_min"),
                "time_s": self._mean("attn_time_s")}


@torch.inference_mode()
def teacher_forced_score(model: Any, prompt_ids: Sequence[int], answer_ids: Sequence[int], stop_ids: set[int],
                         prefill: SampleAttentionPrefill | None) -> tuple[float, bool]:
    """``(answer probability, tf_exact)`` of one prompt; ``prefill`` (or dense when None) runs the prompt.

    Returns the geometric mean over each answer token's probability and, when ``stop_ids`` is not
    empty, the summed probability of ``stop_ids`` after the answer (``len(answer_ids) + 1`` terms):
    ``exp(mean_t log p(y_t | prompt, y_<t))``. The stop term is the end of the answer as greedy decoding
    stops (EOS or newline), for tasks scored by exact match; tasks scored by ``contains`` (a model that
    answers in a sentence) get none: their reply goes on after the answer, so the stop's probability is
    tiny whatever the attention and would bury the answer tokens' change.
    """
    from runtime_kernels.generate import cache_argument, output_cache

    device = next(model.parameters()).device
    if prefill is not None:
        hf.attach(model, prefill=prefill)
    try:
        out = model(input_ids=torch.tensor([list(prompt_ids)], device=device), use_cache=True, logits_to_keep=1)
    finally:
        if prefill is not None:
            hf.remove(model)
    logits = [out.logits[0, -1:].float()]  # [1, V]: predicts answer_ids[0]
    if answer_ids:
        cont = model(input_ids=torch.tensor([list(answer_ids)], device=device), use_cache=False,
                     **{cache_argument(model): output_cache(out)})
        logits.append(cont.logits[0].float())  # [A, V]: predicts answer_ids[1:] and the stop
    logp = torch.log_softmax(torch.cat(logits), dim=-1)  # [A + 1, V]
    targets = torch.tensor(list(answer_ids), device=logp.device, dtype=torch.long)
    token_lp = logp[torch.arange(len(answer_ids), device=logp.device), targets]  # [A]
    argmax = logp.argmax(-1)
    exact = bool((argmax[:-1] == targets).all())
    if not stop_ids:  # the reply goes on after the answer: no stop term
        return float(token_lp.mean().exp()), exact
    stops = torch.tensor(sorted(stop_ids), device=logp.device, dtype=torch.long)
    stop_lp = torch.logsumexp(logp[-1, stops], dim=0)
    terms = torch.cat([token_lp, stop_lp[None]])
    return float(terms.mean().exp()), exact and int(argmax[-1]) in stop_ids


@dataclass
class BucketEvaluator:
    """Scores grid points on one bucket's prompts; callable as the tuner's ``evaluate``.

    ``prompts`` are :class:`calib.data.Prompt` (grouped by ``task``); :meth:`dense` must run first (it scores
    every prompt densely, the reference of :meth:`relative_score`); ``threshold`` (a relative score, e.g.
    ``min_relative_score``) enables the early stop. Evaluations are cached per point; :meth:`full` re-runs
    a point stopped early.

    Early stop: prompts are scored one at a time (a batch at a time in the static loop); once even
    keeping dense's score on every remaining prompt could not lift some task's retention to the threshold, the
    point is failing whatever the rest give, and the evaluator stops and reports that upper bound as its
    score (so the decision is the one a full evaluation makes; sparsity and time are then means over the
    prompts scored). :meth:`dense` orders the prompts so that likely failures come first: ascending
    dense answer probability (``answer_prob``), dense-correct first (``exact_match``).
    """

    loaded: Any  # calib.models.LoadedModel
    prompts: list[Any]
    blk: int
    score: str = "answer_prob"
    max_new_tokens: int = 16
    loop: str = "eager"  # exact_match: "eager" (one prompt at a time) or "static" (batches, the serving loop)
    batch_tokens: int = 16384  # static loop: prompts per batch = max(1, batch_tokens // longest prompt)
    timing: bool = False
    report_cra: bool = True
    on_point: Callable[[PointEval], None] | None = None
    threshold: float | None = None
    cache: dict[GridPoint, PointEval] = field(default_factory=dict)
    dense_scores: list[PromptScore] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r}; use one of {SCORES}")
        if self.loop not in ("eager", "static"):
            raise ValueError(f"loop={self.loop!r}; use eager or static")
        tok = self.loaded.tokenizer
        self._rule_stops = {rule: stop_token_ids(tok, newline=rule == "exact_match")
                            for rule in ("exact_match", "contains")}
        self._answers = [answer_token_ids(tok, p) for p in self.prompts]

    def _score_prompt(self, index: int, rt: SampleAttentionPrefill | None) -> PromptScore:
        p = self.prompts[index]
        if self.score == "answer_prob":
            stops = self._rule_stops["exact_match"] if getattr(p, "scoring", "exact_match") == "exact_match" else set()
            value, exact = teacher_forced_score(self.loaded.model, p.input_ids, self._answers[index], stops, rt)
        else:
            value, exact = self._answer([p], rt)[0]
        stats = rt.pop_stats() if rt is not None else {}
        return PromptScore(value, exact, stats)

    def _answer(self, prompts: list[Any], rt: SampleAttentionPrefill | None) -> list[tuple[float, bool]]:
        """Greedy answers of ``prompts`` (one rule) scored by their task's rule: eager one prompt at a
        time, or one ragged batch through the serving loop."""
        model = self.loaded.model
        stops = self._rule_stops[getattr(prompts[0], "scoring", "exact_match")]
        if rt is not None:
            hf.attach(model, prefill=rt)
        try:
            if self.loop == "static":
                gens = static_greedy_generate(model, [p.input_ids for p in prompts], self.max_new_tokens, stops)
            else:
                gens = [greedy_generate(model, p.input_ids, self.max_new_tokens, stops) for p in prompts]
        finally:
            if rt is not None:
                hf.remove(model)
        oks = [is_correct(self.loaded.tokenizer.decode(g, skip_special_tokens=True), p) for g, p in zip(gens, prompts)]
        return [(float(ok), ok) for ok in oks]

    def _chunks(self) -> list[list[int]]:
        """Prompt indices in scoring order, grouped as they are answered: one at a time, or (static
        exact_match) runs of one scoring rule of at most ``batch_tokens // longest prompt`` prompts."""
        n = len(self.prompts)
        if self.score != "exact_match" or self.loop != "static":
            return [[i] for i in range(n)]
        size = max(1, self.batch_tokens // max(len(p.input_ids) for p in self.prompts))
        chunks: list[list[int]] = []
        for i in range(n):
            rule = getattr(self.prompts[i], "scoring", "exact_match")
            last = chunks[-1] if chunks else None
            if last and len(last) < size and getattr(self.prompts[last[0]], "scoring", "exact_match") == rule:
                last.append(i)
            else:
                chunks.append([i])
        return chunks

    def _score_chunk(self, chunk: list[int], rt: SampleAttentionPrefill | None) -> list[PromptScore]:
        """Scores of the prompts ``chunk``; a batch's runtime statistics go to each of its prompts (its
        attention time split evenly among them)."""
        if len(chunk) == 1:
            return [self._score_prompt(chunk[0], rt)]
        answers = self._answer([self.prompts[i] for i in chunk], rt)
        stats = rt.pop_stats() if rt is not None else {}
        if "attn_time_s" in stats:
            stats["attn_time_s"] /= len(chunk)
        return [PromptScore(value, exact, dict(stats)) for value, exact in answers]

    def dense(self) -> float:
        """Dense score of the bucket; reorders the prompts so likely failures are scored first."""
        scores = [score for chunk in self._chunks() for score in self._score_chunk(chunk, None)]
        order = sorted(range(len(scores)), key=lambda i: scores[i].score if self.score == "answer_prob"
                       else -scores[i].score)
        self.prompts = [self.prompts[i] for i in order]
        self._answers = [self._answers[i] for i in order]
        self.dense_scores = [scores[i] for i in order]
        return float(sum(s.score for s in scores) / len(scores))

    def task(self, index: int) -> str:
        """The task of the prompt at ``index`` in scoring order."""
        return str(getattr(self.prompts[index], "task", ""))

    def _require_dense(self) -> None:
        if len(self.dense_scores) != len(self.prompts):
            raise RuntimeError("BucketEvaluator.dense() must run before points are scored")

    def relative_score(self, scores: Sequence[PromptScore]) -> float:
        """The worst task's retention of its dense score: per task ``sum_i min(s_i, d_i) / sum_i d_i`` over
        its prompts (``s_i`` this point's score, ``d_i`` dense's), ``scores`` being the first
        ``len(scores)`` prompts' (in scoring order) and every prompt not yet scored keeping all of ``d_i``:
        the exact figure once every prompt is scored, an upper bound before. A prompt the sparse path
        answers better than dense adds nothing, so a gain cannot hide a loss, across tasks or within one
        (with exact match: the share of dense's correct answers the point keeps). A task whose dense
        scores are all 0 has nothing to lose and is left out (1.0 when no task is left)."""
        self._require_dense()
        kept: dict[str, float] = {}
        total: dict[str, float] = {}
        for i, dense in enumerate(self.dense_scores):
            task = self.task(i)
            kept[task] = kept.get(task, 0.0) + (min(scores[i].score, dense.score) if i < len(scores) else dense.score)
            total[task] = total.get(task, 0.0) + dense.score
        return min((kept[t] / total[t] for t in total if total[t] > 0), default=1.0)

    def evaluate(self, point: GridPoint, *, allow_stop: bool = True) -> PointEval:
        """Score ``point`` on the bucket's prompts (cached; a cached early stop is redone if not allowed)."""
        cached = self.cache.get(point)
        if cached is not None and (cached.complete or allow_stop):
            return cached
        self._require_dense()
        row = BucketRow(float(point.alpha_c), float(point.alpha_s), int(point.chunk_n))
        rt = SampleAttentionPrefill(row, blk=self.blk, report_cra=self.report_cra, timing=self.timing)
        n, scores = len(self.prompts), []
        for chunk in self._chunks():
            scores += self._score_chunk(chunk, rt)
            bound = self.relative_score(scores)
            if allow_stop and self.threshold is not None and len(scores) < n and bound < self.threshold:
                result = PointEval(point, scores, n, bound, complete=False)
                break
        else:
            result = PointEval(point, scores, n, self.relative_score(scores), complete=True)
        self.cache[point] = result
        if self.on_point is not None:
            self.on_point(result)
        return result

    def __call__(self, alpha_c: float, alpha_s: float, chunk_n: int) -> PointResult:
        return self.evaluate(GridPoint(alpha_c, alpha_s, chunk_n)).result()

    def full(self, point: GridPoint) -> PointEval:
        """``point`` scored on every prompt (reuses a complete cached evaluation)."""
        return self.evaluate(point, allow_stop=False)
