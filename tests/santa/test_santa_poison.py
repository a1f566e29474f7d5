"""Poison in the inbox: whatever a writer of the shared volume drops there, the aggregator survives,
quarantines it with a reason, counts it, and still counts every valid result exactly once.

Each bad case is built for real inside ``tmp_path`` (deep nesting, a directory, a FIFO, a socket,
symlinks, huge lines, sparse huge files, NaN/Infinity, wrong types, non-UTF-8, empty files), then a
seeded fuzz mix of invalid-by-construction files; every run is checked with ``check_rl_dir``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import harness
import pytest
from santa_checks import check_rl_dir, publish_lines, result_lines

from calib.santa.aggregator import run_aggregator
from calib.santa.inbox import MAX_LINE_BYTES, MAX_RESULT_BYTES, MalformedResult, parse_result_file
from calib.santa.volume import UnsafeFile, json_depth, loads_json, read_regular
from tests.subprocess_env import python_path

REPO = Path(__file__).resolve().parents[2]
L, N = 3, 12
FAST = dict(poll_s=0.01, lease_ttl_s=5.0, temp_max_age_s=60.0)


def dump(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def batch(tag: str) -> list[dict]:
    """A valid batch of two records drawn from policy-0, with ids unique to ``tag``."""
    return result_lines(0, [[6, 3, 3], [2, 2, 8]], [1.0, 0.25], tag=tag, budget=N)


# ------------------------------------------------------------------------ bounded reading


def nested_depth(obj: object) -> int:
    """Nesting depth of a Python value: the independent reference for ``json_depth``."""
    if isinstance(obj, dict):
        return 1 + max(map(nested_depth, obj.values()), default=0)
    if isinstance(obj, list):
        return 1 + max(map(nested_depth, obj), default=0)
    return 0


def random_value(rng: random.Random, budget: int) -> object:
    tricky = ['[', ']', '{', '}', '"', '\\', '\\"[', 'a]b', '\u00e9[', '']
    roll = rng.random()
    if budget <= 0 or roll < 0.3:
        return rng.choice([rng.choice(tricky) * rng.randint(0, 3), 1.5, -7, None, True])
    if roll < 0.65:
        return [random_value(rng, budget - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(tricky) + str(i): random_value(rng, budget - 1) for i in range(rng.randint(0, 3))}



def _deny(monkeypatch, name: str, target: Path) -> None:
    """``os.<name>`` raises EACCES when its first argument is ``target`` (root ignores permission bits, so
    the refusal is injected), and behaves as usual otherwise."""
    real = getattr(os, name)

    def denied(path, *args, **kwargs):
        if Path(path) == target:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, denied)

def test_json_depth_hand_cases():
    assert json_depth(b"7") == 0 and json_depth(b'"[[["') == 0
    assert json_depth(b"[]") == 1 and json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'["[[[", "\\"[[", "\\\\", []]') == 2  # brackets inside strings do not count
    assert json_depth(b"]]][[") == 0  # json.loads fails at the first "]" before nesting anything
    assert json_depth(b"[" * 200_000 + b"]" * 200_000) == 200_000
    # across the 1 MiB chunks of the scan: 2**20 - 1 opens, 2 closes, 3 opens -> peak 2**20 at the end
    assert json_depth(b"[" * (2**20 - 1) + b"]]" + b"[[[") == 2**20


@pytest.mark.parametrize("seed", range(3))
def test_json_depth_matches_the_nesting_of_random_documents(seed):
    rng = random.Random(seed)
    for _ in range(200):
        obj = random_value(rng, rng.randint(0, 6))
        for text in (json.dumps(obj), json.dumps(obj, ensure_ascii=False)):
            assert json_depth(text.encode()) == nested_depth(obj), text


def test_loads_json_refuses_deep_nesting_before_parsing():
    with pytest.raises(UnsafeFile, match="nested deeper than 32"):
        loads_json(b"[" * 200_000 + b"]" * 200_000)
    nested: list = []
    for _ in range(31):
        nested = [nested]  # 32 lists deep: the bound itself is accepted
    assert loads_json(b"[" * 32 + b"]" * 32) == nested
    with pytest.raises(ValueError, match="NaN"):
        loads_json(b'{"reward": NaN}')


@pytest.mark.timeout(20)
def test_read_regular_refuses_what_is_not_a_small_regular_file(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(dump(batch("outside")))
    assert read_regular(outside, 1000) == outside.read_bytes()
    os.mkfifo(tmp_path / "fifo")  # opening it for reading without a writer would block
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(outside)
    (tmp_path / "empty").write_bytes(b"")
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(2000)
    cases = {"fifo": "a FIFO", "dir": "a directory", "link": "a symlink", "empty": "out of range",
             "sparse": "out of range"}
    for name, why in cases.items():
        with pytest.raises(UnsafeFile, match=why):
            read_regular(tmp_path / name, 1000)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "gone", 1000)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_result_is_malformed(tmp_path):
    path = publish_lines(tmp_path, "result-locked.jsonl", dump(batch("locked")))
    path.chmod(0)
    with pytest.raises(MalformedResult, match="cannot be opened"):
        parse_result_file(path, L, N)


def test_a_file_that_cannot_be_opened_is_quarantined(tmp_path, monkeypatch):
    """EACCES, injected: root (as in CI containers) can open any mode, so chmod cannot make the case."""
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    locked = publish_lines(tmp_path, "result-locked.jsonl", dump(batch("locked")))
    publish_lines(tmp_path, "result-valid.jsonl", dump(batch("valid")))
    _deny(monkeypatch, "open", locked)
    summary = run_aggregator(tmp_path, L, N, iterations=1, **FAST)
    assert summary.committed == [1] and summary.quarantined == [locked.name]
    note = json.loads((tmp_path / "quarantine" / f"{locked.name}.reason.json").read_text())
    assert note["reason"] == "cannot be opened (Permission denied)"
    assert check_rl_dir(tmp_path, L, N).claimed_files == ["result-valid.jsonl"]


# ------------------------------------------------------------------------- poison in a run


def _socket(path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(path.parent)  # AF_UNIX paths are limited to ~108 bytes: bind a relative name
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        sock.close()
    finally:
        os.chdir(cwd)


def _write(data: bytes) -> Callable[[Path, Path], None]:
    return lambda path, outside: publish_lines(path.parent.parent, path.name, data)


def _sparse(path: Path, outside: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(MAX_RESULT_BYTES + 1)


def _directory(path: Path, outside: Path) -> None:
    path.mkdir()
    (path / "result-inner.jsonl").write_bytes(dump(batch("inner")))


def _huge_line(path: Path, outside: Path) -> None:
    recs = batch("huge")
    recs[0]["worker"] = "w" * (MAX_LINE_BYTES + 10)  # a valid record but for its length
    publish_lines(path.parent.parent, path.name, dump(recs))


NAN = [dict(r, reward=float("nan")) for r in batch("nan")]
# name -> (how to make it, a word its reason must contain)
POISON: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "deep": (_write(b"[" * 200_000 + b"]" * 200_000 + b"\n"), "nested deeper"),
    "deep-field": (_write(dump(batch("df")).replace(b'"reward": 1.0', b'"reward": ' + b"[" * 5000 + b"]" * 5000)),
                   "nested deeper"),
    "directory": (_directory, "a directory"),
    "fifo": (lambda path, outside: os.mkfifo(path), "a FIFO"),
    "socket": (lambda path, outside: _socket(path), "a socket"),
    "symlink": (lambda path, outside: path.symlink_to(outside), "a symlink"),
    "dangling": (lambda path, outside: path.symlink_to(outside.parent / "nowhere"), "a symlink"),
    "huge-line": (_huge_line, "longer than"),
    "sparse-17mib": (_sparse, "out of range"),
    "nan": (_write(dump(NAN)), "NaN"),
    "infinity": (_write(dump(batch("inf")).replace(b'"reward": 1.0', b'"reward": Infinity')), "Infinity"),
    "overflow": (_write(dump(batch("ovf")).replace(b'"reward": 1.0', b'"reward": 1e999')), "finite"),
    "huge-int": (_write(dump(batch("hi")).replace(b'"reward": 1.0', b'"reward": 1' + b"0" * 400)), "finite"),
    "string-schedule": (_write(dump([dict(r, schedule="6,3,3") for r in batch("ss")])), "schedule"),
    "float-iteration": (_write(dump([dict(r, policy_iteration=0.0) for r in batch("fi")])), "policy_iteration"),
    "int-id": (_write(dump([dict(r, result_id=7) for r in batch("ii")])), "result_id"),
    "not-utf8": (_write(b"\xff\xfe\x00{\n"), "UTF-8"),
    "empty": (_write(b""), "out of range"),
}


def _plant(root: Path, outside: Path, kinds: list[str]) -> dict[str, str]:
    """Poison entries of ``kinds`` in ``root/inbox``; returns name -> expected reason word."""
    out = {}
    for kind in kinds:
        make, why = POISON[kind]
        name = f"result-poison-{kind}.jsonl"
        make(root / "inbox" / name, outside)
        out[name] = why
    return out


def _valid(root: Path, count: int) -> set[str]:
    ids = set()
    for i in range(count):
        recs = batch(f"valid-{i}")
        publish_lines(root, f"result-valid-{i}.jsonl", recs)
        ids.update(r["result_id"] for r in recs)
    return ids


@pytest.mark.timeout(60)
def test_every_poison_is_quarantined_with_its_reason_and_valid_results_count_once(tmp_path):
    root, outside = tmp_path / "rl", tmp_path / "outside" / "result-victim.jsonl"
    outside.parent.mkdir()
    outside.write_bytes(dump(batch("victim")))  # valid content: only following the link would count it
    victim_before = (outside.read_bytes(), outside.stat().st_mtime_ns)
    run_aggregator(root, L, N, iterations=0, **FAST)
    valid_ids = _valid(root, 3)
    poison = _plant(root, outside, sorted(POISON))
    seen = []
    summary = run_aggregator(root, L, N, iterations=1, on_iteration=seen.append, **FAST)
    assert summary.committed == [1]
    facts = check_rl_dir(root, L, N)
    assert sorted(facts.counted) == sorted(valid_ids)  # each valid result exactly once
    assert sorted(facts.quarantined) == sorted(poison) and facts.inbox == []
    for name, why in poison.items():
        note = json.loads((root / "quarantine" / f"{name}.reason.json").read_text())
        assert why in note["reason"] and note["moved"] is True and note["origin"] == "inbox", (name, note)
    assert (root / "quarantine" / "result-poison-directory.jsonl" / "result-inner.jsonl").is_file()
    assert os.readlink(root / "quarantine" / "result-poison-symlink.jsonl") == str(outside)
    assert (outside.read_bytes(), outside.stat().st_mtime_ns) == victim_before
    hist = json.loads((root / "history" / "1.json").read_text())
    assert sorted(hist["quarantined"]) == sorted(poison) == sorted(summary.quarantined)
    assert seen[0].metrics()["num_quarantined"] == len(poison)


def test_names_too_long_or_not_utf8_are_quarantined_under_names_that_fit(tmp_path, caplog):
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    long_name = "result-" + "x" * 240 + ".jsonl"  # 253 bytes: its reason file would pass NAME_MAX
    odd_name = os.fsdecode(b"result-\xff\xfe.jsonl")
    for name in (long_name, odd_name):
        (tmp_path / "inbox" / name).write_bytes(b"junk\n")
    publish_lines(tmp_path, "result-valid.jsonl", dump(batch("valid")))
    summary = run_aggregator(tmp_path, L, N, iterations=1, **FAST)
    assert summary.committed == [1] and len(summary.quarantined) == 2
    facts = check_rl_dir(tmp_path, L, N)
    assert odd_name in facts.quarantined and facts.inbox == []
    short = next(q for q in facts.quarantined if q != odd_name)
    assert len(short.encode()) <= 180 and (tmp_path / "quarantine" / short).read_bytes() == b"junk\n"
    assert json.loads((tmp_path / "quarantine" / f"{short}.reason.json").read_text())["file"] == long_name
    logged = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(logged) == 2 and all(m.encode("utf-8") for m in logged)  # a non-UTF-8 name is logged escaped
    assert any("\\udcff\\udcfe" in m for m in logged)


def test_the_aggregator_command_survives_the_poison_that_crash_looped_it(tmp_path):
    """A deeply nested line and a directory named result-*.jsonl: the command exits 0, not 1."""
    root = tmp_path / "rl"
    run_aggregator(root, L, N, iterations=0, **FAST)
    _valid(root, 1)
    poison = _plant(root, tmp_path, ["deep", "directory"])
    cmd = harness.command("aggregator", "--dir", str(root), "--layers", str(L), "--budget", str(N),
                          "--iterations", "1", "--poll-s", "0.02")
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=python_path(REPO)), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(proc.stdout.splitlines()[-1])["quarantined"]) == sorted(poison)
    assert check_rl_dir(root, L, N).iterations == 1


def test_an_entry_that_cannot_be_moved_is_skipped_not_retried(tmp_path, monkeypatch):
    """A refused entry whose rename fails (e.g. a directory owned by someone else, without write
    permission) keeps a reason file saying so and is judged once, not at every poll."""
    root = tmp_path / "rl"
    run_aggregator(root, L, N, iterations=0, **FAST)
    poison = _plant(root, tmp_path, ["directory"])
    stuck = root / "inbox" / next(iter(poison))
    _deny(monkeypatch, "replace", stuck)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    summary = run_aggregator(root, L, N, iterations=1, stop_event=stop, **FAST)  # ~50 polls
    assert summary.quarantined == [stuck.name] and summary.stopped_because == "stop_event"
    note = json.loads((root / "quarantine" / f"{stuck.name}.reason.json").read_text())
    assert note["moved"] is False and "Permission denied" in note["error"] and "a directory" in note["reason"]
    assert stuck.is_dir()
    _valid(root, 2)  # the run goes on around it
    summary = run_aggregator(root, L, N, iterations=1, **FAST)
    assert summary.committed == [1] and summary.quarantined == [stuck.name] and stuck.is_dir()
    shutil.rmtree(stuck)  # check_rl_dir reads every inbox entry as a file
    assert len(check_rl_dir(root, L, N).counted) == 4


def test_nan_never_enters_theta_even_when_the_update_overflows(tmp_path):
    # theta0 = 0, Np = [4,4,4]: s1=[12,0,0] r=1, s2=[0,0,12] r=0 -> b=.5, g=[3,0,-3]; lr=1e308 -> inf
    run_aggregator(tmp_path, L, N, iterations=0, **FAST)
    publish_lines(tmp_path, "result-a.jsonl", result_lines(0, [[12, 0, 0], [0, 0, 12]], [1.0, 0.0], tag="a", budget=N))
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    summary = run_aggregator(tmp_path, L, N, iterations=1, lr=1e308, stop_event=stop, **FAST)
    assert summary.iteration == 0 and summary.quarantined == ["result-a.jsonl"]
    note = json.loads((tmp_path / "quarantine" / "result-a.jsonl.reason.json").read_text())
    assert "not finite" in note["reason"]
    assert sorted(os.listdir(tmp_path / "policy")) == ["policy-0.json"]
    assert json.loads((tmp_path / "policy" / "policy-0.json").read_text())["theta"] == [0.0, 0.0, 0.0]


# -------------------------------------------------------------------------------- fuzz mix

# values that are wrong for a field whatever the rest of the record says
_ANY_BAD = ["null", "true", "[]", "{}", "NaN", "-Infinity", "1e999", "[" * 40 + "]" * 40,
            "[" * 100_000 + "]" * 100_000, "1" * 5000]
_FIELD_BAD = {
    "result_id": ["7", '""', '"' + "a" * 129 + '"'],
    "batch_id": ["7", '""'],
    "policy_iteration": ["-1", "0.0", '"0"', "1"],  # 1: newer than the newest policy (0)
    "schedule": ["[4, 4]", "[4, 4, 5]", "[11, 0, true]", "[4.0, 4, 4]", '"[4, 4, 4]"', "[13, 0, -1]"],
    "reward": ["-0.01", "1.0000001", '"0.5"', "[0.5]", "Infinity", "1" + "0" * 400],
    "batch_size": ["0", "-1", "3", "2.0", '"2"'],
    "index": ['"0"', "0.0", "5", "-1"],
}


def fuzz_poison(rng: random.Random, tag: str) -> bytes:
    """One result file that is invalid by construction, from a fresh valid batch (ids unique to ``tag``)."""
    recs = batch(tag)
    data = dump(recs)
    kind = rng.choices(["bytes", "truncate", "field", "structure", "flip"], weights=[1, 1, 4, 2, 1])[0]
    if kind == "bytes":  # a first byte >= 0x80 can start neither UTF-8 JSON nor whitespace
        return bytes([rng.randrange(0x80, 0x100)]) + rng.randbytes(rng.randrange(0, 3000)) + b"\n"
    if kind == "truncate":  # no final newline, or one record of a batch of two
        return data[:rng.randrange(len(data))]
    if kind == "flip":  # 0xff and 0xc0 never occur in UTF-8
        pos = rng.randrange(len(data))
        return data[:pos] + bytes([rng.choice([0xFF, 0xC0])]) + data[pos + 1:]
    if kind == "field":
        e, field = rng.randrange(len(recs)), rng.choice(sorted(_FIELD_BAD))
        recs[e][field] = "@@BAD@@"
        bad = rng.choice(_FIELD_BAD[field] + _ANY_BAD)
        return dump(recs).replace(b'"@@BAD@@"', bad.encode())
    lines = data.splitlines(keepends=True)
    return rng.choice([
        lines[0] + lines[0] + lines[1],  # a result id twice
        lines[1],  # a record missing
        b"\n" + data,  # an empty line
        data + json.dumps(dict(recs[0], index=2, result_id=tag + "x")).encode() + b"\n",  # 3 records, batch_size 2
        b"[1, 2]\n",
    ])


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzzed_poison_beside_valid_results(tmp_path, seed):
    rng = random.Random(seed)
    root = tmp_path / "rl"
    run_aggregator(root, L, N, iterations=0, **FAST)
    valid_ids = _valid(root, 4)
    fuzz = {f"result-fuzz-{i:03d}.jsonl": fuzz_poison(rng, f"fuzz-{seed}-{i}") for i in range(60)}
    for name, data in fuzz.items():
        publish_lines(root, name, data)
    poison = _plant(root, tmp_path, rng.sample(sorted(POISON), 5))
    summary = run_aggregator(root, L, N, iterations=1, **FAST)
    assert summary.committed == [1]
    facts = check_rl_dir(root, L, N)
    assert sorted(facts.counted) == sorted(valid_ids)
    assert sorted(facts.quarantined) == sorted([*fuzz, *poison]) and facts.inbox == []
    reasons = [json.loads((root / "quarantine" / f"{q}.reason.json").read_text())["reason"] for q in facts.quarantined]
    assert all(reasons)
    assert np.all(np.isfinite(facts.thetas[1]))
