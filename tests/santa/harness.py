"""The SANTA aggregator and worker as bare subprocess commands, for the crash and kill tests.

    python tests/santa/harness.py aggregator --dir D --layers L --budget N --iterations K [--crash-at POINT:ITER]
    python tests/santa/harness.py worker --dir D --evaluate module:function [--line-delay-s S]

They wrap :func:`calib.santa.aggregator.run_aggregator` and :func:`calib.santa.worker.run_worker`
without Hydra, a model or MLflow, so a test can SIGKILL a real process cheaply. The test-only knobs
go through the functions' own hooks: ``--crash-at`` becomes a ``fault_hook`` that SIGKILLs the
process at one of ``CRASH_POINTS`` of one iteration, and ``--line-delay-s`` is ``run_worker``'s
``line_delay_s`` (a slow write, so a worker can be killed mid-file). Exit status of the aggregator:
0 done, 3 another aggregator holds the lease, 2 any other protocol error (one ``error:`` line).
The last stdout line is the summary as JSON. Users run ``python -m calib aggregator`` / ``worker``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from calib.errors import UserError
from calib.santa.aggregator import CRASH_POINTS, CorruptState, FaultHook, exit_on_sigterm, run_aggregator
from calib.santa.lease import LeaseHeld, LeaseLost
from calib.santa.worker import run_worker


def command(name: str, *args: str) -> list[str]:
    """The argv that runs ``name`` (``aggregator`` or ``worker``) of this harness in a fresh interpreter."""
    return [sys.executable, str(Path(__file__).resolve()), name, *args]


def crash_hook(spec: str | None) -> FaultHook | None:
    """``POINT:ITER`` -> a hook that SIGKILLs this process when it reaches POINT of iteration ITER."""
    if not spec:
        return None
    point, _, it = spec.partition(":")
    if point not in CRASH_POINTS or not it.isdigit():
        raise SystemExit(f"--crash-at {spec!r}: expected one of {', '.join(CRASH_POINTS)} followed by :ITERATION")

    def hook(at: str, iteration: int) -> None:
        if at == point and iteration == int(it):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def load_callable(spec: str) -> Callable:
    """``package.module:attr`` or ``path/to/file.py:attr`` -> the object."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"--evaluate {spec!r}: expected module:function or file.py:function")
    if target.endswith(".py"):
        mod_spec = importlib.util.spec_from_file_location(Path(target).stem, target)
        if mod_spec is None or mod_spec.loader is None:
            raise ValueError(f"cannot import {target}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, attr)


def aggregator(ns: argparse.Namespace) -> int:
    exit_on_sigterm()  # SIGTERM releases the lease, as in `python -m calib aggregator`
    try:
        summary = run_aggregator(ns.dir, ns.layers, ns.budget, iterations=ns.iterations, lr=ns.lr, poll_s=ns.poll_s,
                                 lease_ttl_s=ns.lease_ttl_s, temp_max_age_s=ns.temp_max_age_s,
                                 lease_wait_s=ns.lease_wait_s, fault_hook=crash_hook(ns.crash_at))
    except LeaseHeld as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except (UserError, CorruptState, LeaseLost) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(summary), sort_keys=True), flush=True)
    return 0


def worker(ns: argparse.Namespace) -> int:
    summary = run_worker(ns.dir, load_callable(ns.evaluate), episodes=ns.episodes, max_batches=ns.max_batches,
                         worker_id=ns.worker_id, seed=ns.seed, poll_s=ns.poll_s, line_delay_s=ns.line_delay_s)
    print(json.dumps(asdict(summary), sort_keys=True), flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python tests/santa/harness.py", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    agg = sub.add_parser("aggregator")
    agg.add_argument("--dir", required=True)
    agg.add_argument("--layers", type=int, required=True)
    agg.add_argument("--budget", type=int, required=True)
    agg.add_argument("--iterations", type=int, required=True)
    agg.add_argument("--lr", type=float, default=0.02)
    agg.add_argument("--poll-s", type=float, default=1.0)
    agg.add_argument("--lease-ttl-s", type=float, default=30.0)
    agg.add_argument("--lease-wait-s", type=float, default=None)
    agg.add_argument("--temp-max-age-s", type=float, default=600.0)
    agg.add_argument("--crash-at", default=None, help="SIGKILL self at POINT:ITERATION")
    wrk = sub.add_parser("worker")
    wrk.add_argument("--dir", required=True)
    wrk.add_argument("--evaluate", required=True, help="module:function or file.py:function: (budgets, rng) -> reward")
    wrk.add_argument("--episodes", type=int, default=10)
    wrk.add_argument("--max-batches", type=int, default=None)
    wrk.add_argument("--seed", type=int, default=None)
    wrk.add_argument("--worker-id", default=None)
    wrk.add_argument("--poll-s", type=float, default=1.0)
    wrk.add_argument("--line-delay-s", type=float, default=0.0, help="pause per written line")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    return aggregator(ns) if ns.command == "aggregator" else worker(ns)


if __name__ == "__main__":
    sys.exit(main())
