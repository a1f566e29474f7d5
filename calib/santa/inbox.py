"""The shared-directory protocol between SANTA workers and the aggregator (SPEC §5.4, santa.txt App. L).

Layout under ``rl.dir`` (a local folder or a Kubernetes ReadWriteMany volume)::

    policy/policy-<i>.json        policy snapshots {"iteration", "theta", "num_layers", "budget", ...}
    inbox/result-<w>-<b>.jsonl    published worker batches, one JSON record per line
    inbox/.result-...tmp-<u>      a worker's batch being written (hidden; never read)
    claimed/<i>/manifest.json     the files update <i> consumed, written before they are moved here
    claimed/<i>/result-...jsonl   those files
    history/<i>.json              update <i>: baseline, gradient, result_ids, theta before/after
    quarantine/<name>             malformed files, each beside <name>.reason.json
    aggregator.lease              who runs the aggregator (see :mod:`calib.santa.lease`)
    done.json                     written when the aggregator reached its iteration target

Every file that a reader may see is written to a hidden temp name in the same folder, flushed,
fsync'ed and then renamed (or hard-linked, for the policy commit) onto its final name, and the folder
is fsync'ed; so a reader sees either nothing or the whole file. Hidden temp names start with ``.``
and contain ``.tmp-``; those older than a configured age belong to a dead writer and are swept.

A result record (one line of a result file)::

    {"result_id": "<32 hex>", "batch_id": "<32 hex>", "batch_size": E, "index": e,
     "worker": "<id>", "policy_iteration": i, "num_layers": L, "budget": N,
     "schedule": [s_1, ..., s_L], "reward": r, "created": <unix time>}

``batch_size``/``index`` make a file cut short at a line boundary detectable: a file is valid only if
it holds exactly ``batch_size`` records with indices ``0..E-1`` of one ``batch_id``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

POLICY_RE = re.compile(r"^policy-(\d+)\.json$")
RESULT_SUFFIX = ".jsonl"
TEMP_MARK = ".tmp-"
MAX_RESULT_BYTES = 16 * 1024 * 1024  # a result file is a few KiB; anything this large is garbage
LEASE_NAME = "aggregator.lease"
DONE_NAME = "done.json"


# ----------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Paths of the shared directory ``root`` (see the module docstring)."""

    root: Path

    @property
    def policy(self) -> Path:
        return self.root / "policy"

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def claimed(self) -> Path:
        return self.root / "claimed"

    @property
    def history(self) -> Path:
        return self.root / "history"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def lease(self) -> Path:
        return self.root / LEASE_NAME

    @property
    def done(self) -> Path:
        return self.root / DONE_NAME

    def policy_file(self, iteration: int) -> Path:
        return self.policy / f"policy-{iteration}.json"

    def claim_dir(self, iteration: int) -> Path:
        return self.claimed / str(iteration)

    def manifest_file(self, iteration: int) -> Path:
        return self.claim_dir(iteration) / "manifest.json"

    def history_file(self, iteration: int) -> Path:
        return self.history / f"{iteration}.json"

    def ensure(self) -> "Layout":
        for d in (self.policy, self.inbox, self.claimed, self.history, self.quarantine):
            d.mkdir(parents=True, exist_ok=True)
        return self


def is_temp_name(name: str) -> bool:
    """Hidden temp files (``.<final>.tmp-<unique>``): in progress, or left by a dead writer."""
    return name.startswith(".") and TEMP_MARK in name


# ----------------------------------------------------------------------------- atomic files


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename/link in it is durable (a no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(final: Path) -> Path:
    return final.parent / f".{final.name}{TEMP_MARK}{uuid.uuid4().hex}"


def write_temp(final: Path, data: bytes, line_delay_s: float = 0.0) -> Path:
    """Write ``data`` to a fresh hidden temp file beside ``final``, fsync it and return its path.

    ``line_delay_s`` pauses after each line (tests widen the window in which a writer can be killed).
    """
    tmp = temp_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if line_delay_s > 0:
            for line in data.splitlines(keepends=True):
                os.write(fd, line)
                time.sleep(line_delay_s)
        else:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def atomic_write_bytes(final: Path, data: bytes, *, line_delay_s: float = 0.0) -> None:
    """temp + fsync + rename (+ fsync of the folder): readers see all of ``data`` or no file."""
    tmp = write_temp(final, data, line_delay_s)
    try:
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(final.parent)


def atomic_write_json(final: Path, obj: Any) -> None:
    atomic_write_bytes(final, (json.dumps(obj, sort_keys=True, allow_nan=False) + "\n").encode())


def exclusive_publish_json(final: Path, obj: Any) -> bool:
    """Publish ``final`` atomically only if it does not exist yet; False if it already does.

    Uses ``link(tmp, final)``, which fails with EEXIST atomically (also on NFS), so two writers can
    never both publish the same name. On a filesystem without hard links it falls back to
    exists-check + rename (not exclusive against a concurrent writer; the lease covers that case).
    """
    tmp = write_temp(final, (json.dumps(obj, sort_keys=True, allow_nan=False) + "\n").encode())
    try:
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            if final.exists():
                return False
            os.replace(tmp, final)
        fsync_dir(final.parent)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_json(path: Path) -> Any:
    """Parse a JSON file strictly: NaN/Infinity literals are rejected."""
    return json.loads(path.read_bytes(), parse_constant=_reject_constant)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name}")


# ---------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class PolicySnapshot:
    """``policy/policy-<iteration>.json``: the logits after ``iteration`` updates (0 = initial)."""

    iteration: int
    theta: np.ndarray  # [L] float64
    budget: int
    lr: float | None = None  # the step size of the update that produced it (None for policy-0)

    @property
    def num_layers(self) -> int:
        return int(self.theta.shape[0])

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "theta": [float(x) for x in self.theta],
                "num_layers": self.num_layers, "budget": self.budget, "lr": self.lr, "created": time.time()}

    @classmethod
    def from_json(cls, obj: Any) -> "PolicySnapshot":
        if not isinstance(obj, dict):
            raise ValueError("policy snapshot is not a JSON object")
        it, theta, budget = obj.get("iteration"), obj.get("theta"), obj.get("budget")
        if not _is_int(it) or it < 0 or not _is_int(budget) or budget < 1:
            raise ValueError("policy snapshot needs an integer iteration >= 0 and budget >= 1")
        if not isinstance(theta, list) or not theta or not all(_is_number(x) for x in theta):
            raise ValueError("policy snapshot theta must be a non-empty list of numbers")
        arr = np.asarray(theta, dtype=np.float64)
        if not np.all(np.isfinite(arr)):
            raise ValueError("policy snapshot theta is not finite")
        lr = obj.get("lr")
        return cls(iteration=int(it), theta=arr, budget=int(budget), lr=float(lr) if _is_number(lr) else None)


def policy_iterations(layout: Layout) -> list[int]:
    """Iterations of the published snapshots, ascending (temp files are never listed)."""
    try:
        names = os.listdir(layout.policy)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(POLICY_RE.match, names) if m)


def read_policy(layout: Layout, iteration: int) -> PolicySnapshot:
    snap = PolicySnapshot.from_json(read_json(layout.policy_file(iteration)))
    if snap.iteration != iteration:
        raise ValueError(f"{layout.policy_file(iteration)} says iteration {snap.iteration}")
    return snap


def read_newest_policy(layout: Layout) -> PolicySnapshot | None:
    """The newest snapshot that parses (no locks: snapshots appear atomically); None if none yet."""
    for it in reversed(policy_iterations(layout)):
        try:
            return read_policy(layout, it)
        except (OSError, ValueError):
            continue
    return None


# --------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ResultRecord:
    """One episode: the schedule a worker drew from policy ``policy_iteration`` and its reward."""

    result_id: str
    policy_iteration: int
    schedule: tuple[int, ...]
    reward: float
    batch_id: str = ""
    batch_size: int = 1
    index: int = 0
    worker: str = ""
    budget: int = 0
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"result_id": self.result_id, "batch_id": self.batch_id, "batch_size": self.batch_size,
                "index": self.index, "worker": self.worker, "policy_iteration": self.policy_iteration,
                "num_layers": len(self.schedule), "budget": self.budget,
                "schedule": list(self.schedule), "reward": self.reward, "created": self.created}


class MalformedResult(ValueError):
    """A result file that must be quarantined; the message says why."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_result_file(path: Path, num_layers: int, budget: int) -> list[ResultRecord]:
    """Read and validate one published result file; raise :class:`MalformedResult` with the reason.

    Checks: size, UTF-8, newline-terminated, every line a JSON object (NaN/Infinity rejected), the
    fields of each record (schedule of ``num_layers`` non-negative ints summing to ``budget``, reward
    finite in [0, 1], ``policy_iteration`` an int >= 0), unique ``result_id`` within the file, and
    the batch is complete (one ``batch_id``, ``batch_size`` records, indices ``0..batch_size-1``).
    """
    size = path.stat().st_size
    if size == 0 or size > MAX_RESULT_BYTES:
        raise MalformedResult(f"file size {size} bytes is out of range")
    raw = path.read_bytes()
    if not raw.endswith(b"\n"):
        raise MalformedResult("file does not end with a newline (truncated)")
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise MalformedResult("file is not UTF-8") from None
    records = [_parse_record(line, n + 1, num_layers, budget) for n, line in enumerate(lines)]
    ids = {r.result_id for r in records}
    if len(ids) != len(records):
        raise MalformedResult("duplicate result_id inside the file")
    batch_ids = {r.batch_id for r in records}
    sizes = {r.batch_size for r in records}
    if len(batch_ids) != 1 or sizes != {len(records)} or sorted(r.index for r in records) != list(range(len(records))):
        raise MalformedResult(f"incomplete batch: {len(records)} records, batch_size {sorted(sizes)}")
    return sorted(records, key=lambda r: r.index)


def _parse_record(line: str, lineno: int, num_layers: int, budget: int) -> ResultRecord:
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except ValueError as exc:
        raise MalformedResult(f"line {lineno}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise MalformedResult(f"line {lineno}: not a JSON object")
    rid, it, sched, reward = obj.get("result_id"), obj.get("policy_iteration"), obj.get("schedule"), obj.get("reward")
    bid, bsize, index = obj.get("batch_id"), obj.get("batch_size"), obj.get("index")
    if not isinstance(rid, str) or not rid or len(rid) > 128:
        raise MalformedResult(f"line {lineno}: result_id must be a non-empty string")
    if not _is_int(it) or it < 0:
        raise MalformedResult(f"line {lineno}: policy_iteration must be an integer >= 0")
    if not isinstance(sched, list) or len(sched) != num_layers:
        n = len(sched) if isinstance(sched, list) else type(sched).__name__
        raise MalformedResult(f"line {lineno}: schedule must list {num_layers} layers (got {n})")
    if not all(_is_int(x) and x >= 0 for x in sched) or sum(sched) != budget:
        raise MalformedResult(f"line {lineno}: schedule must be non-negative integers summing to {budget}")
    if not _is_number(reward) or not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        raise MalformedResult(f"line {lineno}: reward must be a finite number in [0, 1] (got {reward!r})")
    if not isinstance(bid, str) or not bid or not _is_int(bsize) or bsize < 1 or not _is_int(index):
        raise MalformedResult(f"line {lineno}: batch_id, batch_size and index are required")
    created = obj.get("created", 0.0)
    return ResultRecord(result_id=rid, policy_iteration=int(it), schedule=tuple(int(x) for x in sched),
                        reward=float(reward), batch_id=bid, batch_size=int(bsize), index=int(index),
                        worker=str(obj.get("worker", "")), budget=int(budget),
                        created=float(created) if _is_number(created) else 0.0)


def list_results(directory: Path) -> list[str]:
    """Published result files in ``directory`` (hidden temp files excluded), sorted by name."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.endswith(RESULT_SUFFIX) and not n.startswith("."))


class InboxWriter:
    """Publishes a worker's batch as one result file: hidden temp, fsync, rename into ``inbox/``.

    A writer killed at any instant leaves at most a hidden temp file (swept later); a published
    file is always complete.
    """

    def __init__(self, root: Path | str, worker_id: str | None = None, *, line_delay_s: float = 0.0):
        self.layout = Layout(Path(root))
        self.layout.inbox.mkdir(parents=True, exist_ok=True)
        self.worker_id = worker_id or default_worker_id()
        self.line_delay_s = line_delay_s

    def publish(self, records: Iterable[ResultRecord]) -> Path:
        recs = list(records)
        if not recs:
            raise ValueError("a result file needs at least one record")
        batch_id = recs[0].batch_id
        name = f"result-{_safe(self.worker_id)}-{batch_id}{RESULT_SUFFIX}"
        data = "".join(json.dumps(r.to_json(), sort_keys=True, allow_nan=False) + "\n" for r in recs).encode()
        final = self.layout.inbox / name
        atomic_write_bytes(final, data, line_delay_s=self.line_delay_s)
        return final


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def make_batch(worker: str, policy_iteration: int, budget: int,
               episodes: list[tuple[np.ndarray, float]]) -> list[ResultRecord]:
    """Records for one worker batch: ``episodes`` is a list of (schedule [L], reward)."""
    batch_id = uuid.uuid4().hex
    now = time.time()
    return [ResultRecord(result_id=uuid.uuid4().hex, policy_iteration=policy_iteration,
                         schedule=tuple(int(x) for x in s), reward=float(r), batch_id=batch_id,
                         batch_size=len(episodes), index=e, worker=worker, budget=budget, created=now)
            for e, (s, r) in enumerate(episodes)]


# ------------------------------------------------------------------ quarantine, claim, sweep


def quarantine(layout: Layout, path: Path, reason: str, *, origin: str) -> Path:
    """Move a malformed file to ``quarantine/`` beside a ``<name>.reason.json``.

    The reason is written first, then the file is renamed, so a crash in between leaves the file
    where it was (it is judged again) and, at worst, a reason file that is rewritten.
    """
    layout.quarantine.mkdir(parents=True, exist_ok=True)
    target = layout.quarantine / path.name
    if target.exists():  # the same name twice (a replayed garbage file): keep both
        target = layout.quarantine / f"{path.stem}-{uuid.uuid4().hex[:8]}{path.suffix}"
    atomic_write_json(target.with_name(target.name + ".reason.json"),
                      {"file": path.name, "origin": origin, "reason": reason, "time": time.time()})
    os.replace(path, target)
    fsync_dir(layout.quarantine)
    return target


def write_manifest(layout: Layout, iteration: int, files: list[str]) -> None:
    """The claim manifest of ``iteration``: written (atomically) BEFORE any file is moved."""
    layout.claim_dir(iteration).mkdir(parents=True, exist_ok=True)
    atomic_write_json(layout.manifest_file(iteration),
                      {"iteration": iteration, "files": sorted(files), "time": time.time()})


def read_manifest(layout: Layout, iteration: int) -> list[str] | None:
    """The files claimed by ``iteration``, or None when there is no (readable) manifest."""
    try:
        obj = read_json(layout.manifest_file(iteration))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(obj, dict) or obj.get("iteration") != iteration:
        return None
    files = obj.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return files


def move_claimed(layout: Layout, iteration: int, files: list[str], after_each=None) -> None:
    """Rename the manifest's files from ``inbox/`` into ``claimed/<iteration>/`` (idempotent).

    ``after_each(i)`` is called after the i-th rename (the aggregator's fault points).
    """
    dest = layout.claim_dir(iteration)
    for i, name in enumerate(files):
        with contextlib.suppress(FileNotFoundError):  # already moved before a crash
            os.replace(layout.inbox / name, dest / name)
        if after_each is not None:
            after_each(i)
    fsync_dir(dest)
    fsync_dir(layout.inbox)


def sweep_temp_files(layout: Layout, max_age_s: float, now: float | None = None) -> list[Path]:
    """Delete hidden temp files older than ``max_age_s`` (left by killed writers); returns them."""
    now = time.time() if now is None else now
    folders = [layout.root, layout.inbox, layout.policy, layout.history, layout.quarantine]
    with contextlib.suppress(FileNotFoundError):
        folders += [p for p in layout.claimed.iterdir() if p.is_dir()]
    swept = []
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for e in entries:
            if not is_temp_name(e.name):
                continue
            try:
                if now - e.stat(follow_symlinks=False).st_mtime > max_age_s:
                    os.unlink(e.path)
                    swept.append(Path(e.path))
            except FileNotFoundError:
                continue
    return swept
