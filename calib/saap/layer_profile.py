"""SAAP's per-layer ℓ, chosen by greedy answers (``method.layer_profile``; our extension, off by default).

The paper visits the same ℓ buckets in every layer (Mazaré et al., arXiv:2502.08246, §4, "Query assignment
function"). A small model can need more buckets in a few layers only, and attention recall per layer does
not point at them (SmolLM2-135M: docs/notes/smollm2-investigations.md, SAAP), so the choice is made the way
SampleAttention's profiling makes its own (Zhu et al., arXiv:2406.15486, §4.2.6): by whether greedy
answers survive.

:func:`search` answers ``prompts`` profiling prompts with gold answers (``data.seed``, the calibration
side, at ``length``: default the longest data length, where SAAP loses most) densely once, then under
candidate ``{layer: ℓ}`` settings: ℓ = ``top_l`` everywhere, then greedy groups of consecutive layers
at ℓ = C, then a ladder lowering the chosen groups' ℓ. If no setting passes within ``max_groups``
groups, every sparse layer's ℓ is widened up the same ladder (the chosen groups stay at C), then bisected
between the last failing rung and C, where every bucket is read: accuracy before selectivity, as a user
deploying the artifact expects. A layer at ℓ = C runs dense attention, here as in serving
(``SaapDecode.reads_every_key``), so ℓ = C everywhere answers as dense does and passes; such an artifact
costs nothing and saves nothing (the run warns). Design notes: docs/notes/saap-recipe.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from calib.data import build_prompts, take_in_turn
from calib.errors import UserError
from calib.evaluate import answer_prompts, cached_dense_answers, eval_loop
from calib.recipe_settings import Section
from runtime_kernels import hf
from runtime_kernels.saap import SaapDecode
from runtime_kernels.saap.reference import SaapLayerParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileSettings:
    """``method.layer_profile`` (conf/method/saap/default.yaml documents every key)."""

    enabled: bool = False
    prompts: int = 96
    length: int | None = None
    tasks: list[str] | None = None
    group: int = 5
    max_groups: int = 2
    ladder: list[int] | None = None
    max_drop: float = 0.01
    batch_tokens: int = 16384

    @classmethod
    def read(cls, p: Section) -> "ProfileSettings":
        """The settings of node ``p`` (``method.layer_profile``), range-checked in one-line errors."""
        return cls(enabled=p.flag("enabled"), prompts=p.integer("prompts", at_least=1),
                   length=p.integer("length", optional=True, at_least=1), tasks=p.names("tasks", optional=True),
                   group=p.integer("group", at_least=1), max_groups=p.integer("max_groups", at_least=1),
                   ladder=p.integers("ladder", optional=True, at_least=1),
                   max_drop=p.number("max_drop", at_least=0, below=1),
                   batch_tokens=p.integer("batch_tokens", at_least=0))


@dataclass(frozen=True)
class Trial:
    """One setting's answers: ``top_l_layers`` on top of ``top_l``, correct answers, mean selectivity."""

    top_l_layers: dict[int, int]
    correct: int
    selectivity: float
    step: str


@dataclass
class ProfileResult:
    """The chosen ``{layer: ℓ}``, whether it passed, and every trial in the order it ran."""

    top_l_layers: dict[int, int]
    passed: bool
    dense_correct: int
    prompts: int
    trials: list[Trial] = field(default_factory=list)

    def chosen(self) -> Trial:
        return next(t for t in reversed(self.trials) if t.top_l_layers == self.top_l_layers)

    def metrics(self) -> dict[str, float]:
        """Headline numbers for MLflow (``layer_profile.*``)."""
        base, chosen = self.trials[0], self.chosen()
        n = max(1, self.prompts)
        return {"layer_profile.dense_acc": self.dense_correct / n, "layer_profile.base_acc": base.correct / n,
                "layer_profile.base_selectivity": base.selectivity, "layer_profile.acc": chosen.correct / n,
                "layer_profile.selectivity": chosen.selectivity, "layer_profile.passed": float(self.passed),
                "layer_profile.layers_raised": float(len(self.top_l_layers)),
                "layer_profile.trials": float(len(self.trials))}

    def table(self) -> list[dict[str, Any]]:
        """Every trial as a row (the MLflow payload and the run's log)."""
        n = max(1, self.prompts)
        return [{"step": t.step, "top_l_layers": {str(k): v for k, v in sorted(t.top_l_layers.items())},
                 "acc": t.correct / n, "selectivity": t.selectivity} for t in self.trials]


def layer_groups(layers: Sequence[int], size: int) -> list[list[int]]:
    """``layers`` (sorted) cut into runs of ``size`` consecutive entries, the last one shorter."""
    ordered = sorted(layers)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def default_ladder(top_l: int, clusters: int) -> list[int]:
    """``2·top_l, 4·top_l, …`` below ``clusters`` (ℓ = C is the search's own top rung)."""
    out, value = [], 2 * top_l
    while value < clusters:
        out.append(value)
        value *= 2
    return out


def ladder_rungs(settings: ProfileSettings, top_l: int, clusters: int) -> list[int]:
    """The ℓ the ladder tries, ascending: ``settings.ladder`` (default :func:`default_ladder`) strictly
    between ``top_l`` and ``clusters``."""
    ladder = settings.ladder if settings.ladder is not None else default_ladder(top_l, clusters)
    return sorted(x for x in set(ladder) if top_l < x < clusters)


def widen_values(last_failing: int, top_l: int, clusters: int) -> list[int]:
    """The ℓ that widening bisects once every ladder rung failed: multiples of ``top_l`` above
    ``last_failing`` (the highest failing rung, or ``top_l``) below ``clusters``, then ``clusters`` itself."""
    return [*range(last_failing + top_l, clusters, top_l), clusters]


def bisection_trials(values: int) -> int:
    """The most settings a bisection for the smallest passing one of ``values`` answers."""
    return math.ceil(math.log2(values)) + 1 if values > 1 else values


def max_trials(num_layers: int, settings: ProfileSettings, top_l: int, clusters: int) -> int:
    """The most settings :func:`search` can answer: the base, every remaining group in each of
    ``max_groups`` rounds, every ladder rung, then the widening's bisection up to ``clusters``."""
    groups = len(layer_groups(list(range(num_layers)), settings.group))
    rounds = sum(groups - r for r in range(min(settings.max_groups, groups)))
    rungs = ladder_rungs(settings, top_l, clusters)
    tail = widen_values(max(rungs, default=top_l), top_l, clusters) if top_l < clusters else []
    return 1 + rounds + len(rungs) + bisection_trials(len(tail))


def search(layers: Sequence[int], top_l: int, clusters: int, settings: ProfileSettings, dense_correct: int,
           prompts: int, score: Callable[[dict[int, int]], tuple[int, float]]) -> ProfileResult:
    """The greedy search for per-layer ℓ. ``score({layer: ℓ})`` answers the profiling prompts with those
    layers' ℓ on top of ``top_l`` and returns ``(correct answers, mean selectivity)``.

    1. The dense answers are scored once (``dense_correct``). A setting *passes* when its correct answers
       are at least the dense count less ``max_drop`` of the prompts.
    2. ℓ = ``top_l`` everywhere: if it passes, no layer changes.
    3. Greedy groups: the sparse layers are cut into runs of ``group`` consecutive layers. Each round tries
       every group not yet chosen at ℓ = C (every bucket) on top of those chosen, and keeps the one with
       the most correct answers (ties: fewer keys read, then the earlier group). It stops when a setting
       passes or ``max_groups`` are chosen.
    4. Ladder: with the chosen groups passing at ℓ = C, their ℓ is lowered to the smallest of ``ladder``
       (default: ``2·top_l, 4·top_l, …`` below C) that still passes.
    5. Widening, when step 3 ends without a pass: every other sparse layer's ℓ climbs the same ladder, the
       chosen groups at C, until a setting passes; past the last rung the smallest passing ℓ among
       :func:`widen_values` (up to C, every bucket) is bisected for, assuming answers do not drop as ℓ
       grows. When none passes the most correct setting found is kept (warned).
    Steps 4 and 5 exclude each other, so :func:`max_trials` bounds both.
    """
    need = dense_correct - settings.max_drop * prompts
    result = ProfileResult({}, False, dense_correct, prompts)
    seen: dict[tuple[tuple[int, int], ...], Trial] = {}

    def run(setting: dict[int, int], step: str) -> Trial:
        key = tuple(sorted(setting.items()))
        if key not in seen:
            correct, selectivity = score(dict(setting))
            seen[key] = Trial(dict(setting), int(correct), float(selectivity), step)
            result.trials.append(seen[key])
            log.info("SAAP layer profile %s: %d/%d correct (dense %d) at selectivity %.3f", step, correct,
                     prompts, dense_correct, selectivity)
        return seen[key]

    current = run({}, "base")
    if current.correct >= need:
        result.passed = True
        return result
    chosen: list[list[int]] = []
    remaining = layer_groups(layers, settings.group)
    while remaining and len(chosen) < settings.max_groups and current.correct < need:
        base = {l: clusters for g in chosen for l in g}
        tried = [(run({**base, **{l: clusters for l in g}}, f"group {g[0]}-{g[-1]}"), i)
                 for i, g in enumerate(remaining)]
        current, i = max(tried, key=lambda ti: (ti[0].correct, -ti[0].selectivity, -ti[1]))
        chosen.append(remaining.pop(i))
    if current.correct < need:
        return _widen(layers, chosen, top_l, clusters, settings, need, result, run,
                      ladder_rungs(settings, top_l, clusters))
    raised = [l for g in chosen for l in g]
    result.top_l_layers, result.passed = {l: clusters for l in raised}, True
    for value in ladder_rungs(settings, top_l, clusters):
        if run({l: value for l in raised}, f"ladder {value}").correct >= need:
            result.top_l_layers = {l: value for l in raised}
            break
    return result


def _widen(layers: Sequence[int], chosen: list[list[int]], top_l: int, clusters: int, settings: ProfileSettings,
           need: float, result: ProfileResult, run: Callable[[dict[int, int], str], Trial],
           rungs: list[int]) -> ProfileResult:
    """Step 5 of :func:`search`: every sparse layer at each rung in turn (the chosen groups at C) until one
    passes, then a bisection for the smallest passing ℓ above the last rung, up to C; else the setting with
    the most correct answers (fewer keys read on a tie), with a warning."""
    raised = {l: clusters for g in chosen for l in g}

    def widened(value: int) -> Trial:
        return run({**{l: value for l in layers}, **raised}, f"widen {value}")

    passing = next((t for t in map(widened, rungs) if t.correct >= need), None)
    if passing is None and top_l < clusters:
        values = widen_values(max(rungs, default=top_l), top_l, clusters)
        lo, hi = 0, len(values) - 1  # invariant: every value below values[lo] failed
        while lo < hi:
            mid = (lo + hi) // 2
            if widened(values[mid]).correct >= need:
                hi = mid
            else:
                lo = mid + 1
        trial = widened(values[lo])  # answered already unless lo is the last value
        passing = trial if trial.correct >= need else None
    if passing is not None:
        result.top_l_layers, result.passed = dict(passing.top_l_layers), True
        widest = min(passing.top_l_layers.values())
        if widest >= clusters:
            log.warning("SAAP layer profile: only ℓ = C (every bucket) in every sparse layer kept dense's answers: "
                        "the artifact reads every key, and serving runs flash-decoding")
        else:
            log.warning("SAAP layer profile: dense's answers needed ℓ >= %d of C = %d in every sparse layer, "
                        "reading %.0f %% of the keys: SAAP saves little on this model", widest, clusters,
                        100 * passing.selectivity)
        return result
    top = max(result.trials, key=lambda t: (t.correct, -t.selectivity))
    result.top_l_layers = dict(top.top_l_layers)
    log.warning("SAAP layer profile: no setting within %d groups and ℓ up to C = %d kept dense's answers (%d of %d; "
                "dense %d); the artifact keeps the best found, %s", settings.max_groups, clusters,
                top.correct, result.prompts, result.dense_correct, top.top_l_layers or "no per-layer ℓ")
    return result


# ------------------------------------------------------------------------------ the model's side
def profiling_prompts(cfg: Any, ps: ProfileSettings, tokenizer: Any, exclude: set[str] = frozenset()) -> list[Any]:
    """``ps.prompts`` prompts of the calibration side (``data.seed``) at ``ps.length`` (default: the
    longest data length), the tasks (``ps.tasks``, default ``data.tasks``) taken in turn, none of
    ``exclude`` (the prompt ids the classifiers trained on: a setting is judged on prompts they never
    saw); each needs its gold answer."""
    length = ps.length if ps.length is not None else max(int(x) for x in cfg.data.lengths)
    tasks = ps.tasks or [str(t) for t in cfg.data.tasks or []]
    per = -(-ps.prompts // max(1, len(tasks))) + len(exclude)
    built = build_prompts(cfg.data, tokenizer, seed=int(cfg.data.seed), lengths=[length], tasks=tasks or None,
                          num_prompts=per, purpose="calibration")
    chosen = take_in_turn([p for p in built if p.prompt_id not in exclude], ps.prompts)
    if len(chosen) < ps.prompts:
        raise UserError(f"method.layer_profile needs {ps.prompts} prompts at {length} tokens but the data "
                        f"gives {len(chosen)}: lower method.layer_profile.prompts")
    missing = [p.prompt_id for p in chosen if getattr(p, "answer", None) in (None, "")]
    if missing:
        raise UserError(f"method.layer_profile scores greedy answers, but prompt {missing[0]} has no gold answer")
    return chosen


@dataclass
class AnswerScorer:
    """``score`` of :func:`search` on a model: answers ``prompts`` greedily with SAAP's runtime built
    from the just-trained ``per_layer`` params (one :class:`SaapLayerParams` per model layer, dense ones
    included) at ``top_l`` with ``{layer: ℓ}`` on top of ``base_layers``, through ``loop`` (as
    ``calib eval`` on this device), SAAP and its selectivity count at every step (``hf.attach``'s ``serve="method"``)."""

    loaded: Any
    prompts: list[Any]
    per_layer: list[Any]
    top_l: int
    base_layers: dict[int, int]
    max_new_tokens: int
    batch_tokens: int
    loop: str

    def answers(self, setting: dict[int, int]) -> list[Any]:
        runtime = SaapDecode(self.per_layer, self.top_l, top_l_layers={**self.base_layers, **setting}, stats=True)
        state = hf.attach(self.loaded.model, decode=runtime)
        try:
            return answer_prompts(self.loaded, self.prompts, self.max_new_tokens, state, desc="saap ℓ profile",
                                  batch_tokens=self.batch_tokens, loop=self.loop)
        finally:
            hf.remove(self.loaded.model)

    def __call__(self, setting: dict[int, int]) -> tuple[int, float]:
        answers = self.answers(setting)
        sel = [r.stats["selectivity"] for r in answers if "selectivity" in r.stats]
        return sum(r.correct for r in answers), sum(sel) / len(sel) if sel else float("nan")


def profile(cfg: Any, ps: ProfileSettings, loaded: Any, params: dict[int, Any], s: Any, device: Any,
            exclude: set[str] = frozenset()) -> ProfileResult:
    """Run :func:`search` on the model: profiling prompts answered densely once (the eval's cache), then
    by :class:`AnswerScorer` with the just-trained ``params`` (``{layer: SaapLayerParams}``, sparse
    layers) at each candidate ``{layer: ℓ}``; ``exclude``: the calibration prompts' ids."""
    prompts = profiling_prompts(cfg, ps, loaded.tokenizer, exclude)
    trials, on_cpu = max_trials(len(params), ps, s.top_l, s.clusters), str(device).startswith("cpu")
    (log.warning if on_cpu else log.info)(
        "SAAP layer profile: up to %d greedy answers of %d-token prompts (dense + at most %d settings)%s",
        len(prompts) * (1 + trials), prompts[0].length, trials,
        "; on a CPU that takes hours: method.layer_profile.enabled=false skips it"
        if on_cpu else "")
    loop = eval_loop(cfg, device, "saap")
    max_new, batch = int(cfg.eval.max_new_tokens), ps.batch_tokens
    dense = cached_dense_answers(loaded, prompts, max_new, batch, loop)
    bn_eps = next(iter(params.values())).bn_eps
    per_layer = [params[i] if i in params else SaapLayerParams(sink=s.sink, recent=s.recent, dense=True, bn_eps=bn_eps)
                 for i in range(loaded.facts.num_layers)]
    scorer = AnswerScorer(loaded, prompts, per_layer, s.top_l, dict(s.top_l_layers), max_new, batch, loop)
    return search(sorted(params), s.top_l, s.clusters, ps, sum(r.correct for r in dense), len(prompts), scorer)
