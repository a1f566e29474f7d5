"""The single-aggregator lease on a shared, possibly network, filesystem (no flock).

Only one aggregator may run. ``flock``/``fcntl`` locks are not reliable on network
filesystems (NFS clients may emulate them per host or not at all, and a lock held by a vanished pod
lingers until the server's lock recovery), so the lease is a plain file,
``<rl.dir>/aggregator.lease``, handled only with operations that are atomic on local filesystems
and NFSv3+ alike: ``O_CREAT | O_EXCL`` create, ``rename`` and ``link``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from calib.santa.volume import TEMP_MARK, UnsafeFile, atomic_write_bytes, fsync_dir, loads_json, read_regular

MAX_LEASE_BYTES = 64 * 1024  # a lease holds one small JSON object


class LeaseHeld(RuntimeError):
    """Another live aggregator holds the lease."""


class LeaseLost(RuntimeError):
    """This aggregator's lease was taken over (it was presumed dead); it must stop at once."""


@dataclass
class Lease:
    """Single-aggregator lease on a shared (possibly network) filesystem; no flock.

    * Acquire: ``open(O_CREAT | O_EXCL)`` of ``aggregator.lease`` holding ``{owner, pid, host,
      beat}``; O_EXCL creation is atomic on local filesystems and NFSv3+ alike, unlike ``flock``,
      which NFS clients may emulate per host or not at all.
    * Heartbeat: a daemon thread rewrites the file (temp + rename) every ``ttl_s / 4`` with an
      incremented ``beat``, after checking the file still names this owner.
    * Staleness is judged on the observer's own monotonic clock, so clock skew between hosts does
      not matter: a lease whose content did not change for ``ttl_s`` seconds of observation is stale.
      A lease written by a dead pid on this very host (or by our own pid under an owner id this
      process does not hold: a previous life of a restarted container) is stale at once.
    * Takeover: the contender that creates (O_EXCL) a marker named by the stale content's hash
      deletes the lease if it still holds that content; then all compete for the O_EXCL create.
    * The owner calls :meth:`check` right before each claim and commit; a lease taken over raises
      :class:`LeaseLost`. The policy commit itself is exclusive (``link``), so even two aggregators
      that both believe they hold the lease cannot commit the same iteration twice.
    """

    path: Path
    ttl_s: float = 30.0
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    _beat: int = 0
    _lost: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _content(self) -> bytes:
        return json.dumps({"owner": self.owner, "pid": os.getpid(), "host": socket.gethostname(),
                           "beat": self._beat, "time": time.time()}, sort_keys=True).encode()

    def acquire(self, wait_s: float | None = None, poll_s: float = 0.5,
                log: Callable[[str], None] | None = None) -> None:
        """Take the lease, waiting up to ``wait_s`` seconds (None = forever); raise :class:`LeaseHeld`."""
        start = time.monotonic()
        seen: tuple[bytes, float] | None = None  # (content, monotonic time first seen unchanged)
        announced = False
        while True:
            if self._try_create():
                self._start_heartbeat()
                return
            try:
                content = _read_lease(self.path)
            except FileNotFoundError:
                continue  # released meanwhile: try again at once
            now = time.monotonic()
            if seen is None or seen[0] != content:
                seen = (content, now)
            if _written_by_dead_local_process(content) or now - seen[1] >= self.ttl_s:
                self._take_over(content, force=now - seen[1] >= 2 * self.ttl_s)
                if self._try_create():
                    self._start_heartbeat()
                    return
            if wait_s is not None and now - start >= wait_s:
                _LIVE_OWNERS.discard(self.owner)
                raise LeaseHeld(f"another aggregator holds {self.path}: {content.decode(errors='replace')}")
            if log is not None and not announced:
                log(f"waiting for the aggregator lease {self.path} ({content.decode(errors='replace')}); "
                    f"taken over if unchanged for {self.ttl_s:.0f}s")
                announced = True
            time.sleep(poll_s)

    def _try_create(self) -> bool:
        _LIVE_OWNERS.add(self.owner)  # before the file can name us (other threads may read it)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._content())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path.parent)
        return True

    def _takeover_marker(self, stale: bytes) -> Path:
        digest = hashlib.sha256(stale).hexdigest()[:32]
        return self.path.with_name(f".{self.path.name}.takeover{TEMP_MARK}{digest}")

    def _take_over(self, stale: bytes, *, force: bool = False) -> None:
        """Remove the stale lease, racing other contenders through an O_EXCL marker named by its content.

        Only the contender that creates the marker may delete the lease, and only while it still holds
        exactly the stale content; then everybody competes for the O_EXCL create. ``force`` first
        drops a marker left by a contender that died mid-takeover (the lease stayed unchanged 2 TTLs).
        """
        marker = self._takeover_marker(stale)
        if force:
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return  # another contender is taking this very lease over
        with contextlib.suppress(OSError):  # gone, or not removable (a directory): wait as for a live lease
            if _read_lease(self.path) == stale:
                self.path.unlink()

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="santa-lease", daemon=True)
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLost:
                self._lost = True
                return
            except OSError:
                continue  # a transient filesystem error: the next beat retries

    def _is_mine(self) -> bool:
        try:
            obj = loads_json(read_regular(self.path, MAX_LEASE_BYTES))
        except (OSError, ValueError):
            return False
        return isinstance(obj, dict) and obj.get("owner") == self.owner

    def renew(self) -> None:
        if not self._is_mine():
            raise LeaseLost(f"the aggregator lease {self.path} was taken over")
        self._beat += 1
        atomic_write_bytes(self.path, self._content())

    @property
    def lost(self) -> bool:
        """True once the heartbeat found the lease in another owner's hands (no I/O)."""
        return self._lost

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the lease file still names this owner."""
        if self._lost or not self._is_mine():
            self._lost = True
            raise LeaseLost(f"the aggregator lease {self.path} was taken over; stopping without committing")

    def release(self) -> None:
        _LIVE_OWNERS.discard(self.owner)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self._lost and self._is_mine():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


_LIVE_OWNERS: set[str] = set()  # owners of the leases this process holds now


def _read_lease(path: Path) -> bytes:
    """The lease file's bytes, read without blocking; an entry that is not a small regular file (a
    FIFO, a directory, an empty or huge file) reads as its description, judged stale like any content."""
    try:
        return read_regular(path, MAX_LEASE_BYTES)
    except UnsafeFile as exc:
        return f"not a lease: {exc}".encode()


def _written_by_dead_local_process(content: bytes) -> bool:
    try:
        obj = loads_json(content)
        pid, host = int(obj["pid"]), str(obj["host"])
    except (ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or not 0 < pid < 2**31:  # os.kill needs a C int; <= 0 names groups
        return False
    if pid == os.getpid():
        # our pid: a lease held in this process is alive; otherwise it is a previous life of this
        # (restarted) container, whose pid was reused
        owner = obj.get("owner")
        return not isinstance(owner, str) or owner not in _LIVE_OWNERS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a killed child not yet reaped by its parent is a zombie: dead for our purpose
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].startswith("Z")
    except (OSError, ValueError):
        return False
