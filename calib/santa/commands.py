"""``python -m calib worker`` / ``python -m calib aggregator`` (the Kubernetes pods' commands, deploy/k8s/README.md).

Both take Hydra overrides (``rl.dir=...`` is required: the shared directory) and are plain functions
``worker(cfg) -> dict`` / ``aggregator(cfg) -> dict`` that :mod:`calib.cli` wraps.

* The **worker** loads the model (``cfg.model`` on ``cfg.device``), builds the reward pool
  (:mod:`calib.santa.reward`) and runs :func:`calib.santa.worker.run_worker` until ``done.json``
  appears (or ``rl.max_batches``). It never touches MLflow. Seeds: ``rl.seed`` null draws fresh
  entropy; an int seeds the worker with ``SeedSequence([rl.seed, crc32(worker id)])``.
* The **aggregator** needs no model (L comes from ``model.arch.num_layers``, N from
  ``rl.budget`` or ``rl.budget_per_layer x L``); it runs :func:`calib.santa.aggregator.run_aggregator`
  and logs every committed iteration to MLflow (reward mean, baseline, grad norm, entropy, staleness,
  per-layer p) through ``on_iteration``. Its MLflow run starts at the first callback (after the lease
  is held) and its id is kept in ``<rl.dir>/aggregator-run.json``, so a restarted aggregator keeps
  logging into the same run. SIGTERM ends it cleanly (lease released).

:mod:`calib.santa.local_worker` is the body of the worker processes that ``python -m calib run
+method=santa`` starts (:mod:`calib.santa.recipe`).
"""

from __future__ import annotations

import logging
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from calib.config import require
from calib.errors import UserError
from calib.models import load_model, resolve_device
from calib.paths import check_writable_dir
from calib.recipe_settings import Section
from calib.santa.aggregator import CorruptState, exit_on_sigterm, run_aggregator
from calib.santa.inbox import Layout, atomic_write_json, default_worker_id, read_json, read_newest_policy
from calib.santa.lease import LeaseHeld, LeaseLost
from calib.santa.policy import schedule_from_policy
from calib.santa.reward import RewardSettings, make_evaluator, reward_prompts
from calib.santa.worker import run_worker

# mlflow and calib.tracking are imported where the aggregator logs: worker processes import this module and
# never touch MLflow, whose import would slow every worker's start.

log = logging.getLogger("calib.santa")

RUN_FILE = "aggregator-run.json"


# ------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class RLSettings:
    """The ``rl`` block, read and range-checked once: what the worker, the aggregator and ``run`` need
    (conf/method/santa/default.yaml documents every key)."""

    dir: Path | None
    num_layers: int  # L (model.arch.num_layers)
    budget_per_layer: int
    budget: int  # N
    workers: int
    iterations: int
    episodes: int
    questions_per_episode: int
    heldout_questions: int
    heldout_uniform_placements: bool
    lr: float
    seed: int | None
    max_batches: int | None
    threads: int | None
    poll_s: float
    lease_ttl_s: float
    lease_wait_s: float | None
    temp_max_age_s: float

    @classmethod
    def from_cfg(cls, cfg: Any) -> "RLSettings":
        require(cfg.get("rl") is not None, "no rl block in the config: add +method=santa")
        rl = Section(cfg.rl, "rl")
        layers = Section(cfg.model, "model").section("arch").integer("num_layers", at_least=1)
        per_layer = rl.integer("budget_per_layer")
        total = rl.integer("budget", optional=True)
        budget = per_layer * layers if total is None else total
        require(budget >= layers, f"the SANTA budget N={budget} is below one sample per layer (L={layers}): "
                                  "raise rl.budget_per_layer (or rl.budget)")
        path = rl.value("dir")
        return cls(
            dir=Path(str(path)).expanduser().resolve() if path else None, num_layers=layers,
            budget_per_layer=per_layer, budget=budget, workers=rl.integer("workers", at_least=1),
            iterations=rl.integer("iterations", at_least=0), episodes=rl.integer("episodes", at_least=1),
            questions_per_episode=rl.integer("questions_per_episode", at_least=1),
            heldout_questions=rl.integer("heldout_questions", at_least=1),
            heldout_uniform_placements=rl.flag("heldout_uniform_placements"),
            lr=rl.number("lr", above=0), seed=rl.integer("seed", optional=True),
            max_batches=rl.integer("max_batches", optional=True, at_least=1),
            threads=rl.integer("threads", optional=True, at_least=1),
            poll_s=rl.number("poll_s", above=0), lease_ttl_s=rl.number("lease_ttl_s", above=0),
            lease_wait_s=rl.number("lease_wait_s", optional=True, at_least=0),
            temp_max_age_s=rl.number("temp_max_age_s", above=0),
        )

    def require_dir(self, command: str) -> Path:
        """``rl.dir``, which must be set and be (or be creatable as) a writable directory."""
        if self.dir is None:
            raise UserError(f"`python -m calib {command}` needs the shared folder: add rl.dir=/path/to/shared/dir "
                            "(the same for the aggregator and every worker)")
        check_writable_dir(self.dir, f"rl.dir={self.dir}")
        return self.dir


def settings(cfg: Any) -> RLSettings:
    """Checked :class:`RLSettings`, after the method's reward settings are checked too."""
    RewardSettings.from_cfg(cfg)
    return RLSettings.from_cfg(cfg)


def setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("calib.santa").setLevel(logging.INFO)


# ------------------------------------------------------------------------------------- worker


def worker_seed(seed: int | None, worker_id: str) -> np.random.SeedSequence | None:
    """``SeedSequence([seed, crc32(worker_id)])`` (distinct streams per worker), or None for fresh entropy."""
    if seed is None:
        return None
    return np.random.SeedSequence([int(seed), zlib.crc32(worker_id.encode())])


def prepare_worker(cfg: Any) -> tuple[Any, Any]:
    """Load the model and build the reward evaluator: ``(loaded, evaluate)``."""
    loaded = load_model(cfg.model, device=str(resolve_device(str(cfg.get("device", "auto")))))
    pool = reward_prompts(cfg, loaded.tokenizer, heldout=False, count=RewardSettings.from_cfg(cfg).pool)
    return loaded, make_evaluator(cfg, loaded, pool)


def worker(cfg: Any) -> dict[str, Any]:
    """``python -m calib worker rl.dir=...``: one REINFORCE worker until ``done.json`` (or rl.max_batches)."""
    s = settings(cfg)
    rl_dir = s.require_dir("worker")
    setup_logging()
    _, evaluate = prepare_worker(cfg)
    worker_id = default_worker_id()
    log.info("worker %s on %s (N=%d, L=%d)", worker_id, rl_dir, s.budget, s.num_layers)
    summary = run_worker(rl_dir, evaluate, episodes=s.episodes, max_batches=s.max_batches, worker_id=worker_id,
                         seed=worker_seed(s.seed, worker_id), poll_s=s.poll_s)
    return {"rl_dir": str(rl_dir), **summary.__dict__}


# --------------------------------------------------------------------------------- aggregator


def iteration_metrics(record: Any) -> dict[str, float]:
    """MLflow metrics of one committed iteration (``rl/...``; step = the iteration)."""
    out = {f"rl/{k}": float(v) for k, v in record.metrics().items()}
    out["rl/reward_mean"] = float(np.mean(record.rewards))
    out["rl/reward_std"] = float(np.std(record.rewards))
    for i, p in enumerate(record.probs_after):
        out[f"rl/p_layer_{i}"] = float(p)
    return out


class IterationLogger:
    """``on_iteration`` callback: logs each committed iteration to MLflow and to the log.

    ``target`` None logs into the active MLflow run (``run`` owns it). With a target (the standalone
    aggregator) the run is opened lazily at the first callback — i.e. only once the lease is held —
    reusing the run id recorded in ``<rl_dir>/aggregator-run.json`` by an earlier life.
    """

    def __init__(self, target: Any | None = None, rl_dir: Path | None = None, run_name: str = "santa-aggregator",
                 params: dict[str, Any] | None = None) -> None:
        self.target, self.rl_dir, self.run_name, self.params = target, rl_dir, run_name, params or {}
        self.run_id: str | None = None
        self._opened = False

    def __call__(self, record: Any) -> None:
        import mlflow

        self._open()
        if mlflow.active_run() is not None:
            mlflow.log_metrics(iteration_metrics(record), step=int(record.iteration))
        log.info("iteration %d: %d results, reward %.3f, p=%s%s", record.iteration, record.num_results,
                 float(np.mean(record.rewards)), np.round(record.probs_after, 3).tolist(),
                 " (replayed)" if record.replayed else "")

    def _open(self) -> None:
        if self.target is None or self._opened:
            return
        import mlflow
        from mlflow.exceptions import MlflowException

        from calib import tracking

        exp_id = tracking.configure(self.target)
        path = self.rl_dir / RUN_FILE if self.rl_dir is not None else None
        prior = None
        if path is not None and path.exists():
            try:
                rec = read_json(path)
                prior = rec.get("run_id") if rec.get("tracking_uri") == self.target.tracking_uri else None
            except (OSError, ValueError, AttributeError):
                prior = None
        try:
            run = mlflow.start_run(run_id=prior) if prior else None
        except MlflowException:
            run = None
        if run is None:
            run = mlflow.start_run(experiment_id=exp_id, run_name=self.run_name,
                                   tags={"method": "santa", "kind": "aggregator"})
            mlflow.log_params({k: str(v)[:6000] for k, v in self.params.items()})
            if path is not None:
                atomic_write_json(path, {"run_id": run.info.run_id, "tracking_uri": self.target.tracking_uri})
        self.run_id, self._opened = run.info.run_id, True

    def log_schedule(self, schedule: np.ndarray) -> None:
        """Log the artifact schedule of the newest policy (``schedule/layer_<i>``) if a run is open."""
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.log_metrics({f"schedule/layer_{i}": float(x) for i, x in enumerate(schedule)})

    def close(self, failed: bool = False) -> None:
        if self._opened:
            import mlflow

            mlflow.end_run(status="FAILED" if failed else "FINISHED")
            self._opened = False


def run_aggregator_checked(s: RLSettings, rl_dir: Path, on_iteration: Any, stop_event: Any = None) -> Any:
    """:func:`run_aggregator` with its protocol errors turned into one-line :class:`UserError`."""
    try:
        return run_aggregator(rl_dir, s.num_layers, s.budget, iterations=s.iterations, lr=s.lr, poll_s=s.poll_s,
                              lease_ttl_s=s.lease_ttl_s, temp_max_age_s=s.temp_max_age_s,
                              on_iteration=on_iteration, stop_event=stop_event, lease_wait_s=s.lease_wait_s)
    except LeaseHeld as exc:
        raise UserError(f"another aggregator holds {rl_dir}/aggregator.lease ({exc}); only one may run: stop it, "
                        f"or wait rl.lease_ttl_s={s.lease_ttl_s}s after it died") from None
    except LeaseLost as exc:
        raise UserError(f"the aggregator lease on {rl_dir} was taken over ({exc}); another aggregator runs now") from None
    except CorruptState as exc:
        raise UserError(f"{rl_dir} is inconsistent ({exc}); inspect it or start over with a fresh rl.dir") from None


def final_schedule(rl_dir: Path, budget: int) -> tuple[int, np.ndarray, np.ndarray]:
    """``(iteration, theta [L], schedule [L])`` of the newest committed policy in ``rl_dir``."""
    snap = read_newest_policy(Layout(rl_dir))
    if snap is None:
        raise UserError(f"{rl_dir} holds no policy snapshot: did the aggregator run?")
    return snap.iteration, snap.theta, schedule_from_policy(snap.theta, budget)


def aggregator(cfg: Any) -> dict[str, Any]:
    """``python -m calib aggregator rl.dir=...``: the REINFORCE aggregator until ``rl.iterations``."""
    from calib import tracking

    exit_on_sigterm()
    s, rs = settings(cfg), RewardSettings.from_cfg(cfg)
    rl_dir = s.require_dir("aggregator")
    setup_logging()
    params = {"rl_dir": rl_dir, "num_layers": s.num_layers, "budget": s.budget, "iterations": s.iterations,
              "lr": s.lr, "episodes": s.episodes, "questions_per_episode": s.questions_per_episode,
              "model": cfg.model.name, "estimator": rs.estimator, "tiling": rs.tiling, "tile": rs.tile,
              "phases": list(rs.phases)}
    logger = IterationLogger(tracking.resolve_target(cfg.get("tracking")), rl_dir, f"santa-aggregator-{cfg.model.name}",
                             params)
    failed = True
    try:
        summary = run_aggregator_checked(s, rl_dir, logger)
        iteration, theta, schedule = final_schedule(rl_dir, s.budget)
        logger.log_schedule(schedule)
        failed = False
    finally:
        logger.close(failed=failed)
    return {"rl_dir": str(rl_dir), "run_id": logger.run_id, **asdict(summary), "theta": theta.tolist(),
            "schedule": schedule.tolist()}
