"""Prompts for calibration and evaluation: RULER-style synthetic tasks, books, JSONL files, HF datasets.

Public API::

    from calib.data import Prompt, build_prompts, check_data, is_correct, TASKS, dataset_hash

    check_data(cfg.data, {"calibration": None, "evaluation": "eval scores answers"})  # before loading
    prompts = build_prompts(cfg.data, tokenizer)                # calibration set
    held_out = build_prompts(cfg.data, tokenizer, seed=cfg.eval.seed, purpose="evaluation")
    is_correct(generated_text, held_out[0])                     # by the task's rule (data.scoring)

Importing this package needs neither hydra nor omegaconf (the GPU training script uses it bare).
"""

from calib.data.books import BOOK_TASKS
from calib.data.checks import EVAL_NEEDS, check_data
from calib.data.prompt import Prompt, PromptFormatter
from calib.data.scoring import SCORING_RULES, contains_answer, dataset_hash, exact_match, is_correct, normalize_answer
from calib.data.sources import build_prompts, evaluation_prompts, take_in_turn
from calib.data.synthetic import TASKS

__all__ = ["BOOK_TASKS", "EVAL_NEEDS", "SCORING_RULES", "TASKS", "Prompt", "PromptFormatter", "build_prompts",
           "check_data", "contains_answer", "dataset_hash", "evaluation_prompts", "exact_match", "is_correct",
           "normalize_answer", "take_in_turn"]
