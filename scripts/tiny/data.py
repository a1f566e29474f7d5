"""Training batches of the task phases: every step's batch is a pure function of (seed, step).

Prompts come from the same generators as ``calib.data`` (training seeds live in their own namespace,
``calib-train/<seed>/<step>/<j>``, disjoint from every ``build_prompts`` seed). Each token carries a loss
flag: ``ANSWER`` (answer tokens and the EOS after each answer), ``LM`` (next-token loss) or ``NO_LOSS``.

A curriculum of phases moves from short prompts (retrieval and induction heads form fast) to prompts up to
8192 tokens (RoPE positions up to 8k are seen). After the evaluated question a sequence may carry further
questions on the same context (other keys of the JSON object, the other needles): extra answer tokens for
the same context cost; by causality they cannot change how the model answers the first question.
"""

from __future__ import annotations

import hashlib
import re

import torch

from calib.data import TASKS
from calib.data.prompt import PromptFormatter
from calib.data.synthetic import MIN_UNITS, TASK_FUNCTIONS, fit_to_length
from calib.data.vocab import StableRng, seed_from

from .config import Phase, TrainConfig


class UnitModel:
    """Tokens of a training prompt as a linear function of its filler units, per task (tiny tokenizer)."""

    def __init__(self, formatter: PromptFormatter, fit_length: int) -> None:
        self.base: dict[str, float] = {}
        self.per_unit: dict[str, float] = {}
        for task in TASKS:
            lo = MIN_UNITS[task]
            fitted = fit_to_length(task, seed_from("calib-train-units", task), fit_length, formatter)
            inst = TASK_FUNCTIONS[task](seed_from("calib-train-units", task), lo)
            q = inst.queries[0]
            base = len(formatter.encode(formatter.render(inst.context, q.question, q.prefix)))
            self.base[task] = base
            self.per_unit[task] = (len(fitted.input_ids) - base) / max(1, fitted.units - lo)

    def units_for(self, task: str, target: float) -> int:
        return MIN_UNITS[task] + max(0, int((target - self.base[task]) / self.per_unit[task]))


LM, ANSWER, NO_LOSS = 0, 1, 2  # per-token loss flags of a training sequence
KV_PAIR = re.compile(r'"([^"]+)": "([^"]+)"')


class StepBatches(torch.utils.data.Dataset):
    """Item ``step`` is the whole batch of that step: a pure function of (seed, step)."""

    def __init__(self, cfg: TrainConfig, tokenizer) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        self.fmt = PromptFormatter(tokenizer, chat_template=False)
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.units = UnitModel(self.fmt, cfg.unit_fit_length)
        self.extra_tokens = {}  # tokens after the evaluated prompt: answers and extra questions
        for task in TASKS:
            inst = TASK_FUNCTIONS[task](seed_from("calib-train-units", task), self.units.units_for(task, 1024))
            q0 = inst.queries[0]
            prompt = self.fmt.encode(self.fmt.render(inst.context, q0.question, q0.prefix))
            self.extra_tokens[task] = len(self.sequence(inst)[0]) - len(prompt)

    @staticmethod
    def _cumulative(weights: dict[str, float]) -> tuple[list[str], list[float]]:
        tasks = list(weights)
        w = torch.tensor([weights[t] for t in tasks], dtype=torch.float64)
        return tasks, (w / w.sum()).cumsum(0).tolist()

    def mix(self, phase: Phase) -> tuple[list[str], list[float]]:
        """Tasks and their cumulative probabilities in ``phase``."""
        return self._cumulative(phase.task_weights or self.cfg.task_weights)

    def __len__(self) -> int:
        return self.cfg.total_steps

    def phase(self, step: int) -> Phase:
        for p in self.cfg.phases:
            if step < p.steps:
                return p
            step -= p.steps
        return self.cfg.phases[-1]

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def sequence(self, inst) -> tuple[list[int], list[int]]:
        """Token ids of an instance's training sequence, and flags: ANSWER on answer tokens and the EOS
        after each answer, NO_LOSS on context tokens of tasks outside ``context_lm_tasks``, LM elsewhere.
        The sequence: the evaluated prompt, its answer, then any extra questions."""
        q0 = inst.queries[0]
        ids = self.fmt.encode(self.fmt.render(inst.context, q0.question, q0.prefix))
        flags = [LM] * len(ids)
        if inst.task not in self.cfg.context_lm_tasks:
            # word-level tokenizer: the context's tokens are a prefix of the prompt's (BOS first)
            n_ctx = len(self.fmt.encode(inst.context))
            flags[1:n_ctx] = [NO_LOSS] * (n_ctx - 1)
        for k, q in enumerate(inst.queries[: 1 + self.cfg.extra_queries.get(inst.task, 0)]):
            if k:
                seg = self._ids(f"\n\nQuestion: {q.question}\nAnswer: {q.prefix}")
                ids += seg
                flags += [LM] * len(seg)
            ans = self._ids(q.completion) + [self.eos]
            ids += ans
            flags += [ANSWER] * len(ans)
        if inst.task == "kv_retrieval" and self.cfg.kv_recall_pairs > 0:
            self._recall_block(inst, ids, flags)
        return ids, flags

    def _recall_block(self, inst, ids: list[int], flags: list[int]) -> None:
        """Append ``"k": "v",`` lines for a shuffled subset of the context's pairs: keys carry no loss
        (their order is random), values are answers, the punctuation keeps the LM loss."""
        pairs = KV_PAIR.findall(inst.context)
        rng = StableRng(seed_from("kv-recall", hashlib.sha256(inst.context.encode()).hexdigest()))
        # drawn WITH replacement: a permutation lets "a value not recalled yet" answer the late lines by
        # elimination (half the answers at 4 pairs), a shortcut that competes with the lookup itself
        order = [int(i) for i in rng.integers(len(pairs), min(self.cfg.kv_recall_pairs, 2 * len(pairs)))]
        ids += self._ids("\n\nJSON data again:\n{")
        flags += [LM] * (len(ids) - len(flags))
        for j, i in enumerate(order):
            key, value = pairs[i]
            for text, flag in ((('"' if j == 0 else ',\n "'), LM), (key, NO_LOSS), ('": "', LM), (value, ANSWER),
                               ('"', LM)):
                seg = self._ids(text)
                ids += seg
                flags += [flag] * len(seg)
        ids += self._ids("}") + [self.eos]
        flags += [LM, LM]

    def example(self, task: str, seed: int, target: float) -> tuple[list[int], list[int]]:
        """A sequence of about ``target`` tokens in all (extra questions included)."""
        aim = max(target - self.extra_tokens[task], 0.5 * target)  # short targets keep some context
        return self.sequence(TASK_FUNCTIONS[task](seed, self.units.units_for(task, aim)))

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        phase = self.phase(step)
        rng = StableRng(seed_from("calib-train", self.cfg.seed, step))
        target = phase.min_len + rng.uniform() * (phase.max_len - phase.min_len)
        batch = max(1, self.cfg.tokens_per_step // int(target))
        tasks, cum = self.mix(phase)
        seqs, row_tasks = [], []
        for j in range(batch):
            u = rng.uniform()
            task = tasks[next(i for i, c in enumerate(cum) if u < c or i == len(cum) - 1)]
            aim = target * (1 - self.cfg.length_jitter * rng.uniform())
            seqs.append(self.example(task, seed_from("calib-train", self.cfg.seed, step, j), aim))
            row_tasks.append(TASKS.index(task))
        width = max(len(s) for s, _ in seqs)
        ids = torch.full((batch, width), self.pad, dtype=torch.long)
        flags = torch.full((batch, width), NO_LOSS, dtype=torch.long)  # padding: no loss
        for b, (s, f) in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s)
            flags[b, : len(f)] = torch.tensor(f)
        return {"input_ids": ids, "answer": flags == ANSWER, "lm": flags == LM,
                "task": torch.tensor(row_tasks), "target_len": torch.tensor(int(target))}


def worker_init(_: int) -> None:
    """DataLoader workers build batches on one thread each (the trainer keeps the others)."""
    torch.set_num_threads(1)
