"""Prompts for calibration and evaluation: RULER-style synthetic tasks, JSONL files, HF datasets.

Public API::

    from calib.data import Prompt, build_prompts, exact_match, TASKS, dataset_hash

    prompts = build_prompts(cfg.data, tokenizer)                # calibration set
    held_out = build_prompts(cfg.data, tokenizer, seed=cfg.eval.seed, purpose="evaluation")
    exact_match(generated_text, prompts[0].answer)

Importing this package needs neither hydra nor omegaconf (the GPU training script uses it bare).
"""

from calib.data.prompt import Prompt, PromptFormatter
from calib.data.scoring import (SCORING_RULES, contains_answer, dataset_hash, exact_match, normalize_answer,
                                score_answer)
from calib.data.sources import build_prompts
from calib.data.synthetic import TASKS

__all__ = ["SCORING_RULES", "TASKS", "Prompt", "PromptFormatter", "build_prompts", "contains_answer",
           "dataset_hash", "exact_match", "normalize_answer", "score_answer"]
