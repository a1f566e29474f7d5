"""A cheap synthetic reward for SANTA worker tests: no model, deterministic in (budgets, rng).

Layer 0 is "sensitive" (like Llama's first layer in Lee et al., arXiv:2605.01910, App. J): the reward is
the fraction of ``questions`` simulated questions answered correctly, each correct with probability
``sigmoid(a * log(S_0) + b * mean(log S_others) - c)``. REINFORCE should move budget to layer 0.
``SANTA_TEST_EVAL_SLEEP_S`` (env) adds a per-episode sleep so worker batches take measurable time.
"""

from __future__ import annotations

import os
import time

import numpy as np


def reward(budgets: list[int], rng: np.random.Generator, questions: int = 16) -> float:
    s = np.log(np.asarray(budgets, dtype=np.float64))
    logit = 2.0 * s[0] + 0.25 * s[1:].mean() - 4.0
    p_correct = 1.0 / (1.0 + np.exp(-logit))
    delay = float(os.environ.get("SANTA_TEST_EVAL_SLEEP_S", "0"))
    if delay > 0:
        time.sleep(delay * rng.uniform(0.5, 1.5))
    return float(rng.binomial(questions, p_correct)) / questions
