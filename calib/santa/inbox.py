"""The shared-directory protocol between SANTA workers and the aggregator (Lee et al., arXiv:2605.01910, App. L).

Layout under ``rl.dir`` (a local folder or a Kubernetes ReadWriteMany volume)::

    policy/policy-<i>.json        policy snapshots {"iteration", "theta", "num_layers", "budget", ...}
    inbox/result-<w>-<b>.jsonl    published worker batches, one JSON record per line (:class:`ResultRecord`)
    inbox/.result-...tmp-<u>      a worker's batch being written (hidden; never read)
    claimed/<i>/manifest.json     the files update <i> consumed, written before they are moved here
    claimed/<i>/result-...jsonl   those files
    history/<i>.json              update <i>: baseline, gradient, result_ids, theta before/after
    quarantine/<name>             refused inbox entries, each beside <name>.reason.json
    aggregator.lease              who runs the aggregator (see :mod:`calib.santa.lease`)
    done.json                     written when the aggregator reached its iteration target

Every file a reader may see is published atomically (hidden temp + fsync + rename, :mod:`calib.santa.volume`);
hidden temp files older than a configured age belong to a dead writer and are swept. Anyone who can write
the volume can drop anything into ``inbox/``: entries are read without blocking or following links, with
sizes and JSON nesting bounded before parsing (:func:`parse_result_file`), and names from listings and
manifests are plain file names (:func:`is_result_name`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from calib.santa.volume import (
    UnsafeFile,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    is_temp_name,
    loads_json,
    read_json,
    read_regular,
)

POLICY_RE = re.compile(r"^policy-(\d+)\.json$")
RESULT_SUFFIX = ".jsonl"
REASON_SUFFIX = ".reason.json"
MAX_RESULT_BYTES = 16 * 1024 * 1024  # a result file is a few KiB; anything this large is garbage
MAX_LINE_BYTES = 1024 * 1024  # one record is well under a KiB per hundred layers
MAX_NAME_BYTES = 180  # a quarantined name plus REASON_SUFFIX and a temp suffix stays within NAME_MAX (255)
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
    """One episode: the schedule a worker drew from policy ``policy_iteration`` and its reward.

    One line of a result file::

        {"result_id": "<32 hex>", "batch_id": "<32 hex>", "batch_size": E, "index": e,
         "worker": "<id>", "policy_iteration": i, "num_layers": L, "budget": N,
         "schedule": [s_1, ..., s_L], "reward": r, "created": <unix time>}

    ``batch_size``/``index`` make a file cut short at a line boundary detectable: a file is valid only if
    it holds exactly ``batch_size`` records with indices ``0..E-1`` of one ``batch_id``.
    """

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

    Checks: a regular file of at most ``MAX_RESULT_BYTES`` (:func:`~calib.santa.volume.read_regular`:
    no FIFO, link or directory is ever opened for reading), UTF-8, newline-terminated, every line at
    most ``MAX_LINE_BYTES`` long, nested at most ``MAX_JSON_DEPTH`` deep (checked before parsing)
    and a JSON object (NaN/Infinity rejected), the fields of each record (schedule of ``num_layers``
    non-negative ints summing to ``budget``, reward a number in [0, 1], ``policy_iteration`` an int
    >= 0), unique ``result_id`` within the file, and the batch is complete (one ``batch_id``,
    ``batch_size`` records, indices ``0..batch_size-1``). A vanished file raises ``FileNotFoundError``.
    """
    try:
        raw = read_regular(path, MAX_RESULT_BYTES)
    except UnsafeFile as exc:
        raise MalformedResult(str(exc)) from None
    if not raw.endswith(b"\n"):
        raise MalformedResult("file does not end with a newline (truncated)")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedResult("file is not UTF-8") from None
    records = [_parse_record(line, n + 1, num_layers, budget) for n, line in enumerate(raw.split(b"\n")[:-1])]
    ids = {r.result_id for r in records}
    if len(ids) != len(records):
        raise MalformedResult("duplicate result_id inside the file")
    batch_ids = {r.batch_id for r in records}
    sizes = {r.batch_size for r in records}
    if len(batch_ids) != 1 or sizes != {len(records)} or sorted(r.index for r in records) != list(range(len(records))):
        raise MalformedResult(f"incomplete batch: {len(records)} records, batch_size {sorted(sizes)}")
    return sorted(records, key=lambda r: r.index)


def _load_line(line: bytes, lineno: int) -> Any:
    if len(line) > MAX_LINE_BYTES:
        raise MalformedResult(f"line {lineno}: {len(line)} bytes is longer than {MAX_LINE_BYTES}")
    try:
        return loads_json(line)
    except ValueError as exc:  # nested too deep, not JSON, NaN/Infinity, an integer too long to parse
        raise MalformedResult(f"line {lineno}: not valid JSON ({exc})") from None


def _parse_record(line: bytes, lineno: int, num_layers: int, budget: int) -> ResultRecord:
    obj = _load_line(line, lineno)
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
    # a comparison, not math.isfinite: NaN fails it, and a huge integer compares without overflowing
    if not _is_number(reward) or not 0.0 <= reward <= 1.0:
        raise MalformedResult(f"line {lineno}: reward must be a finite number in [0, 1] (got {repr(reward)[:40]})")
    if not isinstance(bid, str) or not bid or not _is_int(bsize) or bsize < 1 or not _is_int(index):
        raise MalformedResult(f"line {lineno}: batch_id, batch_size and index are required")
    created, worker = obj.get("created"), obj.get("worker")
    created = float(created) if _is_number(created) and -1e18 < created < 1e18 else 0.0  # no float overflow
    return ResultRecord(result_id=rid, policy_iteration=int(it), schedule=tuple(int(x) for x in sched),
                        reward=float(reward), batch_id=bid, batch_size=int(bsize), index=int(index),
                        worker=worker if isinstance(worker, str) else "", budget=int(budget),
                        created=created)


def is_result_name(name: Any) -> bool:
    """A published result's name: a plain file name (no path separator, not hidden) ending ``.jsonl``.

    Every name that the aggregator reads from a listing or a claim manifest passes this test, so a
    name can never point outside the folder it is joined to (``..``, absolute paths, ``a/b``).
    """
    return (isinstance(name, str) and name.endswith(RESULT_SUFFIX) and not name.startswith(".")
            and not any(c in name for c in ("/", "\\", "\0")))


def list_results(directory: Path) -> list[str]:
    """Published result names in ``directory`` (hidden temp files excluded), sorted; entries of any type."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if is_result_name(n))


def regular_results(directory: Path) -> list[str]:
    """The result names in ``directory`` that are regular files (not links, FIFOs or directories)."""
    out = []
    for name in list_results(directory):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(directory / name).st_mode):
                out.append(name)
    return out


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
    """Move the entry ``path`` (of any type) into ``quarantine/`` beside ``<name>.reason.json``.

    One rename, so a directory, FIFO or socket moves like a file and a symlink is moved, never
    followed. The reason is written first, then the entry is renamed, so a crash in between leaves
    the entry where it was (it is judged again) and, at worst, a reason file that is rewritten. If
    the rename fails the reason file says ``"moved": false`` and the ``OSError`` propagates; a
    vanished entry raises ``FileNotFoundError`` and leaves no reason file.
    """
    layout.quarantine.mkdir(parents=True, exist_ok=True)
    target = layout.quarantine / _quarantine_name(layout.quarantine, path.name)
    note = {"file": path.name, "origin": origin, "reason": reason, "moved": True, "time": time.time()}
    reason_file = target.with_name(target.name + REASON_SUFFIX)
    atomic_write_json(reason_file, note)
    try:
        os.replace(path, target)
    except FileNotFoundError:
        reason_file.unlink(missing_ok=True)
        raise
    except OSError as exc:
        atomic_write_json(reason_file, dict(note, moved=False, error=str(exc)))
        raise
    fsync_dir(layout.quarantine)
    return target


def _quarantine_name(folder: Path, name: str) -> str:
    if len(os.fsencode(name)) > MAX_NAME_BYTES:  # room for the reason file's and temp files' suffixes
        name = f"long-{hashlib.sha256(os.fsencode(name)).hexdigest()[:32]}{RESULT_SUFFIX}"
    if os.path.lexists(folder / name):  # the same name twice (a replayed garbage file): keep both
        name = f"{Path(name).stem}-{uuid.uuid4().hex[:8]}{Path(name).suffix}"
    return name


def write_manifest(layout: Layout, iteration: int, files: list[str]) -> None:
    """The claim manifest of ``iteration``: written (atomically) BEFORE any file is moved."""
    layout.claim_dir(iteration).mkdir(parents=True, exist_ok=True)
    atomic_write_json(layout.manifest_file(iteration),
                      {"iteration": iteration, "files": sorted(files), "time": time.time()})


def read_manifest(layout: Layout, iteration: int) -> list[str] | None:
    """The files claimed by ``iteration``, or None when there is no trustworthy manifest.

    The manifest is refused (None) unless it parses, names its own iteration, and lists only plain
    result names (:func:`is_result_name`: no separator, ``..`` or absolute path) each of which,
    where it exists in ``claimed/<iteration>/`` or ``inbox/``, is a regular file and not a link.
    The caller then recovers from the claim folder itself (:func:`regular_results`).
    """
    try:
        obj = read_json(layout.manifest_file(iteration))
    except (OSError, ValueError):  # missing, unreadable, not JSON, or too deep to parse
        return None
    if not isinstance(obj, dict) or obj.get("iteration") != iteration:
        return None
    files = obj.get("files")
    if not isinstance(files, list) or not all(is_result_name(f) for f in files):
        return None
    for name in files:
        for folder in (layout.claim_dir(iteration), layout.inbox):
            try:
                if not stat.S_ISREG(os.lstat(folder / name).st_mode):
                    return None
            except FileNotFoundError:
                continue
    return files


def move_claimed(layout: Layout, iteration: int, files: list[str], after_each=None) -> list[str]:
    """Rename the manifest's files from ``inbox/`` into ``claimed/<iteration>/`` (idempotent).

    Returns the names that could not be moved (an error other than "already moved"); they stay in
    ``inbox/``. ``after_each(i)`` is called after the i-th rename (the aggregator's fault points).
    """
    dest = layout.claim_dir(iteration)
    unmoved = []
    for i, name in enumerate(files):
        try:
            os.replace(layout.inbox / name, dest / name)
        except FileNotFoundError:  # already moved before a crash
            pass
        except OSError:
            unmoved.append(name)
        if after_each is not None:
            after_each(i)
    fsync_dir(dest)
    fsync_dir(layout.inbox)
    return unmoved


def sweep_temp_files(layout: Layout, max_age_s: float, now: float | None = None) -> list[Path]:
    """Delete hidden temp files older than ``max_age_s`` (left by killed writers); returns them."""
    now = time.time() if now is None else now
    folders = [layout.root, layout.inbox, layout.policy, layout.history, layout.quarantine]
    with contextlib.suppress(FileNotFoundError):
        folders += [p for p in layout.claimed.iterdir() if p.is_dir() and not p.is_symlink()]
    swept = []
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for e in entries:
            if not is_temp_name(e.name):
                continue
            try:  # a directory with a temp name is no writer's file: left alone
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode) and now - st.st_mtime > max_age_s:
                    os.unlink(e.path)
                    swept.append(Path(e.path))
            except OSError:  # vanished meanwhile, or not ours to delete: tried again next sweep
                continue
    return swept
