"""The aggregator: updates from planted inbox files, quarantine, crash windows and resume, two
aggregators. Every run is checked with the independent recomputation in ``santa_checks``."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import harness
import pytest
from santa_checks import check_rl_dir, publish_lines, random_batch, result_lines, softmax64

from calib.errors import UserError
from calib.santa.aggregator import CRASH_POINTS, Aggregator, IterationRecord, run_aggregator
from calib.santa.lease import Lease, LeaseHeld, LeaseLost
from tests.subprocess_env import python_path

REPO = Path(__file__).resolve().parents[2]
L, N = 3, 12
FAST = dict(poll_s=0.01, lease_ttl_s=5.0, temp_max_age_s=60.0)


def test_one_update_by_hand(tmp_path):
    # theta0 = 0 -> p = 1/3, Np = [4,4,4]. s1=[8,2,2] r=1, s2=[2,5,5] r=0.5 -> b=.75,
    # g = (.25*[4,-2,-2] + (-.25)*[-2,1,1]) / 2 = [.75,-.375,-.375]; theta1 = .02 g.
    publish_lines(tmp_path, "result-a.jsonl", result_lines(0, [[8, 2, 2], [2, 5, 5]], [1.0, 0.5], tag="a", budget=N))
    seen: list[IterationRecord] = []
    summary = run_aggregator(tmp_path, L, N, iterations=1, on_iteration=seen.append, **FAST)
    assert summary.committed == [1] and summary.iteration == 1
    snap = json.loads((tmp_path / "policy" / "policy-1.json").read_text())
    np.testing.assert_allclose(snap["theta"], [0.015, -0.0075, -0.0075], rtol=0, atol=1e-15)
    hist = json.loads((tmp_path / "history" / "1.json").read_text())
    assert hist["baseline"] == 0.75 and hist["result_ids"] == seen[0].result_ids
    np.testing.assert_allclose(hist["gradient"], [0.75, -0.375, -0.375], rtol=0, atol=1e-15)
    assert json.loads((tmp_path / "claimed" / "1" / "manifest.json").read_text())["files"] == ["result-a.jsonl"]
    assert os.listdir(tmp_path / "inbox") == [] and (tmp_path / "done.json").exists()
    check_rl_dir(tmp_path, L, N)
    m = seen[0].metrics()
    assert m["baseline"] == 0.75 and m["num_results"] == 2 and m["staleness_max"] == 0
    np.testing.assert_allclose(m["grad_norm"], np.sqrt(0.75**2 + 2 * 0.375**2), rtol=1e-15)


def _feeder(root: Path, lags: tuple[int, ...] = (1,), episodes: int = 4):
    """A deterministic stand-in for workers: after iteration k commits, publish one batch per entry of
    ``lags``, batch j drawn from policy max(k - lags[j] + 1, 0) (results up to lags[j] - 1 stale).
    Content depends only on k, so a crashed-and-resumed run sees exactly the files of a clean run."""
    planted: set[int] = set()

    def plant(k: int) -> None:
        if k in planted:
            return
        planted.add(k)
        for j, lag in enumerate(lags):
            src = max(k - lag + 1, 0)
            theta = np.array(json.loads((root / "policy" / f"policy-{src}.json").read_text())["theta"])
            rng = np.random.default_rng([k, j])
            publish_lines(root, f"result-k{k:03d}-{j}.jsonl", random_batch(rng, theta, src, N, episodes, f"{k}/{j}"))

    def on_iteration(record: IterationRecord) -> None:
        plant(record.iteration)

    return plant, on_iteration


def _clean_run(root: Path, iterations: int, **feeder) -> list[np.ndarray]:
    plant, on_iteration = _feeder(root, **feeder)
    root.mkdir(parents=True, exist_ok=True)
    run_aggregator(root, L, N, iterations=0, **FAST)  # writes policy-0 only
    plant(0)
    run_aggregator(root, L, N, iterations=iterations, on_iteration=on_iteration, **FAST)
    return check_rl_dir(root, L, N).thetas


def test_stale_results_use_their_own_policy(tmp_path):
    thetas = _clean_run(tmp_path, 6, lags=(1, 2))
    assert len(thetas) == 7 and not np.allclose(thetas[6], 0)
    hist = json.loads((tmp_path / "history" / "5.json").read_text())
    assert set(hist["policy_iterations"]) == {3, 4}  # one batch from the current policy, one a step older
    # check_rl_dir recomputed each step with p of the recorded iteration. With the mean-reward baseline
    # the N*p term cancels when all records share one p (sum_k (r_k - b) = 0), so p matters exactly
    # in mixed claims like this one: using the current p for every record gives another theta.
    recs = [json.loads(x) for f in hist["files"] for x in (tmp_path / "claimed" / "5" / f).read_text().splitlines()]
    s = np.array([r["schedule"] for r in recs], float)
    r = np.array([r["reward"] for r in recs])
    wrong = thetas[4] + 0.02 * ((r - r.mean())[:, None] * (s - N * softmax64(thetas[4]))).mean(0)
    assert not np.allclose(wrong, thetas[5], rtol=0, atol=1e-9)


class SimulatedCrash(BaseException):
    """Raised by the fault hook: unwinds like a kill (no except-Exception handler catches it)."""


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_window_then_resume_gives_the_clean_trajectory(tmp_path, point):
    reference = _clean_run(tmp_path / "clean", 5, lags=(1, 2))
    root = tmp_path / "crashy"
    plant, on_iteration = _feeder(root, lags=(1, 2))
    root.mkdir()
    run_aggregator(root, L, N, iterations=0, **FAST)
    plant(0)

    def crash(at: str, iteration: int) -> None:
        if at == point and iteration == 3:
            raise SimulatedCrash(at)

    with pytest.raises(SimulatedCrash):
        run_aggregator(root, L, N, iterations=5, on_iteration=on_iteration, fault_hook=crash, **FAST)
    committed_before = len([n for n in os.listdir(root / "policy") if not n.startswith(".")]) - 1
    assert committed_before == (3 if point in ("after-snapshot", "after-history") else 2)
    replays: list[IterationRecord] = []

    def on_iteration_resumed(record: IterationRecord) -> None:
        if record.replayed:
            replays.append(record)
        on_iteration(record)

    summary = run_aggregator(root, L, N, iterations=5, on_iteration=on_iteration_resumed, **FAST)
    assert summary.iteration == 5
    assert [r.iteration for r in replays] == [committed_before]
    facts = check_rl_dir(root, L, N)
    for got, want in zip(facts.thetas, reference):
        np.testing.assert_array_equal(got, want)  # same files, same numbers: nothing lost or doubled
    hist3 = json.loads((root / "history" / "3.json").read_text())
    assert hist3["rebuilt"] == (point == "after-snapshot")
    assert facts.quarantined == [] and facts.temps == []


def test_crash_while_writing_the_manifest_reclaims_afresh(tmp_path):
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    publish_lines(tmp_path, "result-a.jsonl", random_batch(np.random.default_rng(0), np.zeros(L), 0, N, 3, "a"))
    (tmp_path / "claimed" / "1").mkdir(parents=True)
    (tmp_path / "claimed" / "1" / ".manifest.json.tmp-dead").write_text('{"iteration": 1, "fi')
    run_aggregator(tmp_path, L, N, iterations=1, **FAST)
    assert sorted(os.listdir(tmp_path / "claimed" / "1")) == ["manifest.json", "result-a.jsonl"]
    check_rl_dir(tmp_path, L, N)


def test_garbage_goes_to_quarantine_and_never_reaches_theta(tmp_path):
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    good = result_lines(0, [[6, 3, 3], [2, 2, 8]], [1.0, 0.25], tag="good", budget=N)
    publish_lines(tmp_path, "result-good.jsonl", good)
    dump = lambda recs: "".join(json.dumps(r) + "\n" for r in recs).encode()  # noqa: E731
    garbage = {
        "result-truncated.jsonl": dump(result_lines(0, [[4, 4, 4]] * 2, [1.0, 0.0], tag="t", budget=N))[:-30],
        "result-nan.jsonl": dump(result_lines(0, [[4, 4, 4], [12, 0, 0]], [float("nan"), 1.0], tag="n", budget=N)),
        "result-length.jsonl": dump(result_lines(0, [[4, 4, 2, 2], [12, 0, 0, 0]], [1.0, 0.0], tag="l", budget=N)),
        "result-future.jsonl": dump(result_lines(7, [[4, 4, 4], [12, 0, 0]], [1.0, 0.0], tag="f", budget=N)),
        "result-replayed.jsonl": dump(good),  # the same result ids again
    }
    for name, data in garbage.items():
        publish_lines(tmp_path, name, data)
    summary = run_aggregator(tmp_path, L, N, iterations=1, **FAST)
    facts = check_rl_dir(tmp_path, L, N)
    assert sorted(facts.quarantined) == sorted(garbage)
    assert sorted(summary.quarantined) == sorted(facts.quarantined)
    # theta moved by the good file alone: b = .625, g = (.375*[2,-1,-1] + (-.375)*[-2,-2,4]) / 2
    np.testing.assert_allclose(facts.thetas[1], 0.02 * np.array([0.75, 0.1875, -0.9375]), rtol=0, atol=1e-15)
    assert facts.claimed_files == ["result-good.jsonl"]
    reasons = {q: json.loads((tmp_path / "quarantine" / f"{q}.reason.json").read_text())["reason"]
               for q in facts.quarantined}
    assert "NaN" in reasons["result-nan.jsonl"] or "finite" in reasons["result-nan.jsonl"]
    assert "3 layers" in reasons["result-length.jsonl"]
    assert "newer than policy-0" in reasons["result-future.jsonl"]
    assert "already counted" in reasons["result-replayed.jsonl"]


def test_only_garbage_commits_nothing(tmp_path):
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    publish_lines(tmp_path, "result-bad.jsonl", b'{"result_id": "x", "reward": NaN}\n')
    stop = threading.Event()
    timer = threading.Timer(0.5, stop.set)
    timer.start()
    summary = run_aggregator(tmp_path, L, N, iterations=1, stop_event=stop, **FAST)
    assert summary.iteration == 0 and summary.stopped_because == "stop_event"
    assert summary.quarantined == ["result-bad.jsonl"]
    assert not (tmp_path / "claimed" / "1").exists() and not (tmp_path / "done.json").exists()


def test_resume_continues_numbering_and_counts_nothing_twice(tmp_path):
    plant, on_iteration = _feeder(tmp_path)
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    plant(0)
    run_aggregator(tmp_path, L, N, iterations=3, on_iteration=on_iteration, **FAST)
    assert (tmp_path / "done.json").exists()
    run_aggregator(tmp_path, L, N, iterations=6, on_iteration=on_iteration, **FAST)
    facts = check_rl_dir(tmp_path, L, N)
    assert facts.iterations == 6 and len(facts.counted) == 6 * 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=2), "at least one sample per layer"), (dict(lr=float("nan")), "rl.lr"),
    (dict(poll_s=0), "rl.poll_s"), (dict(iterations=-1), "rl.iterations"),
])
def test_out_of_range_settings_are_user_errors(tmp_path, kwargs, match):
    args = dict(dict(num_layers=L, budget=N, iterations=1, lr=0.02, **FAST), **kwargs)
    with pytest.raises(UserError, match=match):
        run_aggregator(tmp_path, **args)
    assert not (tmp_path / "aggregator.lease").exists()


def test_mismatched_directory_is_refused(tmp_path):
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    with pytest.raises(UserError, match="3 layers and budget 12"):
        run_aggregator(tmp_path, L + 1, N, iterations=1, **FAST)


def test_commit_with_a_lost_lease_writes_no_snapshot(tmp_path):
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    publish_lines(tmp_path, "result-a.jsonl", random_batch(np.random.default_rng(1), np.zeros(L), 0, N, 3, "a"))
    lease = Lease(tmp_path / "aggregator.lease", ttl_s=60)
    lease.acquire(wait_s=0)
    agg = Aggregator(tmp_path, L, N, lr=0.02, on_iteration=None, fault_hook=None)
    agg.lease = lease
    assert agg.recover() is None
    k = agg.claim_inbox()
    (tmp_path / "aggregator.lease").write_text(json.dumps({"owner": "other", "pid": 1, "host": "x", "beat": 0}))
    with pytest.raises(LeaseLost):
        agg.commit(k)
    lease.release()
    assert not (tmp_path / "policy" / "policy-1.json").exists()


def _aggregator_cmd(root: Path, iterations: int, *extra: str) -> list[str]:
    return harness.command("aggregator", "--dir", str(root), "--layers", str(L), "--budget", str(N),
                           "--iterations", str(iterations), "--poll-s", "0.02", "--lease-ttl-s", "2", *extra)


def test_two_aggregators(tmp_path):
    env = dict(os.environ, PYTHONPATH=python_path(REPO))
    first = subprocess.Popen(_aggregator_cmd(tmp_path, 100), env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "policy" / "policy-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # a second one in this process: refused while the first heartbeats
        with pytest.raises(LeaseHeld):
            run_aggregator(tmp_path, L, N, iterations=1, lease_wait_s=1.0, **dict(FAST, lease_ttl_s=2.0))
        # and as a command: a one-line error, exit status 3
        second = subprocess.run(_aggregator_cmd(tmp_path, 1, "--lease-wait-s", "0.5"), env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 3 and "another aggregator holds" in second.stderr
    finally:
        first.kill()  # SIGKILL: the lease stays behind, naming a dead pid
        first.wait()
    lease = json.loads((tmp_path / "aggregator.lease").read_text())
    assert lease["pid"] == first.pid
    publish_lines(tmp_path, "result-a.jsonl", random_batch(np.random.default_rng(2), np.zeros(L), 0, N, 3, "a"))
    t0 = time.monotonic()
    summary = run_aggregator(tmp_path, L, N, iterations=1, lease_wait_s=10.0, **FAST)
    assert summary.iteration == 1 and time.monotonic() - t0 < 5.0  # dead local pid: taken over at once
    assert not (tmp_path / "aggregator.lease").exists()  # released on exit
    check_rl_dir(tmp_path, L, N)


def test_killed_aggregator_subprocess_resumes(tmp_path):
    """A real SIGKILL between snapshot and history (the harness's --crash-at hook kills the process itself)."""
    env = dict(os.environ, PYTHONPATH=python_path(REPO))
    plant, _ = _feeder(tmp_path)
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    plant(0)
    proc = subprocess.run(_aggregator_cmd(tmp_path, 1, "--crash-at", "after-snapshot:1"), env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9
    assert (tmp_path / "policy" / "policy-1.json").exists() and not (tmp_path / "history" / "1.json").exists()
    proc = subprocess.run(_aggregator_cmd(tmp_path, 1), env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["iteration"] == 1
    assert json.loads((tmp_path / "history" / "1.json").read_text())["rebuilt"] is True
    check_rl_dir(tmp_path, L, N)


def test_sigterm_releases_the_lease(tmp_path):
    env = dict(os.environ, PYTHONPATH=python_path(REPO))
    proc = subprocess.Popen(_aggregator_cmd(tmp_path, 100), env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "policy" / "policy-0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "aggregator.lease").exists()
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert not (tmp_path / "aggregator.lease").exists()


def test_rebuild_after_a_crash_uses_the_step_size_that_was_committed(tmp_path):
    plant, on_iteration = _feeder(tmp_path, lags=(1, 2))
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    plant(0)

    def crash(at: str, iteration: int) -> None:
        if at == "after-snapshot" and iteration == 2:
            raise SimulatedCrash(at)

    with pytest.raises(SimulatedCrash):
        run_aggregator(tmp_path, L, N, iterations=4, lr=0.02, on_iteration=on_iteration, fault_hook=crash, **FAST)
    run_aggregator(tmp_path, L, N, iterations=4, lr=0.05, on_iteration=on_iteration, **FAST)  # lr changed
    lrs = [json.loads((tmp_path / "history" / f"{k}.json").read_text())["lr"] for k in (1, 2, 3, 4)]
    assert lrs == [0.02, 0.02, 0.05, 0.05]
    check_rl_dir(tmp_path, L, N, lr=None)


def test_aggregator_stops_when_its_lease_is_taken_over(tmp_path):
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run_aggregator(tmp_path, L, N, iterations=5, **dict(FAST, lease_ttl_s=0.4))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    deadline = time.monotonic() + 20
    while not (tmp_path / "policy" / "policy-0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    (tmp_path / "aggregator.lease").write_text(json.dumps({"owner": "other", "pid": 1, "host": "x", "beat": 0}))
    t.join(timeout=20)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], LeaseLost)
    assert json.loads((tmp_path / "aggregator.lease").read_text())["owner"] == "other"


# ------------------------------------------------------------------ untrusted claim manifests


def _victim(tmp_path: Path) -> tuple[Path, Path, tuple[bytes, int]]:
    """rl.dir = tmp_path/rl and a file outside it holding a valid batch (counting it would show)."""
    victim = tmp_path / "victim.txt"
    publish_lines(tmp_path, "victim.txt", result_lines(0, [[4, 4, 4], [12, 0, 0]], [1.0, 0.0], tag="victim", budget=N))
    os.replace(tmp_path / "inbox" / "victim.txt", victim)
    os.rmdir(tmp_path / "inbox")
    return tmp_path / "rl", victim, (victim.read_bytes(), victim.stat().st_mtime_ns)


def _write_manifest(root: Path, k: int, files: list) -> None:
    (root / "claimed" / str(k)).mkdir(parents=True, exist_ok=True)
    (root / "claimed" / str(k) / "manifest.json").write_text(json.dumps({"iteration": k, "files": files, "time": 0}))


@pytest.mark.parametrize("entry", ["../../victim.txt", "ABSOLUTE", "result-a.jsonl/../../../victim.txt", ".."])
def test_a_manifest_naming_paths_outside_its_claim_is_not_trusted(tmp_path, entry):
    root, victim, before = _victim(tmp_path)
    run_aggregator(root, L, N, iterations=0, **FAST)
    good = random_batch(np.random.default_rng(3), np.zeros(L), 0, N, 3, "a")
    publish_lines(root, "result-a.jsonl", good)
    # as if an aggregator died after claiming iteration 1, with a manifest someone rewrote
    _write_manifest(root, 1, [str(victim) if entry == "ABSOLUTE" else entry, "result-a.jsonl"])
    summary = run_aggregator(root, L, N, iterations=1, **FAST)
    assert summary.committed == [1]
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before and os.listdir(root / "quarantine") == []
    facts = check_rl_dir(root, L, N)
    assert facts.counted == [r["result_id"] for r in good] and facts.claimed_files == ["result-a.jsonl"]


def test_a_manifest_listing_symlinks_is_recovered_from_the_claim_folder(tmp_path):
    root, victim, before = _victim(tmp_path)
    run_aggregator(root, L, N, iterations=0, **FAST)
    moved = random_batch(np.random.default_rng(4), np.zeros(L), 0, N, 3, "b")
    waiting = random_batch(np.random.default_rng(5), np.zeros(L), 0, N, 2, "c")
    publish_lines(root, "result-c.jsonl", waiting)
    _write_manifest(root, 1, ["result-b.jsonl", "result-link.jsonl"])
    (root / "claimed" / "1" / "result-b.jsonl").write_bytes(
        "".join(json.dumps(r) + "\n" for r in moved).encode())  # moved before the crash
    (root / "claimed" / "1" / "result-link.jsonl").symlink_to(victim)  # a valid batch, if followed
    summary = run_aggregator(root, L, N, iterations=2, **FAST)
    assert summary.committed == [1, 2]
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    assert os.readlink(root / "quarantine" / "result-link.jsonl") == str(victim)  # moved, never read
    facts = check_rl_dir(root, L, N)
    hist = [json.loads((root / "history" / f"{k}.json").read_text()) for k in (1, 2)]
    assert hist[0]["files"] == ["result-b.jsonl"] and hist[1]["files"] == ["result-c.jsonl"]
    assert sorted(facts.counted) == sorted(r["result_id"] for r in moved + waiting)
    assert json.loads((root / "claimed" / "1" / "manifest.json").read_text())["files"] == ["result-b.jsonl"]


def test_a_manifest_whose_inbox_entry_became_a_symlink_is_not_trusted(tmp_path):
    root, victim, before = _victim(tmp_path)
    run_aggregator(root, L, N, iterations=0, **FAST)
    publish_lines(root, "result-a.jsonl", random_batch(np.random.default_rng(6), np.zeros(L), 0, N, 3, "a"))
    _write_manifest(root, 1, ["result-a.jsonl", "result-v.jsonl"])  # died after the manifest, before moving
    (root / "inbox" / "result-v.jsonl").symlink_to(victim)
    summary = run_aggregator(root, L, N, iterations=1, **FAST)
    assert summary.committed == [1] and summary.quarantined == ["result-v.jsonl"]
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    assert check_rl_dir(root, L, N).claimed_files == ["result-a.jsonl"]


def test_a_committed_iteration_with_a_traversing_manifest_is_rebuilt_from_its_files(tmp_path):
    root, victim, before = _victim(tmp_path)
    run_aggregator(root, L, N, iterations=0, **FAST)
    good = random_batch(np.random.default_rng(7), np.zeros(L), 0, N, 3, "a")
    publish_lines(root, "result-a.jsonl", good)
    run_aggregator(root, L, N, iterations=1, **FAST)
    (root / "history" / "1.json").unlink()  # as if killed between snapshot and history
    _write_manifest(root, 1, ["../../victim.txt"])
    assert run_aggregator(root, L, N, iterations=1, **FAST).iteration == 1
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    hist = json.loads((root / "history" / "1.json").read_text())
    assert hist["rebuilt"] is True and hist["result_ids"] == [r["result_id"] for r in good]
    check_rl_dir(root, L, N)
