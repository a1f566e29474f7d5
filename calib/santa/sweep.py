"""How to pick a starved SANTA budget: the held-out reward of uniform schedules.

``python -m calib.santa.sweep <overrides> [sweep=1,2,4,8] [sweep_total=5,6,7]`` prints, as one JSON line,
the held-out reward (bootstrap 95% CI) of the uniform schedule per ``budget_per_layer`` and, with
``sweep_total``, per total N with every placement of the extra samples when L does not divide N, plus
dense. It scores with :mod:`calib.santa.heldout` (sharded over ``rl.workers`` local processes) the
questions :mod:`calib.santa.reward` builds.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

import numpy as np

from calib.config import compose
from calib.errors import UserError
from calib.models import load_model, resolve_device
from calib.santa import commands
from calib.santa.heldout import score_schedules, uniform_variants
from calib.santa.policy import schedule_from_policy
from calib.santa.reward import RewardSettings, new_token_budgets, question_seeds, reward_prompts
from calib.stats import bootstrap_mean_ci


def uniform_sweep(cfg: Any, loaded: Any, budgets_per_layer: Sequence[int],
                  totals: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    """Held-out reward (bootstrap 95% CI) of the uniform schedule at each ``budget_per_layer`` (keys
    ``"<b>"``) and at each total budget N of ``totals`` (keys ``"N<N>"``), on ``rl.heldout_questions``
    questions sharded over up to ``rl.workers`` processes.

    For a total N that L does not divide, ``"N<N>"`` is the θ = 0 artifact schedule and every other
    uniform placement is scored too (:func:`calib.santa.heldout.uniform_variants`), with their
    per-question mean under ``"N<N>:mean"`` and each placement under ``"N<N>:<s_0>-<s_1>-..."``: the
    per-placement rewards say which layers a starved budget needs. Each entry carries its ``schedule``.
    """
    rs = RewardSettings.from_cfg(cfg)
    prompts = reward_prompts(cfg, loaded.tokenizer, heldout=True, count=int(cfg.rl.heldout_questions))
    layers = int(loaded.model.config.num_hidden_layers)
    schedules: dict[str, list[int] | None] = {
        str(int(b)): schedule_from_policy(np.zeros(layers), int(b) * layers).tolist() for b in budgets_per_layer}
    groups: dict[str, list[str]] = {}
    for n in totals:
        if int(n) < layers:
            raise UserError(f"sweep_total {n} < {layers} layers: every layer needs at least one sample")
        schedules[f"N{int(n)}"] = schedule_from_policy(np.zeros(layers), int(n)).tolist()
        variants = uniform_variants(layers, int(n))
        if len(variants) > 1:
            names = [f"N{int(n)}:" + name.split(":", 1)[1] for name in variants]
            schedules.update(zip(names, variants.values()))
            groups[f"N{int(n)}:mean"] = names
    if rs.heldout_dense:
        schedules["dense"] = None
    got = score_schedules(cfg, loaded, prompts, new_token_budgets(prompts, loaded.tokenizer, rs),
                          question_seeds(int(cfg.seed), len(prompts)), schedules, int(cfg.rl.workers))
    for name, members in groups.items():
        got[name] = np.mean([np.asarray(got[m], dtype=np.float64) for m in members], axis=0)
    out: dict[str, dict[str, Any]] = {}
    for name, correct in got.items():
        ci = bootstrap_mean_ci(correct, resamples=int(cfg.eval.bootstrap), seed=int(cfg.seed))
        out[name] = {"reward": ci.mean, "ci_low": ci.low, "ci_high": ci.high, "n": float(ci.n),
                     "schedule": schedules.get(name)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m calib.santa.sweep [overrides] [sweep=1,2,4,8] [sweep_total=5,6,7]``: uniform reward per
    budget per layer (keys: budget_per_layer, ``N<total>`` and its placements, and ``dense``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__.strip())
        return 0
    sweep, totals = [1, 2, 4, 8, 16], []
    rest = []
    for a in args:
        if a.startswith("sweep=") or a.startswith("sweep_total="):
            key, _, value = a.partition("=")
            values = [int(x) for x in value.strip("[]").split(",") if x.strip()]
            if key == "sweep":
                sweep = values
            else:
                totals = values
        else:
            rest.append(a)
    try:
        cfg = compose(["+method=santa", *rest])
        commands.settings(cfg)
        loaded = load_model(cfg.model, device=str(resolve_device(str(cfg.get("device", "auto")))))
        result = uniform_sweep(cfg, loaded, sweep, totals)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"uniform_reward": result}, sort_keys=True), flush=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
