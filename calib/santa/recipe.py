"""``python -m calib run +method=santa``: the per-layer S²ANTA sample schedule by REINFORCE (docs/methods.md, SANTA).

Stages (each timed):

1. ``reinforce``: an aggregator in this process and ``rl.workers`` local worker processes
   (:mod:`calib.santa.local_worker`, each loading the model itself) on the shared folder ``rl.dir`` (null:
   ``rl-<run_id>`` in the Hydra job's output directory, else ``artifacts/rl/<run_id>``; an existing folder
   is resumed) until ``rl.iterations``, every iteration logged to this MLflow run (``rl/*``, step =
   iteration); a worker that dies fails the run with its one-line error (:func:`train`).
2. ``heldout``: the learned and the uniform schedule at the same N on the same held-out questions and
   seeds (:func:`calib.santa.heldout.heldout_comparison`).
3. ``deploy``: the learned share p scaled to a ladder of budgets; the default budget is the smallest
   rung whose paired lower bound against dense stays within ``method.deploy.tolerance`` (:mod:`calib.santa.deploy`).
4. ``plots``: reward curve, p per layer over iterations, schedules, accuracy vs budget.

The artifact (ABI v1): ``schedule.safetensors`` with ``schedule`` int64 [L] (at the default budget),
``theta`` and ``probs`` float32 [L] (the learned share, which the runtime's ``budget`` option
apportions); estimator, tiling, tile, phases, the budgets and the ladder in the payload, read by
:meth:`runtime_kernels.santa.runtime.SantaDecode.from_artifact`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from calib.config import to_container
from calib.data import dataset_hash
from calib.errors import UserError
from calib.models import load_model
from calib.paths import artifacts_dir
from calib.run import MethodOutput
from calib.santa.children import last_json, start_child
from calib.santa.commands import IterationLogger, RLSettings, final_schedule, run_aggregator_checked, settings
from calib.santa.deploy import DeploySettings, log_ladder, run_ladder
from calib.santa.heldout import heldout_comparison
from calib.santa.inbox import Layout, policy_iterations
from calib.santa.plots import log_run_figures
from calib.santa.policy import deployment_probs, schedule_from_policy, softmax
from calib.santa.reward import RewardSettings, reward_length, reward_prompts
from runtime_kernels.manifest import DataRecord

# Hydra is imported in default_rl_dir only: calibrate() also runs outside a Hydra job, where it may be absent.

log = logging.getLogger("calib.santa")

JOIN_TIMEOUT_S = 120.0  # a stopped worker finishes its current episode first


def validate(cfg: DictConfig) -> None:
    """Range checks of ``cfg.method`` and ``cfg.rl`` (one-line :class:`UserError`)."""
    settings(cfg)
    DeploySettings.from_cfg(cfg)


def data_needs(cfg: DictConfig) -> dict[str, str | None]:
    """Both parts need answers: the REINFORCE reward and the held-out reward are answer accuracies."""
    return {"calibration": "SANTA's REINFORCE reward is the share of questions answered correctly",
            "evaluation": "SANTA's held-out reward scores answers"}


def default_rl_dir(run_id: str) -> Path:
    """``<hydra output dir>/rl-<run_id>`` under Hydra, else ``artifacts/rl/<run_id>``.

    The run id is in the name because Hydra's output dir is per second: two runs started in the same
    second share it, and one ``rl/`` would make the second refuse the first's directory."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir).resolve() / f"rl-{run_id}"
    except (ImportError, ValueError):
        return artifacts_dir() / "rl" / run_id


# ----------------------------------------------------------------------------------- training


class WorkerPool:
    """``rl.workers`` local worker processes (:mod:`calib.santa.local_worker`) and a watch on them.

    Each child reads the resolved config from its stdin and stops when stdin closes; ``failed`` is
    set as soon as a child exits with an error (or all exit), so the aggregator stops too.
    """

    def __init__(self, cfg: DictConfig, s: RLSettings, rl_dir: Path) -> None:
        cfg_dict = to_container(cfg)
        cfg_dict["rl"]["dir"] = str(rl_dir)
        self.config_line = json.dumps(cfg_dict)
        self.seed = s.seed if s.seed is not None else int(cfg.get("seed", 0))
        self.threads = s.threads or max(1, (os.cpu_count() or 1) // s.workers)
        self.count = s.workers
        self.procs: list[subprocess.Popen] = []
        self.failed = threading.Event()  # the aggregator's stop_event
        self._watching = threading.Event()

    def start(self) -> None:
        self.procs = [start_child(i, self.seed, self.threads, [self.config_line]) for i in range(self.count)]
        self._watching.set()
        threading.Thread(target=self._watch, name="santa-worker-watch", daemon=True).start()

    def _watch(self) -> None:
        while self._watching.is_set():
            codes = [p.poll() for p in self.procs]
            if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
                self.failed.set()
                return
            time.sleep(0.5)

    def shutdown(self) -> list[dict[str, Any]]:
        """Close every child's stdin (stop after the current episode), wait, kill stragglers; their reports."""
        self._watching.clear()
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        reports = []
        for i, p in enumerate(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("local worker %d did not stop in %.0fs; killing it", i, JOIN_TIMEOUT_S)
                p.kill()
                p.wait()
            reports.append(last_json(p.stdout.read(), p.returncode))  # one line: the pipe never fills
            p.stdout.close()
        return reports


def train(cfg: DictConfig, s: RLSettings, rl_dir: Path) -> Any:
    """Run the aggregator here and the workers in processes until ``rl.iterations``; the summary."""
    rl_dir.mkdir(parents=True, exist_ok=True)
    done = policy_iterations(Layout(rl_dir))
    pool = None if done and done[-1] >= s.iterations else WorkerPool(cfg, s, rl_dir)
    reports: list[dict[str, Any]] = []
    if pool is not None:
        pool.start()
    bar = tqdm(total=s.iterations, initial=min(done[-1] if done else 0, s.iterations), desc="reinforce",
               unit="iteration")
    log_iteration = IterationLogger()

    def on_iteration(record: Any) -> None:  # the MLflow log plus a progress bar with an ETA
        log_iteration(record)
        bar.update(max(0, min(int(record.iteration), s.iterations) - bar.n))

    try:
        summary = run_aggregator_checked(s, rl_dir, on_iteration, stop_event=pool.failed if pool else None)
    finally:
        bar.close()
        if pool is not None:
            reports = pool.shutdown()
    if summary.iteration < s.iterations:
        errors = [f"worker {i}: {r['error']}" for i, r in enumerate(reports) if r.get("error")]
        raise UserError(f"SANTA training stopped at iteration {summary.iteration} of {s.iterations} "
                        f"({'; '.join(errors) or 'every worker exited early'}); rerun with rl.dir={rl_dir} to resume")
    return summary


# ------------------------------------------------------------------------------------- recipe


def _data_record(cfg: DictConfig, prompts: list[Any]) -> DataRecord:
    source = str(cfg.data.get("source", "synthetic"))
    seed = cfg.data.get("seed")
    lengths = [reward_length(cfg)] if source == "synthetic" else sorted({p.length for p in prompts})
    return DataRecord(source=source, seed=None if seed is None else int(seed), count=len(prompts), lengths=lengths,
                      content_hash=dataset_hash(prompts), tasks=sorted({p.task for p in prompts}),
                      details={"purpose": "reward pool", "heldout_seed": int(cfg.eval.seed),
                               "prompt_ids": [p.prompt_id for p in prompts]})


def _hyperparameters(s: RLSettings, rs: RewardSettings) -> dict[str, Any]:
    return {"N": s.budget, "budget_per_layer": s.budget_per_layer, "num_layers": s.num_layers,
            "iterations": s.iterations, "lr": s.lr, "episodes": s.episodes,
            "questions_per_episode": s.questions_per_episode, "workers": s.workers,
            "heldout_questions": s.heldout_questions, "estimator": rs.estimator, "tiling": rs.tiling,
            "tile": rs.tile, "phases": list(rs.phases), "reward_pool": rs.pool,
            "reward_max_new_tokens": rs.max_new_tokens}


def calibrate(cfg: DictConfig, ctx: Any) -> Any:
    """Train the schedule, score it against uniform on held-out questions, find the deployment budget,
    return the artifact."""
    s, rs = settings(cfg), RewardSettings.from_cfg(cfg)
    DeploySettings.from_cfg(cfg)  # fail before training, not after
    rl_dir = s.dir or default_rl_dir(ctx.run_id)
    log.info("SANTA REINFORCE in %s: L=%d, N=%d, %d workers, %d iterations", rl_dir, s.num_layers, s.budget,
             s.workers, s.iterations)
    with ctx.timer.stage("reinforce"):
        summary = train(cfg, s, rl_dir)
    iteration, theta, learned = final_schedule(rl_dir, s.budget)
    uniform = schedule_from_policy(np.zeros(s.num_layers), s.budget)
    with ctx.timer.stage("load"):
        loaded = load_model(cfg.model, device=str(ctx.device))
        pool = reward_prompts(cfg, loaded.tokenizer, heldout=False, count=rs.pool)
    with ctx.timer.stage("heldout"):
        metrics = heldout_comparison(cfg, loaded, learned, uniform, s.heldout_questions, shards=s.workers)
    probs = deployment_probs(theta)
    with ctx.timer.stage("deploy"):
        ladder = run_ladder(cfg, loaded, probs, s.budget, shards=s.workers)
    with ctx.timer.stage("plots"):
        history = log_run_figures(rl_dir, s.num_layers, learned.tolist(), uniform.tolist())
        log_ladder(ladder)
    deployed = ladder.schedules[ladder.default_budget]
    metrics.update(ladder.metrics(int(cfg.eval.bootstrap), int(cfg.get("seed", 0))))
    p64 = softmax(theta)
    metrics.update({"iterations": float(iteration), "num_results": float(history.num_results.sum()),
                    "budget": float(s.budget), "policy_entropy": float(-(p64 * np.log(np.maximum(p64, 1e-300))).sum()),
                    "schedule": {f"layer_{i}": float(x) for i, x in enumerate(deployed)},
                    "training_schedule": {f"layer_{i}": float(x) for i, x in enumerate(learned)},
                    "p": {f"layer_{i}": float(x) for i, x in enumerate(p64)}})
    return MethodOutput(tensors=_artifact_tensors(deployed, theta, probs),
                        hyperparameters={**_hyperparameters(s, rs), "default_budget": ladder.default_budget},
                        model=loaded.facts.to_dict(), data=_data_record(cfg, pool), metrics=metrics,
                        payload=_payload(rs, rl_dir, iteration, summary, learned, uniform, ladder))


def _artifact_tensors(deployed: list[int], theta: np.ndarray, probs: np.ndarray) -> dict[str, dict[str, torch.Tensor]]:
    """``schedule.safetensors``: ``schedule`` [L] int64 at the default budget, ``theta`` [L] and the
    learned share ``probs`` [L] float32 the runtime rescales for another budget."""
    return {"schedule": {"schedule": torch.as_tensor(deployed, dtype=torch.int64),
                         "theta": torch.as_tensor(theta, dtype=torch.float32),
                         "probs": torch.as_tensor(probs, dtype=torch.float32)}}


def _payload(rs: RewardSettings, rl_dir: Path, iteration: int, summary: Any, learned: np.ndarray,
             uniform: np.ndarray, ladder: Any) -> dict[str, Any]:
    return {"estimator": rs.estimator, "tiling": rs.tiling, "tile": rs.tile,
            "phases": list(rs.phases), "schedule": ladder.schedules[ladder.default_budget],
            "default_budget": ladder.default_budget, "default_budget_within_tolerance": ladder.within_tolerance,
            "training_budget": int(np.sum(learned)), "training_schedule": learned.tolist(),
            "uniform_schedule": uniform.tolist(), "rl_dir": str(rl_dir), "iterations": int(iteration),
            "aggregator_committed": list(summary.committed),
            "budget_ladder": {"budgets": ladder.budgets, "tolerance": ladder.tolerance,
                              "questions": len(ladder.dense), "dense": float(ladder.dense.mean()),
                              "learned": [float(ladder.learned[n].mean()) for n in ladder.budgets],
                              "uniform": [float(ladder.uniform[n].mean()) for n in ladder.budgets]}}
