"""Chaos: real worker and aggregator processes on one rl.dir, killed with SIGKILL at random instants.

The aggregator is killed several times in one run: inside protocol crash windows (the harness's ``--crash-at``) and
from outside at random instants, while workers are killed at random (one of them mid-write) and
poison lands in the inbox mid-run (garbage files, deep nesting, a directory, a FIFO, a symlink to a
file outside rl.dir, non-UTF-8 bytes). Acceptance: every policy snapshot parses and never changes
once visible, iterations are consecutive, every published result is counted at most once and none
is lost (quarantined or left uncounted in a claim), no partial file is ever consumed, temp files of
dead workers are swept, and poison goes to quarantine/ and never reaches theta. ``check_rl_dir``
recomputes every committed theta from the claimed files independently.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness
import pytest
from santa_checks import check_rl_dir, publish_lines, result_lines, temp_files

from calib.santa.aggregator import CRASH_POINTS
from tests.subprocess_env import python_path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
L, N = 4, 16
TEMP_MAX_AGE_S = 1.0
GARBAGE = ("truncated", "nan", "length")  # regular files that santa_checks can still read in the inbox
POISON = ("deep", "binary", "dir", "fifo", "symlink")  # dropped only while at least half the run remains


@dataclass
class Chaos:
    root: Path
    rng: random.Random
    env: dict[str, str]
    outside: Path  # a valid batch outside rl.dir, the target of a poison symlink
    workers: list[subprocess.Popen] = field(default_factory=list)
    aggregator: subprocess.Popen | None = None
    crash_pending: str = ""  # the crash window the running aggregator will die in, if any
    worker_kills: int = 0
    aggregator_kills: int = 0
    garbage: list[str] = field(default_factory=list)
    seeds: int = 0
    snapshots: dict[str, bytes] = field(default_factory=dict)  # each policy file as first seen

    def start_worker(self, *extra: str) -> subprocess.Popen:
        self.seeds += 1
        cmd = harness.command("worker", "--dir", str(self.root), "--evaluate", "synthetic_reward:reward",
                              "--episodes", "3", "--seed", str(self.seeds), "--poll-s", "0.05",
                              "--worker-id", f"w{self.seeds}", "--line-delay-s", "0.01", *extra)
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.workers.append(proc)
        return proc

    def aggregator_cmd(self, iterations: int) -> list[str]:
        return harness.command("aggregator", "--dir", str(self.root), "--layers", str(L), "--budget", str(N),
                               "--iterations", str(iterations), "--poll-s", "0.02", "--lease-ttl-s", "3",
                               "--temp-max-age-s", str(TEMP_MAX_AGE_S))

    def start_aggregator(self, iterations: int, crash_point: str = "") -> subprocess.Popen:
        """Start an aggregator; with ``crash_point`` it SIGKILLs itself in that window 1-3 iterations on."""
        extra: tuple[str, ...] = ()
        if crash_point:
            extra = ("--crash-at", f"{crash_point}:{max(self.committed(), 0) + self.rng.randint(1, 3)}")
        self.crash_pending = crash_point
        self.aggregator = subprocess.Popen([*self.aggregator_cmd(iterations), *extra], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self.aggregator

    def kill_aggregator(self) -> None:
        self.aggregator.send_signal(signal.SIGKILL)
        self.aggregator.wait()
        self.aggregator_kills += 1

    def committed(self) -> int:
        policy = self.root / "policy"
        return sum(1 for n in os.listdir(policy) if not n.startswith(".")) - 1 if policy.exists() else -1

    def watch_snapshots(self) -> None:
        """Every visible snapshot parses, iterations are consecutive, and none changes once seen."""
        if not (self.root / "policy").exists():
            return
        names = [n for n in os.listdir(self.root / "policy") if not n.startswith(".")]
        assert sorted(names) == sorted(f"policy-{i}.json" for i in range(len(names))), sorted(names)
        for name in names:
            data = (self.root / "policy" / name).read_bytes()
            assert self.snapshots.setdefault(name, data) == data, f"{name} was rewritten"
            assert json.loads(data)["iteration"] == int(name[7:-5])

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
        path = self.root / "inbox" / name
        recs = result_lines(0, [[4, 4, 4, 4], [16, 0, 0, 0]], [1.0, 0.0], tag=name, budget=N)
        lines = "".join(json.dumps(r) + "\n" for r in recs)
        if kind == "dir":
            path.mkdir()
            (path / "result-inner.jsonl").write_text(lines)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink":
            path.symlink_to(self.outside)
        else:
            data = {"truncated": lines[:-25].encode(),
                    "nan": "".join(json.dumps(dict(r, reward=float("nan"))) + "\n" for r in recs).encode(),
                    "length": "".join(json.dumps(dict(r, schedule=[8, 8])) + "\n" for r in recs).encode(),
                    "deep": b"[" * 100_000 + b"]" * 100_000 + b"\n",
                    "binary": b"\xff\xfe" + self.rng.randbytes(64) + b"\n"}[kind]
            publish_lines(self.root, name, data)
        self.garbage.append(name)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def kill_mid_write(chaos: Chaos) -> Path:
    """A worker that writes its file slowly, killed while its hidden temp file is half written."""
    proc = chaos.start_worker("--line-delay-s", "2.0")
    wid = f"w{chaos.seeds}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        # the temp file is created empty, then written a line at a time: wait for its first line
        temps = [p for p in temp_files(chaos.root / "inbox") if f"-{wid}-" in p.name and _size(p) > 0]
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


def _outside_batch(root: Path) -> tuple[Path, list[str]]:
    """A valid batch in a file outside rl.dir: counting it would mean a symlink was followed."""
    recs = result_lines(0, [[4, 4, 4, 4]] * 2, [1.0, 0.0], tag="outside", budget=N)
    path = root.parent / "outside" / "result-outside.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path, [r["result_id"] for r in recs]


def run_chaos(root: Path, *, seed: int, workers: int, iterations: int, crash_kills: int, aggregator_kills: int,
              budget_s: float) -> None:
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=python_path(REPO, HERE), SANTA_TEST_EVAL_SLEEP_S="0.05")
    outside, outside_ids = _outside_batch(root)
    outside_before = (outside.read_bytes(), outside.stat().st_mtime_ns)
    chaos = Chaos(root=root, rng=rng, env=env, outside=outside)
    (root / "inbox").mkdir(parents=True)
    dead_temp = root / "inbox" / ".result-deadworker-0.jsonl.tmp-0"  # left by a worker killed long ago
    dead_temp.write_text('{"result_id": "half')
    os.utime(dead_temp, (time.time() - 3600, time.time() - 3600))
    for kind in GARBAGE:
        chaos.inject_garbage(kind)
    # the first aggregators kill themselves inside random crash windows (under real concurrency) ...
    crash_plan = [rng.choice(CRASH_POINTS) for _ in range(crash_kills)]
    windows = list(crash_plan)
    chaos.start_aggregator(iterations, crash_plan.pop(0) if crash_plan else "")
    for _ in range(workers):
        chaos.start_worker()
    partial = None
    poison_at = max(3, iterations // 4)  # every kind of poison lands once here, more at random until half-way
    # ... then others are killed from outside at random instants, at distinct iterations
    kill_at = sorted(rng.uniform(0.3, 0.7) * iterations for _ in range(aggregator_kills))
    start = time.monotonic()
    try:
        while (rc := chaos.aggregator.poll()) != 0:
            if rc == -signal.SIGKILL and chaos.crash_pending:  # died in its crash window: restart it
                chaos.aggregator_kills += 1
                chaos.start_aggregator(iterations, crash_plan.pop(0) if crash_plan else "")
                continue
            assert rc is None, f"aggregator failed: {chaos.aggregator.stderr.read()}"
            assert time.monotonic() - start < budget_s, f"chaos run exceeded {budget_s}s at {chaos.committed()}"
            time.sleep(rng.uniform(0.05, 0.3))
            chaos.watch_snapshots()
            done = chaos.committed()
            if partial is None and done >= 2:
                partial = kill_mid_write(chaos)
            if poison_at is not None and done >= poison_at:
                poison_at = None
                for kind in POISON:
                    chaos.inject_garbage(kind)
            if kill_at and not chaos.crash_pending and done >= kill_at[0]:
                kill_at = [max(k, done + 1) for k in kill_at[1:]]
                time.sleep(rng.uniform(0.0, 0.1))
                chaos.kill_aggregator()
                chaos.start_aggregator(iterations)
            elif rng.random() < 0.35:
                chaos.kill_random_worker()
            elif rng.random() < 0.3:
                chaos.inject_garbage(rng.choice(GARBAGE + POISON if done < iterations // 2 else GARBAGE))
        # done.json: the surviving workers stop by themselves
        for w in chaos.workers:
            assert w.wait(timeout=30) in (0, -signal.SIGKILL)
    finally:
        for p in [*chaos.workers, chaos.aggregator]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    print(f"chaos seed {seed}: {iterations} iterations in {time.monotonic() - start:.1f}s, "
          f"{chaos.worker_kills} worker kills, {chaos.aggregator_kills} aggregator kills "
          f"({crash_kills} in the windows {windows}), {len(chaos.garbage)} garbage files")
    assert chaos.aggregator_kills == crash_kills + aggregator_kills and not crash_plan and not kill_at
    assert chaos.worker_kills >= 3 and partial is not None
    assert not dead_temp.exists()  # swept while the run went on
    # After every writer is gone, one more (idle) aggregator start sweeps what dead writers left.
    time.sleep(TEMP_MAX_AGE_S + 0.2)
    final = subprocess.run(chaos.aggregator_cmd(iterations), env=env, capture_output=True, text=True, timeout=60)
    assert final.returncode == 0, final.stderr
    chaos.watch_snapshots()  # every snapshot still parses and holds what it held when first seen
    quarantined = {n for n in os.listdir(root / "quarantine") if not n.endswith(".reason.json")}
    poison = {g for g in chaos.garbage if g.rsplit("-", 1)[1][:-6] in POISON}
    assert poison <= quarantined, f"poison left in the inbox: {sorted(poison - quarantined)}"
    facts = check_rl_dir(root, L, N)  # snapshots parse, consecutive, each theta recomputed, no double count
    assert facts.iterations == iterations
    assert facts.temps == [] and not partial.exists()
    # garbage is quarantined (or still waits, if injected after the last claim); nothing a worker published is,
    # and what a worker published sits in a committed claim (counted: check_rl_dir) or still waits in the inbox
    assert sorted(facts.quarantined + [n for n in facts.inbox if "garbage" in n]) == sorted(chaos.garbage)
    assert all(name.startswith("result-w") for name in facts.claimed_files)
    assert not (root / "claimed" / str(iterations + 1)).exists()
    garbage_ids = {r["result_id"] for g in chaos.garbage for r in result_lines(0, [[0]] * 2, [0, 0], tag=g, budget=N)}
    assert len(garbage_ids) == 2 * len(chaos.garbage) and not (garbage_ids | set(outside_ids)) & set(facts.counted)
    assert (outside.read_bytes(), outside.stat().st_mtime_ns) == outside_before
    assert os.readlink(root / "quarantine" / next(g for g in poison if g.endswith("-symlink.jsonl"))) == str(outside)


@pytest.mark.timeout(180)
def test_chaos_killed_workers_and_aggregator(tmp_path):
    run_chaos(tmp_path / "rl", seed=0, workers=3, iterations=30, crash_kills=2, aggregator_kills=3, budget_s=120)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_long(tmp_path):
    run_chaos(tmp_path / "rl", seed=1, workers=6, iterations=150, crash_kills=4, aggregator_kills=8, budget_s=400)
