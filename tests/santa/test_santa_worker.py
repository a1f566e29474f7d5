"""The worker loop: what it evaluates, what it publishes, when it stops."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from harness import load_callable

from calib.santa.aggregator import run_aggregator
from calib.santa.inbox import Layout, PolicySnapshot, atomic_write_json, parse_result_file
from calib.santa.worker import run_worker


def _policy(root, iteration: int, theta: list[float], budget: int) -> None:
    layout = Layout(root).ensure()
    atomic_write_json(layout.policy_file(iteration), PolicySnapshot(iteration, np.array(theta), budget).to_json())


def test_worker_publishes_batches_from_the_newest_policy(tmp_path):
    _policy(tmp_path, 0, [0.0, 0.0, 0.0], 6)
    _policy(tmp_path, 1, [5.0, 0.0, -20.0], 6)  # p ~ [.993, .007, 1e-11]: layer 2 draws 0 samples
    seen: list[list[int]] = []

    def evaluate(budgets: list[int], rng: np.random.Generator) -> float:
        seen.append(budgets)
        return budgets[0] / 6

    summary = run_worker(tmp_path, evaluate, episodes=4, max_batches=3, seed=0)
    assert summary.batches == 3 and summary.results == 12 and summary.stopped_because == "max_batches"
    recs = [r for f in summary.files for r in parse_result_file(tmp_path / "inbox" / f, 3, 6)]
    assert len(recs) == 12 and all(r.policy_iteration == 1 for r in recs)
    assert all(r.schedule[2] == 0 for r in recs)  # the draw itself keeps the zero ...
    assert all(b[2] == 1 and min(b) >= 1 for b in seen)  # ... but that layer is evaluated with S = 1
    assert [r.reward for r in recs] == [max(r.schedule[0], 1) / 6 for r in recs]


def test_worker_seed_makes_batches_reproducible(tmp_path):
    _policy(tmp_path / "a", 0, [0.1, 0.2, 0.3, 0.4], 16)
    _policy(tmp_path / "b", 0, [0.1, 0.2, 0.3, 0.4], 16)

    def evaluate(budgets, rng):
        return float(rng.uniform())

    out = []
    for d in ("a", "b"):
        s = run_worker(tmp_path / d, evaluate, episodes=3, max_batches=2, seed=42)
        inbox = tmp_path / d / "inbox"
        out.append([(r.schedule, r.reward) for f in s.files for r in parse_result_file(inbox / f, 4, 16)])
    assert out[0] == out[1]


def test_worker_rejects_a_bad_reward(tmp_path):
    _policy(tmp_path, 0, [0.0, 0.0], 4)
    with pytest.raises(ValueError, match="finite number in"):
        run_worker(tmp_path, lambda b, rng: float("nan"), episodes=2, max_batches=1)
    with pytest.raises(ValueError, match="finite number in"):
        run_worker(tmp_path, lambda b, rng: 1.5, episodes=2, max_batches=1)
    assert list((tmp_path / "inbox").iterdir()) == []


def test_worker_waits_for_the_first_policy_and_stops_on_done(tmp_path):
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        s=run_worker(tmp_path, lambda b, rng: float(rng.uniform()), episodes=2, poll_s=0.01, seed=1)))
    t.start()
    summary = run_aggregator(tmp_path, 2, 8, iterations=3, poll_s=0.01, lease_ttl_s=5, temp_max_age_s=60)
    t.join(timeout=30)
    assert not t.is_alive() and summary.iteration == 3
    assert result["s"].stopped_because == "done" and result["s"].batches >= 3
    assert json.loads((tmp_path / "done.json").read_text())["iterations"] == 3


def test_worker_stop_event_never_publishes_a_partial_batch(tmp_path):
    _policy(tmp_path, 0, [0.0, 0.0], 4)
    stop = threading.Event()
    calls = []

    def evaluate(budgets, rng):
        calls.append(1)
        if len(calls) == 3:  # stop in the middle of the second batch
            stop.set()
        return 0.5

    summary = run_worker(tmp_path, evaluate, episodes=2, stop_event=stop)
    assert summary.batches == 1 and summary.stopped_because == "stop_event"
    assert len(list((tmp_path / "inbox").iterdir())) == 1


def test_load_callable_accepts_module_and_file(tmp_path):
    assert load_callable("json:dumps") is json.dumps
    f = tmp_path / "reward_fn.py"
    f.write_text("def reward(budgets, rng):\n    return 0.25\n")
    assert load_callable(f"{f}:reward")([1], None) == 0.25
