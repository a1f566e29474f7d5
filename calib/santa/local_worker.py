"""Local child processes of ``python -m calib run +method=santa`` (:mod:`calib.santa.recipe`).

The parent starts ``python -m calib.santa.local_worker --index I --seed S --threads T [--score]`` with
:func:`calib.santa.children.start_child` (a fresh interpreter: no dependence on the caller's ``__main__``, unlike
multiprocessing spawn) and writes the resolved config as ONE JSON line on the child's stdin.

* REINFORCE worker (default): the child loads the model, builds the reward pool and runs
  :func:`calib.santa.worker.run_worker` with episode seeds ``SeedSequence([S, I])`` until
  ``done.json`` appears or its stdin reaches end-of-file — the parent closed it (stop) or died (a
  local worker never outlives its ``run``). A stop is honoured after the current episode; an
  incomplete batch is never published.
* ``--score``: a second stdin line holds a held-out scoring job (:mod:`calib.santa.heldout`); the child
  scores every group of questions of the job under each of its schedules, printing ``{"progress": 1}``
  after each question (the parent's progress bar).

The child's stdout ends with exactly one report line at exit: ``{"summary": {...}}``, ``{"scores":
[{...}, ...]}`` (one dict per group) or ``{"error": "<one line>"}``; logs and tracebacks go to stderr
(shared with the parent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from typing import Sequence

import numpy as np
import torch
from omegaconf import OmegaConf

from calib.errors import UserError
from calib.santa.commands import RLSettings, prepare_worker, setup_logging
from calib.santa.heldout import run_score_job
from calib.santa.worker import run_worker


def _stop_on_stdin_eof(stop: threading.Event) -> None:
    def wait() -> None:
        try:
            sys.stdin.read()
        finally:
            stop.set()

    threading.Thread(target=wait, name="santa-stop-on-eof", daemon=True).start()


def run_local_worker(cfg_dict: dict, index: int, seed: int, threads: int, stop: threading.Event) -> dict:
    """Load, build the evaluator and loop until done or ``stop``; the worker summary as a dict."""
    torch.set_num_threads(max(1, threads))
    setup_logging()
    cfg = OmegaConf.create(cfg_dict)
    s = RLSettings.from_cfg(cfg)
    _, evaluate = prepare_worker(cfg)
    summary = run_worker(s.require_dir("run"), evaluate, episodes=s.episodes, stop_event=stop,
                         worker_id=f"local{index}-{os.getpid()}", seed=np.random.SeedSequence([int(seed), index]),
                         poll_s=min(s.poll_s, 0.5))
    return summary.__dict__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m calib.santa.local_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--score", action="store_true", help="score a held-out job (second stdin line)")
    ns = parser.parse_args(argv)
    line = sys.stdin.readline()
    try:
        if ns.score:
            def progress(n: int) -> None:
                print(json.dumps({"progress": n}), flush=True)

            scores = run_score_job(json.loads(line), json.loads(sys.stdin.readline()), ns.threads, progress)
            print(json.dumps({"scores": scores}), flush=True)
            return 0
        stop = threading.Event()
        _stop_on_stdin_eof(stop)
        summary = run_local_worker(json.loads(line), ns.index, ns.seed, ns.threads, stop)
    except UserError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    except Exception as exc:  # noqa: BLE001 - reported to the parent in one line, traceback on stderr
        traceback.print_exc()
        first = (str(exc).splitlines() or [""])[0]
        print(json.dumps({"error": f"{type(exc).__name__}: {first}"}), flush=True)
        return 1
    print(json.dumps({"summary": summary}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
