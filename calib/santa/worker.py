"""A SANTA REINFORCE worker (Lee et al., arXiv:2605.01910, App. L): read the newest policy, sample, evaluate, publish.

Loop: read the newest complete policy snapshot (no locks: snapshots appear by atomic rename) →
draw ``episodes`` schedules ``s ~ Multinomial(N, softmax(theta))`` → evaluate each with
``evaluate(budgets, rng)`` where ``budgets[l] = max(s[l], 1)`` (a layer that drew 0 samples runs
with ``S = 1``) → publish the batch as ONE result file (hidden temp, fsync, rename). Each record
carries the ``policy_iteration`` it was drawn from, so the aggregator uses that policy's ``p``.

A worker can be killed at any instant: before the rename nothing is visible (its hidden temp file is
swept by the aggregator later), after it the whole batch is. Workers never touch MLflow, never wait
for the aggregator and are never signalled by it; they stop when ``done.json`` appears (the
aggregator reached its target), after ``max_batches``, or when ``stop_event`` is set. The command
that runs one is ``python -m calib worker`` (:mod:`calib.santa.commands`).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from calib.santa.inbox import InboxWriter, Layout, make_batch, read_newest_policy
from calib.santa.policy import evaluation_budgets, sample_schedule, softmax

log = logging.getLogger("calib.santa.worker")

Evaluate = Callable[[list[int], np.random.Generator], float]


@dataclass
class WorkerSummary:
    """What a worker did: batches published, their files, and why it stopped."""

    worker_id: str
    batches: int = 0
    results: int = 0
    files: list[str] = field(default_factory=list)
    stopped_because: str = ""


def run_worker(
    rl_dir: str | Path,
    evaluate: Evaluate,
    *,
    episodes: int = 10,
    max_batches: int | None = None,
    stop_event: threading.Event | None = None,
    worker_id: str | None = None,
    seed: int | np.random.SeedSequence | None = None,
    poll_s: float = 1.0,
    exit_when_done: bool = True,
    line_delay_s: float = 0.0,
) -> WorkerSummary:
    """Run the worker loop on the shared directory ``rl_dir`` until told to stop.

    evaluate(budgets, rng) -> reward in [0, 1]: ``budgets`` is the per-layer S (length L, each >= 1).
    seed: None draws fresh OS entropy (distinct workers must not share a stream; a caller that
    passes seeds gives each worker its own). ``line_delay_s`` slows the file write (tests only).
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1 (got {episodes})")
    layout = Layout(Path(rl_dir))
    writer = InboxWriter(layout.root, worker_id, line_delay_s=line_delay_s)
    rng = np.random.default_rng(seed)
    summary = WorkerSummary(worker_id=writer.worker_id)
    stop = stop_event or threading.Event()
    while True:
        reason = _should_stop(layout, summary, max_batches, stop, exit_when_done)
        if reason:
            summary.stopped_because = reason
            return summary
        snap = read_newest_policy(layout)
        if snap is None:  # the aggregator has not written policy-0 yet
            stop.wait(poll_s)
            continue
        probs = softmax(snap.theta)
        batch = []
        for _ in range(episodes):
            if stop.is_set():
                break
            schedule = sample_schedule(probs, snap.budget, rng)
            reward = float(evaluate(evaluation_budgets(schedule), rng))
            if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
                raise ValueError(f"evaluate returned {reward!r}; a reward must be a finite number in [0, 1]")
            batch.append((schedule, reward))
        if len(batch) < episodes:  # stopped mid-batch: an incomplete batch is never published
            continue
        path = writer.publish(make_batch(writer.worker_id, snap.iteration, snap.budget, batch))
        summary.batches += 1
        summary.results += len(batch)
        summary.files.append(path.name)
        log.info("published %s (policy %d, mean reward %.3f)", path.name, snap.iteration,
                 float(np.mean([r for _, r in batch])))


def _should_stop(layout: Layout, summary: WorkerSummary, max_batches: int | None,
                 stop: threading.Event, exit_when_done: bool) -> str:
    if stop.is_set():
        return "stop_event"
    if max_batches is not None and summary.batches >= max_batches:
        return "max_batches"
    if exit_when_done and layout.done.exists():
        return "done"
    return ""
