"""Files on the shared SANTA volume: atomic writes and bounded, non-blocking reads.

Every file that a reader may see is written to a hidden temp name in the same folder, flushed,
fsync'ed and then renamed (or hard-linked, for an exclusive publish) onto its final name, and the
folder is fsync'ed; so a reader sees either nothing or the whole file. Hidden temp names start with
``.`` and contain ``.tmp-``.

Anyone who can write the volume can put anything at any name, so every read here refuses what could
hang or crash the reader: it opens only regular files (``lstat`` first, then ``O_NONBLOCK |
O_NOFOLLOW``: a FIFO never blocks, a link is never followed), caps the size, and bounds the JSON
nesting depth with a cheap scan before ``json.loads`` (whose recursion a line of 200000 ``[`` would
exhaust). Whatever fails these checks raises :class:`UnsafeFile`, a ``ValueError``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from runtime_kernels.manifest_checks import json_depth  # the one bounded-depth scan (manifests too)

TEMP_MARK = ".tmp-"
MAX_JSON_BYTES = 16 * 1024 * 1024  # snapshots, manifests and history records are far smaller
MAX_JSON_DEPTH = 32  # our records nest two deep; far below the recursion limit of json.loads


def is_temp_name(name: str) -> bool:
    """Hidden temp files (``.<final>.tmp-<unique>``): in progress, or left by a dead writer."""
    return name.startswith(".") and TEMP_MARK in name


# ----------------------------------------------------------------------------- atomic writes


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


# ----------------------------------------------------------------------------- bounded reads


class UnsafeFile(ValueError):
    """An entry that is not a regular file of bounded size, or JSON nested too deep; says why."""


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def entry_kind(mode: int) -> str:
    """What a directory entry of ``st_mode`` ``mode`` is, in words."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "an unknown kind of entry")


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (1..``max_bytes`` bytes), read without blocking.

    ``lstat`` first, then ``open(O_NONBLOCK | O_NOFOLLOW)`` and ``fstat`` again (the entry may have
    been swapped meanwhile): a directory, FIFO, socket, device or symlink is refused unread. Raises
    :class:`UnsafeFile` with the reason, ``FileNotFoundError`` if the entry is gone.
    """
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise UnsafeFile(f"{entry_kind(mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:  # EACCES, or ELOOP: swapped for a symlink since the lstat
        raise UnsafeFile(f"cannot be opened ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{entry_kind(st.st_mode)}, not a regular file")
        if not 0 < st.st_size <= max_bytes:
            raise UnsafeFile(f"file size {st.st_size} bytes is out of range (1..{max_bytes})")
        chunks, size = [], 0
        while size <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise UnsafeFile(f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise UnsafeFile(f"file grew beyond {max_bytes} bytes while being read")
    return b"".join(chunks)


def printable(name: str) -> str:
    """A file name as a log line can carry it: bytes that were not UTF-8 (surrogate escapes) shown as
    ``\\udcXX`` escapes instead of making the line unencodable."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def loads_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of UTF-8 ``data`` with the nesting bounded first (:class:`UnsafeFile`);
    NaN/Infinity literals and bad UTF-8 raise ``ValueError`` too."""
    if json_depth(data) > max_depth:
        raise UnsafeFile(f"JSON nested deeper than {max_depth}")
    return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file strictly and safely (:func:`read_regular`, :func:`loads_json`)."""
    return loads_json(read_regular(path, max_bytes))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name}")
