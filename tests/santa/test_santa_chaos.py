"""Chaos: real worker and aggregator processes on one rl.dir, killed with SIGKILL at random instants.

Acceptance (issue 7): every policy snapshot parses, iterations are consecutive, every published result
is counted at most once, no partial file is ever consumed, temp files of dead workers are swept, and
garbage in the inbox goes to quarantine/ and never reaches theta. ``check_rl_dir`` recomputes every
committed theta from the claimed files independently.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from santa_checks import check_rl_dir, publish_lines, result_lines, temp_files

from calib.santa.aggregator import CRASH_POINTS
from tests.subprocess_env import python_path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
L, N = 4, 16
TEMP_MAX_AGE_S = 1.0


@dataclass
class Chaos:
    root: Path
    rng: random.Random
    env: dict[str, str]
    workers: list[subprocess.Popen] = field(default_factory=list)
    aggregator: subprocess.Popen | None = None
    worker_kills: int = 0
    aggregator_kills: int = 0
    garbage: list[str] = field(default_factory=list)
    seeds: int = 0

    def start_worker(self, *extra: str) -> subprocess.Popen:
        self.seeds += 1
        cmd = [sys.executable, "-m", "calib.santa.worker", "--dir", str(self.root), "--evaluate",
               "synthetic_reward:reward", "--episodes", "3", "--seed", str(self.seeds), "--poll-s", "0.05",
               "--worker-id", f"w{self.seeds}", "--line-delay-s", "0.01", *extra]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.workers.append(proc)
        return proc

    def aggregator_cmd(self, iterations: int) -> list[str]:
        return [sys.executable, "-m", "calib.santa.aggregator", "--dir", str(self.root), "--layers", str(L),
                "--budget", str(N), "--iterations", str(iterations), "--poll-s", "0.02", "--lease-ttl-s", "3",
                "--temp-max-age-s", str(TEMP_MAX_AGE_S)]

    def start_aggregator(self, iterations: int, *extra: str) -> subprocess.Popen:
        self.aggregator = subprocess.Popen([*self.aggregator_cmd(iterations), *extra], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self.aggregator

    def committed(self) -> int:
        policy = self.root / "policy"
        return sum(1 for n in os.listdir(policy) if not n.startswith(".")) - 1 if policy.exists() else -1

    def kill_random_worker(self) -> None:
        alive = [w for w in self.workers if w.poll() is None]
        if alive:
            victim = self.rng.choice(alive)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            self.worker_kills += 1
        self.start_worker()

    def inject_garbage(self, kind: str) -> None:
        name = f"result-garbage-{len(self.garbage)}-{kind}.jsonl"
        recs = result_lines(0, [[4, 4, 4, 4], [16, 0, 0, 0]], [1.0, 0.0], tag=name, budget=N)
        if kind == "truncated":
            data = ("".join(json.dumps(r) + "\n" for r in recs))[:-25].encode()
        elif kind == "nan":
            data = ("".join(json.dumps(dict(r, reward=float("nan"))) + "\n" for r in recs)).encode()
        else:  # wrong schedule length
            data = ("".join(json.dumps(dict(r, schedule=[8, 8])) + "\n" for r in recs)).encode()
        publish_lines(self.root, name, data)
        self.garbage.append(name)


def kill_mid_write(chaos: Chaos) -> Path:
    """A worker that writes its file slowly, killed while its hidden temp file is half written."""
    proc = chaos.start_worker("--line-delay-s", "2.0")
    wid = f"w{chaos.seeds}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        temps = [p for p in temp_files(chaos.root / "inbox") if f"-{wid}-" in p.name]
        if temps:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the slow worker never started writing")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    chaos.worker_kills += 1
    assert temps[0].exists() and temps[0].stat().st_size > 0  # a partial file exists, hidden
    return temps[0]


def run_chaos(root: Path, *, seed: int, workers: int, iterations: int, aggregator_kills: int, budget_s: float) -> None:
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=python_path(REPO, HERE), SANTA_TEST_EVAL_SLEEP_S="0.05")
    chaos = Chaos(root=root, rng=rng, env=env)
    (root / "inbox").mkdir(parents=True)
    dead_temp = root / "inbox" / ".result-deadworker-0.jsonl.tmp-0"  # left by a worker killed long ago
    dead_temp.write_text('{"result_id": "half')
    os.utime(dead_temp, (time.time() - 3600, time.time() - 3600))
    for kind in ("truncated", "nan", "length"):
        chaos.inject_garbage(kind)
    # the first aggregator kills itself inside a random crash window (under real concurrency)
    crash_point = crash_point_0 = rng.choice(CRASH_POINTS)
    chaos.start_aggregator(iterations, "--crash-at", f"{crash_point}:{rng.randint(2, 4)}")
    for _ in range(workers):
        chaos.start_worker()
    partial = None
    # random kills once >= 6 iterations are committed, i.e. after the crash-window kill (iteration <= 4)
    kill_at = sorted(max(6, rng.uniform(0.2, 0.85) * iterations) for _ in range(aggregator_kills))
    start = time.monotonic()
    try:
        while (rc := chaos.aggregator.poll()) != 0:
            if rc == -signal.SIGKILL and crash_point:  # died in its crash window: restart it
                crash_point = ""
                chaos.aggregator_kills += 1
                chaos.start_aggregator(iterations)
                continue
            assert rc is None, f"aggregator failed: {chaos.aggregator.stderr.read()}"
            assert time.monotonic() - start < budget_s, f"chaos run exceeded {budget_s}s at {chaos.committed()}"
            time.sleep(rng.uniform(0.05, 0.3))
            if partial is None and chaos.committed() >= 2:
                partial = kill_mid_write(chaos)
            if kill_at and chaos.committed() >= kill_at[0]:
                kill_at.pop(0)
                time.sleep(rng.uniform(0.0, 0.1))
                chaos.aggregator.send_signal(signal.SIGKILL)
                chaos.aggregator.wait()
                chaos.aggregator_kills += 1
                chaos.start_aggregator(iterations)
            elif rng.random() < 0.35:
                chaos.kill_random_worker()
            elif rng.random() < 0.3:
                chaos.inject_garbage(rng.choice(["truncated", "nan", "length"]))
        # done.json: the surviving workers stop by themselves
        for w in chaos.workers:
            assert w.wait(timeout=30) in (0, -signal.SIGKILL)
    finally:
        for p in [*chaos.workers, chaos.aggregator]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    print(f"chaos seed {seed}: {iterations} iterations in {time.monotonic() - start:.1f}s, "
          f"{chaos.worker_kills} worker kills, {chaos.aggregator_kills} aggregator kills, "
          f"(one in its {crash_point_0} window), {len(chaos.garbage)} garbage files")
    assert chaos.aggregator_kills == aggregator_kills + 1 and not crash_point  # + the crash-window kill
    assert chaos.worker_kills >= 3 and partial is not None
    assert not dead_temp.exists()  # swept while the run went on
    # After every writer is gone, one more (idle) aggregator start sweeps what dead writers left.
    time.sleep(TEMP_MAX_AGE_S + 0.2)
    final = subprocess.run(chaos.aggregator_cmd(iterations), env=env, capture_output=True, text=True, timeout=60)
    assert final.returncode == 0, final.stderr
    facts = check_rl_dir(root, L, N)  # snapshots parse, consecutive, each theta recomputed, no double count
    assert facts.iterations == iterations
    assert facts.temps == [] and not partial.exists()
    # garbage is quarantined (or still waits, if injected after the last claim); nothing a worker published is
    assert sorted(facts.quarantined + [n for n in facts.inbox if "garbage" in n]) == sorted(chaos.garbage)
    garbage_ids = {r["result_id"] for g in chaos.garbage for r in result_lines(0, [[0]] * 2, [0, 0], tag=g, budget=N)}
    assert len(garbage_ids) == 2 * len(chaos.garbage) and not garbage_ids & set(facts.counted)
    assert all(name.startswith("result-w") for name in facts.claimed_files)


@pytest.mark.timeout(180)
def test_chaos_killed_workers_and_aggregator(tmp_path):
    run_chaos(tmp_path / "rl", seed=0, workers=3, iterations=30, aggregator_kills=2, budget_s=120)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_long(tmp_path):
    run_chaos(tmp_path / "rl", seed=1, workers=6, iterations=150, aggregator_kills=8, budget_s=400)
