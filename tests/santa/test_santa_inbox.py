"""The shared-directory protocol: atomic files, result validation, sweeping and the lease."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from santa_checks import publish_lines, result_lines

from calib.santa.inbox import (
    InboxWriter,
    Layout,
    MalformedResult,
    PolicySnapshot,
    list_results,
    make_batch,
    parse_result_file,
    read_newest_policy,
    sweep_temp_files,
)
from calib.santa.lease import Lease, LeaseHeld, LeaseLost
from calib.santa.volume import atomic_write_json, exclusive_publish_json


def test_inbox_writer_publishes_one_complete_file_and_no_temp(tmp_path):
    writer = InboxWriter(tmp_path, "w1")
    recs = make_batch("w1", 3, 8, [(np.array([4, 4]), 0.5), (np.array([8, 0]), 1.0)])
    path = writer.publish(recs)
    assert os.listdir(tmp_path / "inbox") == [path.name]
    parsed = parse_result_file(path, num_layers=2, budget=8)
    assert [r.reward for r in parsed] == [0.5, 1.0] and [r.schedule for r in parsed] == [(4, 4), (8, 0)]
    assert all(r.policy_iteration == 3 for r in parsed) and len({r.result_id for r in parsed}) == 2


def test_writer_killed_mid_write_leaves_only_a_hidden_temp(tmp_path):
    code = (
        "import numpy as np, sys\n"
        "from calib.santa.inbox import InboxWriter, make_batch\n"
        "w = InboxWriter(sys.argv[1], 'slow', line_delay_s=5.0)\n"
        "w.publish(make_batch('slow', 0, 4, [(np.array([2, 2]), 0.5)] * 3))\n"
    )
    (tmp_path / "inbox").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not os.listdir(tmp_path / "inbox"):
            time.sleep(0.02)
        time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    names = os.listdir(tmp_path / "inbox")
    assert len(names) == 1 and names[0].startswith(".") and ".tmp-" in names[0]
    assert (tmp_path / "inbox" / names[0]).stat().st_size > 0  # a partial line was written
    assert list_results(tmp_path / "inbox") == []  # invisible to the aggregator


GOOD = result_lines(0, [[3, 1], [2, 2]], [1.0, 0.0], tag="good", budget=4)


def _garbage_cases() -> dict[str, bytes]:
    def dump(recs):
        return "".join(json.dumps(r) + "\n" for r in recs).encode()

    nan = [dict(GOOD[0], reward=float("nan")), GOOD[1]]
    cases = {
        "truncated_json": dump(GOOD)[:-20] + b"\n",
        "no_final_newline": dump(GOOD)[:-1],
        "nan_reward": dump(nan),
        "infinite_reward": dump(GOOD).replace(b'"reward": 1.0', b'"reward": Infinity'),
        "reward_above_one": dump([dict(GOOD[0], reward=1.5), GOOD[1]]),
        "wrong_schedule_length": dump([dict(GOOD[0], schedule=[1, 1, 2]), GOOD[1]]),
        "schedule_sum_not_budget": dump([dict(GOOD[0], schedule=[3, 3]), GOOD[1]]),
        "negative_schedule": dump([dict(GOOD[0], schedule=[5, -1]), GOOD[1]]),
        "bool_in_schedule": dump([dict(GOOD[0], schedule=[True, 3]), GOOD[1]]),
        "float_schedule": dump([dict(GOOD[0], schedule=[3.0, 1.0]), GOOD[1]]),
        "missing_result_id": dump([{k: v for k, v in GOOD[0].items() if k != "result_id"}, GOOD[1]]),
        "string_policy_iteration": dump([dict(GOOD[0], policy_iteration="0"), GOOD[1]]),
        "cut_at_line_boundary": dump(GOOD[:1]),
        "duplicate_ids": dump([GOOD[0], dict(GOOD[1], result_id=GOOD[0]["result_id"])]),
        "empty": b"",
        "not_utf8": b"\xff\xfe\n",
        "json_array": b"[1, 2, 3]\n",
    }
    return cases


@pytest.mark.parametrize("case", sorted(_garbage_cases()))
def test_parse_result_file_rejects_garbage(tmp_path, case):
    path = publish_lines(tmp_path, f"result-{case}.jsonl", _garbage_cases()[case])
    with pytest.raises(MalformedResult):
        parse_result_file(path, num_layers=2, budget=4)


def test_policy_snapshots_newest_parsable_and_temps_ignored(tmp_path):
    layout = Layout(tmp_path).ensure()
    assert read_newest_policy(layout) is None
    for i in range(3):
        atomic_write_json(layout.policy_file(i), PolicySnapshot(i, np.full(4, float(i)), 32).to_json())
    (layout.policy / ".policy-3.json.tmp-dead").write_text('{"iteration": 3, "the')
    snap = read_newest_policy(layout)
    assert snap.iteration == 2 and snap.theta.tolist() == [2.0] * 4 and snap.budget == 32
    layout.policy_file(3).write_text("{ not json")  # never produced by the protocol: skipped
    assert read_newest_policy(layout).iteration == 2


def test_exclusive_publish_refuses_an_existing_name(tmp_path):
    target = tmp_path / "policy-1.json"
    assert exclusive_publish_json(target, {"a": 1})
    assert not exclusive_publish_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["policy-1.json"]  # the loser's temp file is gone


def test_sweep_removes_only_old_hidden_temps(tmp_path):
    layout = Layout(tmp_path).ensure()
    (layout.claimed / "4").mkdir()
    old = [layout.inbox / ".result-a.jsonl.tmp-1", layout.policy / ".policy-2.json.tmp-2",
           layout.claimed / "4" / ".manifest.json.tmp-3", layout.history / ".3.json.tmp-4"]
    young = layout.inbox / ".result-b.jsonl.tmp-5"
    keep = [layout.inbox / "result-c.jsonl", layout.inbox / ".hidden-not-temp"]
    for p in [*old, young, *keep]:
        p.write_text("x")
    past = time.time() - 100
    for p in [*old, *keep]:
        os.utime(p, (past, past))
    swept = sweep_temp_files(layout, max_age_s=50)
    assert sorted(swept) == sorted(old)
    assert all(p.exists() for p in [young, *keep])


def test_sweep_deletes_no_directory_and_follows_no_link(tmp_path):
    layout = Layout(tmp_path / "rl").ensure()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = elsewhere / ".notes.tmp-1"  # outside rl.dir, reachable only through the link below
    (layout.claimed / "7").symlink_to(elsewhere)
    temp_dir = layout.inbox / ".result-x.jsonl.tmp-dir"
    temp_dir.mkdir()
    fifo = layout.inbox / ".result-y.jsonl.tmp-fifo"
    os.mkfifo(fifo)
    theirs.write_text("x")
    past = time.time() - 100
    for p in (theirs, temp_dir, fifo):
        os.utime(p, (past, past))
    assert sweep_temp_files(layout, max_age_s=50) == [fifo]  # a dead writer's leftover of any kind but a folder
    assert temp_dir.is_dir() and theirs.exists()


# ---------------------------------------------------------------------------------- lease


def test_second_lease_is_refused_while_the_first_is_alive(tmp_path):
    a = Lease(tmp_path / "aggregator.lease", ttl_s=2.0)
    a.acquire(wait_s=0)
    b = Lease(tmp_path / "aggregator.lease", ttl_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(LeaseHeld):
        b.acquire(wait_s=1.0, poll_s=0.05)  # a's heartbeat changes the file every ttl/4: never stale
    assert time.monotonic() - t0 >= 1.0
    a.check()
    a.release()
    assert not (tmp_path / "aggregator.lease").exists()
    b.acquire(wait_s=0)
    b.release()


def test_stale_lease_of_another_host_is_taken_over_after_ttl(tmp_path):
    path = tmp_path / "aggregator.lease"
    path.write_text(json.dumps({"owner": "x", "pid": 1, "host": "some-other-pod", "beat": 7, "time": 0}))
    lease = Lease(path, ttl_s=0.6)
    t0 = time.monotonic()
    lease.acquire(wait_s=5.0, poll_s=0.05)
    assert time.monotonic() - t0 >= 0.6  # judged stale on our own clock, not on the file's timestamp
    assert json.loads(path.read_text())["owner"] == lease.owner
    lease.release()


def test_lease_of_a_dead_local_process_is_taken_over_at_once(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    path = tmp_path / "aggregator.lease"
    path.write_text(json.dumps({"owner": "dead", "pid": int(proc.stdout), "host": socket.gethostname(), "beat": 0}))
    lease = Lease(path, ttl_s=60.0)
    t0 = time.monotonic()
    lease.acquire(wait_s=5.0)
    assert time.monotonic() - t0 < 2.0
    lease.release()


def test_owner_notices_a_takeover_and_must_not_commit(tmp_path):
    path = tmp_path / "aggregator.lease"
    a = Lease(path, ttl_s=60.0)
    a.acquire(wait_s=0)
    path.write_text(json.dumps({"owner": "usurper", "pid": 1, "host": "elsewhere", "beat": 0}))
    with pytest.raises(LeaseLost):
        a.check()
    a.release()
    assert json.loads(path.read_text())["owner"] == "usurper"  # release does not delete someone else's lease


def test_only_one_of_many_contenders_gets_a_stale_lease(tmp_path):
    path = tmp_path / "aggregator.lease"
    path.write_text(json.dumps({"owner": "x", "pid": 1, "host": "gone", "beat": 0}))
    leases = [Lease(path, ttl_s=0.3) for _ in range(6)]
    results: list[str] = []

    def contend(lease: Lease) -> None:
        try:
            lease.acquire(wait_s=1.5, poll_s=0.01)
            results.append(lease.owner)
        except LeaseHeld:
            pass

    threads = [threading.Thread(target=contend, args=(le,)) for le in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1 and json.loads(path.read_text())["owner"] == results[0]
    for le in leases:
        le.release()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["deep", "fifo", "empty"])
def test_a_garbage_lease_file_is_taken_over_without_hanging_or_crashing(tmp_path, kind):
    path = tmp_path / "aggregator.lease"
    if kind == "deep":
        path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    elif kind == "fifo":
        os.mkfifo(path)  # reading it without a writer would block
    else:
        path.write_bytes(b"")
    lease = Lease(path, ttl_s=0.3)
    lease.acquire(wait_s=5.0, poll_s=0.05)  # unchanged for a TTL: stale, whatever it holds
    assert json.loads(path.read_text())["owner"] == lease.owner
    lease.release()


def test_a_garbage_lease_written_over_ours_means_it_is_lost(tmp_path):
    path = tmp_path / "aggregator.lease"
    lease = Lease(path, ttl_s=60.0)
    lease.acquire(wait_s=0)
    path.write_bytes(b"[" * 100_000)
    with pytest.raises(LeaseLost):
        lease.check()
    lease.release()
    assert path.read_bytes() == b"[" * 100_000
