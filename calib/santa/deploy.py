"""The deployment budget of a SANTA artifact: accuracy against total budget, learned vs uniform.

REINFORCE learns where samples matter at a starved budget ``N_train`` (the policy ``p = softmax(theta)``
over layers); a user wants an artifact that answers like dense. The ``deploy`` stage scales the learned
``p`` to a ladder of total budgets (``N = b x L`` for ``b`` in ``method.deploy.budgets_per_layer``, plus
``N_train``), each by largest remainder (:func:`runtime_kernels.santa.schedule.apportion`, >= 1 sample
per layer), and scores every rung, the uniform schedule at the same ``N`` and dense attention on the
same ``method.deploy.questions`` questions of the calibration side that the reward pool does not hold
(``data.seed``, after the pool's; ``eval.seed`` stays unseen), question ``i`` sampled with the same
seed under every schedule (a file with fewer rows: the rows there are, with a warning). Synthetic
questions have ``method.deploy.length`` tokens (null: the reward's length): a budget of S samples per
layer reads a smaller share of a longer context, so the ladder must be measured at the longest context
the artifact will serve (a budget chosen on short questions can fail long ones: docs/results/smollm2.md).

The artifact's default budget is the smallest rung from which the learned schedule provably stays
within ``method.deploy.tolerance`` of dense: the paired-bootstrap 95 % lower bound of (learned − dense)
per question is at least ``−tolerance`` at that rung and at every larger one (one lucky rung below a
failing one is not taken). A point estimate would let a rung that wins a few of ~100 questions by
chance through and lose answers held out; the bound is the criterion ``calib eval`` is judged by. When
no rung qualifies the largest is used and ``deploy_within_tolerance`` is 0.
``options={"santa": {"budget": N}}`` overrides it at load time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from calib.recipe_settings import Section
from calib.santa.heldout import ScoreGroup, score_groups
from calib.santa.plots import pyplot
from calib.santa.reward import RewardSettings, new_token_budgets, question_seeds, reward_prompts
from calib.stats import bootstrap_mean_ci, paired_bootstrap_diff
from calib.tracking import log_figure
from runtime_kernels.santa.schedule import apportion

# mlflow (optional where no run is tracked) is imported in log_ladder only.

log = logging.getLogger("calib.santa")


@dataclass(frozen=True)
class DeploySettings:
    """``method.deploy``: the budget ladder, its questions and the tolerance against dense."""

    budgets_per_layer: tuple[int, ...]
    questions: int
    tolerance: float
    length: int | None = None  # synthetic question length in tokens (None: the reward's)
    resamples: int = 2000  # paired-bootstrap resamples of the bound (eval.bootstrap)

    @classmethod
    def from_cfg(cls, cfg: Any) -> "DeploySettings":
        d = Section(cfg.method, "method").section("deploy")
        return cls(budgets_per_layer=tuple(d.integers("budgets_per_layer", at_least=1)),
                   questions=d.integer("questions", at_least=1), tolerance=d.number("tolerance", at_least=0, below=1),
                   length=d.integer("length", optional=True, at_least=1),
                   resamples=Section(cfg.eval, "eval").integer("bootstrap", at_least=100))


def ladder(num_layers: int, budgets_per_layer: Sequence[int], training_budget: int) -> list[int]:
    """Total budgets scored: ``b x L`` for every ``b`` plus the training budget, ascending, unique."""
    return sorted({int(b) * int(num_layers) for b in budgets_per_layer} | {int(training_budget)})


def rung_bound(learned: np.ndarray, dense: np.ndarray, resamples: int) -> float:
    """Paired-bootstrap 95 % lower bound of mean(learned − dense) over the same questions."""
    return paired_bootstrap_diff(dense, learned, resamples=resamples, seed=0).low


def smallest_budget_within(budgets: Sequence[int], learned: Sequence[np.ndarray], dense: np.ndarray,
                           tolerance: float, resamples: int = 2000) -> int | None:
    """The smallest budget from which the paired lower bound of (learned − dense) is ``>= −tolerance``
    at it and every larger budget; None when the largest budget fails. ``budgets`` ascending,
    ``learned[i]`` the per-question correctness ``[Q]`` at ``budgets[i]``, ``dense`` the same for dense."""
    if len(budgets) != len(learned) or list(budgets) != sorted(budgets):
        raise ValueError("budgets must be ascending, one score vector each")
    found = None
    for n, scores in zip(reversed(list(budgets)), reversed(list(learned))):
        if rung_bound(scores, dense, resamples) < -tolerance - 1e-12:  # float guard at the boundary
            break
        found = int(n)
    return found


@dataclass(frozen=True)
class LadderResult:
    """Accuracy per rung on the calibration-side questions; ``[R]`` arrays, rungs ascending."""

    budgets: list[int]
    learned: dict[int, np.ndarray]  # N -> per-question correctness [Q] of the learned schedule at N
    uniform: dict[int, np.ndarray]  # N -> the same for the uniform schedule
    dense: np.ndarray  # [Q]
    schedules: dict[int, list[int]]  # N -> learned schedule
    default_budget: int
    within_tolerance: bool
    tolerance: float

    def metrics(self, resamples: int, seed: int) -> dict[str, Any]:
        """Headline metrics (``deploy_*``) and the curve as ``deploy.learned.N<n>`` / ``deploy.uniform.N<n>``."""
        n = self.default_budget
        ci = bootstrap_mean_ci(self.learned[n], resamples=resamples, seed=seed)
        diff = paired_bootstrap_diff(self.dense, self.learned[n], resamples=resamples, seed=seed)
        return {"deploy_budget": float(n), "deploy_within_tolerance": float(self.within_tolerance),
                "deploy_diff": diff.mean, "deploy_diff_ci_low": diff.low, "deploy_diff_ci_high": diff.high,
                "deploy_accuracy_learned": ci.mean, "deploy_accuracy_learned_ci_low": ci.low,
                "deploy_accuracy_learned_ci_high": ci.high, "deploy_accuracy_dense": float(self.dense.mean()),
                "deploy_accuracy_uniform": float(self.uniform[n].mean()), "deploy_questions": float(len(self.dense)),
                "deploy": {"learned": {f"N{b}": float(self.learned[b].mean()) for b in self.budgets},
                           "uniform": {f"N{b}": float(self.uniform[b].mean()) for b in self.budgets}}}


def no_rung_advice(tolerance: float, questions: int) -> str:
    """What to change when no rung qualifies: a larger ladder, or more questions (the bound's width
    shrinks as one over the square root of their number; with tolerance 0 only a rung that loses no
    question qualifies, which more questions cannot help)."""
    advice = "extend method.deploy.budgets_per_layer"
    if tolerance > 0:
        advice += f", or raise method.deploy.questions (now {questions}) to tighten the paired bound"
    return advice


def run_ladder(cfg: Any, loaded: Any, probs: np.ndarray, training_budget: int, shards: int) -> LadderResult:
    """Score the ladder (module docstring); ``probs [L]`` are the artifact's stored shares."""
    ds, rs = DeploySettings.from_cfg(cfg), RewardSettings.from_cfg(cfg)
    layers = len(probs)
    budgets = [n for n in ladder(layers, ds.budgets_per_layer, training_budget) if n >= layers]
    prompts = reward_prompts(cfg, loaded.tokenizer, heldout=False, count=ds.questions, skip=rs.pool,
                             setting="method.deploy.questions", allow_fewer=True, length=ds.length)
    if len(prompts) < ds.questions:
        log.warning("the data holds %d calibration questions beyond the reward pool; the budget ladder uses them "
                    "instead of method.deploy.questions=%d", len(prompts), ds.questions)
    max_new = new_token_budgets(prompts, loaded.tokenizer, rs)
    learned = {n: apportion(probs.tolist(), n) for n in budgets}
    schedules: dict[str, list[int] | None] = {"dense": None}
    for n in budgets:
        schedules[f"learned:{n}"] = learned[n]
        schedules[f"uniform:{n}"] = apportion([1.0] * layers, n)
    group = ScoreGroup(prompts, max_new, question_seeds(int(cfg.get("seed", 0)) + 1, len(prompts)), schedules)
    got = score_groups(cfg, loaded, [group], shards, desc="deploy budgets")[0]
    found = smallest_budget_within(budgets, [got[f"learned:{n}"] for n in budgets], got["dense"], ds.tolerance,
                                   ds.resamples)
    if found is None:
        log.warning("no budget up to N=%d keeps the learned schedule's paired lower bound within %.3f of dense "
                    "(%.3f vs %.3f, bound %.3f); the artifact defaults to N=%d: %s", budgets[-1], ds.tolerance,
                    float(got[f"learned:{budgets[-1]}"].mean()), float(got["dense"].mean()),
                    rung_bound(got[f"learned:{budgets[-1]}"], got["dense"], ds.resamples), budgets[-1],
                    no_rung_advice(ds.tolerance, len(prompts)))
    return LadderResult(budgets=budgets, learned={n: got[f"learned:{n}"] for n in budgets},
                        uniform={n: got[f"uniform:{n}"] for n in budgets}, dense=got["dense"], schedules=learned,
                        default_budget=found if found is not None else budgets[-1],
                        within_tolerance=found is not None, tolerance=ds.tolerance)


def log_ladder(result: LadderResult) -> None:
    """The curve as MLflow step series (``deploy/accuracy_learned`` etc., step = N) and one figure."""
    import mlflow

    if mlflow.active_run() is None:
        return
    for n in result.budgets:
        mlflow.log_metrics({"deploy/accuracy_learned": float(result.learned[n].mean()),
                            "deploy/accuracy_uniform": float(result.uniform[n].mean()),
                            "deploy/accuracy_dense": float(result.dense.mean())}, step=int(n))
    log_figure(accuracy_vs_budget(result), "plots/santa_accuracy_vs_budget.png")


def accuracy_vs_budget(result: LadderResult) -> Any:
    """Accuracy against total budget N (log scale): learned and uniform with 95 % bootstrap bars, dense,
    the tolerance band and the chosen default budget."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.asarray(result.budgets, dtype=float)
    for name, curve, style in (("learned", result.learned, "o-"), ("uniform", result.uniform, "s--")):
        cis = [bootstrap_mean_ci(curve[n], resamples=1000, seed=0) for n in result.budgets]
        y = np.array([c.mean for c in cis])
        err = np.array([[c.mean - c.low for c in cis], [c.high - c.mean for c in cis]])
        ax.errorbar(x, y, yerr=err, fmt=style, capsize=3, label=f"{name} schedule")
    dense = float(result.dense.mean())
    ax.axhline(dense, color="k", lw=1, label=f"dense ({dense:.3f})")
    ax.axhspan(dense - result.tolerance, dense, color="0.85", label=f"dense − {result.tolerance:g} (paired bound)")
    ax.axvline(result.default_budget, color="C3", ls=":", label=f"default budget N={result.default_budget}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="total samples N over all layers", ylabel=f"accuracy ({len(result.dense)} questions)",
           title="SANTA: accuracy vs total budget (calibration-side questions)", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
