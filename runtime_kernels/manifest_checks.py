"""What an artifact must satisfy before any of it is trusted: a manifest is untrusted input.

* ``manifest.json`` is bounded in size and in nesting before it is parsed, so neither a huge file nor
  a deeply nested one reaches the recursive JSON parser.
* Every field has the type its record declares (the dataclasses of :mod:`runtime_kernels.manifest` are
  the schema): ints are not bools, shapes are lists of non-negative ints, dtypes come from
  :data:`TENSOR_DTYPES`, a sha256 is 64 lowercase hex digits; no number outside ``metrics`` is NaN or
  infinite; every tensor's file is listed (sized and hashed) in ``files``.
* Every file an artifact names is a plain file name in its directory (no directory part, no ``..``, not
  absolute), and is opened only when it is a regular file that is not a symlink, with ``O_NOFOLLOW`` and
  ``O_NONBLOCK`` so that nothing swapped in (a FIFO, a device, a link) can block or redirect the read.

Every failure is one :class:`ArtifactError` line that names the field or the file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import stat
import types
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from runtime_kernels.errors import ArtifactError

MAX_MANIFEST_BYTES = 8 << 20  # a manifest holds metadata and small tables; tensors live in safetensors
MAX_JSON_DEPTH = 64  # far above calib's own manifests (the resolved Hydra config nests deepest)

# The dtypes an artifact's tensors may have (torch names, as the manifest records them).
TENSOR_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16",
                           "int64", "int32", "int16", "int8", "uint8", "bool"})

_HEX64 = re.compile(r"[0-9a-f]{64}")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a string literal, escapes included
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)  # +1 for an opening bracket, -1 for a closing one
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_CHUNK = 1 << 20
_PLAIN_LABEL = re.compile(r"[A-Za-z0-9_.\-]{1,80}")
_FREE_FORM = ("metrics",)  # top-level fields whose numbers may be NaN or infinite (headline figures)
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


# ----------------------------------------------------------------------------------------- parsing


def json_depth(text: bytes) -> int:
    """How deep ``[``/``{`` nest in ``text`` outside string literals (0 for a scalar), without parsing.

    A scan in C and numpy, linear in ``len(text)`` and with bounded memory. Unbalanced text is
    measured as written: ``json.loads`` stops at the first unmatched bracket, so its recursion never
    goes deeper than this; an unterminated string can only make the measure larger.
    """
    brackets = _JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKET)  # e.g. b"[{}[]]"
    depth = peak = 0
    for start in range(0, len(brackets), _CHUNK):
        steps = _STEP[np.frombuffer(brackets[start:start + _CHUNK], dtype=np.uint8)]  # [n] +1 / -1
        running = depth + np.cumsum(steps, dtype=np.int64)
        peak, depth = max(peak, int(running.max())), int(running[-1])
    return peak


def parse_manifest(data: bytes, path: Path) -> Any:
    """The JSON value of a manifest's bytes; refuses oversized, non-UTF-8, too deep or invalid text."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a calib manifest")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ArtifactError(f"{path} is not valid JSON (not UTF-8 text)") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise ArtifactError(f"{path} nests deeper than {MAX_JSON_DEPTH} levels: not a calib manifest")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer with more digits than Python converts
        raise ArtifactError(f"{path} is not valid JSON ({str(exc).splitlines()[0][:120]})") from None


# ----------------------------------------------------------------------------------------- field types


def shown(value: Any, width: int = 80) -> str:
    """``repr`` of a manifest value cut to one short line."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _json_type(value: Any) -> str:
    names = {type(None): "null", bool: "bool", int: "int", float: "float", str: "string", list: "list",
             dict: "object"}
    return names.get(type(value), type(value).__name__)


_SIMPLE: dict[Any, tuple[str, typing.Callable[[Any], bool]]] = {
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
    bool: ("true or false", lambda v: isinstance(v, bool)),
    dict: ("an object", lambda v: isinstance(v, dict)),
    list: ("a list", lambda v: isinstance(v, list)),
}


def _fail(where: str, field: str, what: str) -> typing.NoReturn:
    raise ArtifactError(f"{where}: manifest field {field} {what}")


def _item_field(field: str, item: Any, index: int, key: str | None) -> str:
    """``tensors.tau`` for a list item whose ``key`` (its name or file) is plain, else ``tensors[2]``."""
    label = item.get(key) if key is not None and isinstance(item, dict) else None
    if isinstance(label, str) and _PLAIN_LABEL.fullmatch(label):
        return f"{field}.{label}"
    return f"{field}[{index}]"


def _label_key(record: Any) -> str | None:
    """The field that names a record in error messages: ``name``, else ``file``, else none."""
    if not dataclasses.is_dataclass(record):
        return None
    return next((k for k in ("name", "file") if k in record.__dataclass_fields__), None)


def check_value(value: Any, hint: Any, field: str, where: str) -> None:
    """Refuse ``value`` unless it has the type ``hint`` (a record dataclass, ``list[X]``, ``X | None``,
    or int/float/str/bool/dict/list/Any); the error names ``field``."""
    if dataclasses.is_dataclass(hint):
        check_record(value, hint, field, where)
        return
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return
        if len(options) != 1:
            raise TypeError(f"unsupported manifest type {hint!r}")
        hint = options[0]
        if value is None:
            _fail(where, field, f"must be {_SIMPLE[typing.get_origin(hint) or hint][0]} or null (got null)")
        check_value(value, hint, field, where)
        return
    if origin is list:
        if not isinstance(value, list):
            _fail(where, field, f"must be a list (got {_json_type(value)})")
        (item,) = typing.get_args(hint)
        key = _label_key(item)
        for i, v in enumerate(value):
            check_value(v, item, _item_field(field, v, i, key), where)
        return
    if hint is Any:
        return
    what, ok = _SIMPLE[hint]
    if not ok(value):
        _fail(where, field, f"must be {what} (got {_json_type(value)})")


@functools.lru_cache(maxsize=None)
def _field_types(record: type) -> tuple[tuple[str, Any, bool], ...]:
    """``(name, type, required)`` of each field of the record dataclass."""
    hints = typing.get_type_hints(record)
    return tuple((f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(record))


def check_record(value: Any, record: type, field: str, where: str) -> None:
    """Refuse a JSON value that is not an object with ``record``'s fields: each of the declared type,
    none missing unless it has a default, none unknown."""
    label = field or "manifest"
    if not isinstance(value, dict):
        if field:
            _fail(where, field, f"must be an object (got {_json_type(value)})")
        raise ArtifactError(f"{where}: manifest.json is not a JSON object")
    declared = _field_types(record)
    for name, hint, required in declared:
        sub = f"{field}.{name}" if field else name
        if name in value:
            check_value(value[name], hint, sub, where)
        elif required:
            raise ArtifactError(f"{where}: manifest is malformed: field {sub} is missing")
    unknown = sorted(set(value) - {name for name, _, _ in declared})
    if unknown:
        raise ArtifactError(f"{where}: manifest is malformed: {label} has unknown field {shown(unknown[0])} "
                            "(written by a newer calib? upgrade runtime_kernels)")


def check_finite(value: Any, field: str, where: str) -> None:
    """Refuse NaN or infinite numbers anywhere in ``value`` except the top-level free-form fields."""
    if isinstance(value, float) and not math.isfinite(value):
        _fail(where, field, f"must be a finite number (got {value})")
    elif isinstance(value, dict):
        for k, v in value.items():
            if not (field == "" and k in _FREE_FORM):
                check_finite(v, f"{field}.{k}" if field else str(k), where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_finite(v, f"{field}[{i}]", where)


# ----------------------------------------------------------------------------------------- records


def check_member_name(name: str, field: str, where: str) -> None:
    """A file an artifact names is a plain file name in its directory: no directory part, no ``..``."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or len(name) > 255
            or (os.name == "nt" and ":" in name)):
        _fail(where, field, f"must name a file inside the artifact directory (got {shown(name)})")


def check_sha256(value: str, field: str, where: str) -> None:
    """A recorded digest is a sha256 ``hexdigest``: 64 lowercase hex digits."""
    if not _HEX64.fullmatch(value):
        _fail(where, field, f"must be 64 lowercase hex digits (got {shown(value)})")


def check_tensor_and_file_records(d: dict[str, Any], where: str) -> None:
    """The checks beyond types on ``tensors`` and ``files`` (both already type-checked lists of objects):
    plain unique file names, sizes >= 0, sha256 format, shapes of non-negative ints, known dtypes, unique
    tensor names, and every tensor file listed in ``files`` (so its bytes are hashed before use)."""
    listed: set[str] = set()
    for i, rec in enumerate(d["files"]):
        field = _item_field("files", rec, i, "file")
        check_member_name(rec["file"], f"{field}.file", where)
        if rec["file"] in listed:
            _fail(where, f"{field}.file", f"lists {shown(rec['file'])} twice")
        listed.add(rec["file"])
        if rec["bytes"] < 0:
            _fail(where, f"{field}.bytes", f"must be >= 0 (got {rec['bytes']})")
        check_sha256(rec["sha256"], f"{field}.sha256", where)
    names: set[str] = set()
    for i, rec in enumerate(d["tensors"]):
        field = _item_field("tensors", rec, i, "name")
        if not rec["name"] or rec["name"] in names:
            _fail(where, f"{field}.name", f"must be a unique non-empty name (got {shown(rec['name'])})")
        names.add(rec["name"])
        check_member_name(rec["file"], f"{field}.file", where)
        if rec["file"] not in listed:
            _fail(where, f"{field}.file", f"names {shown(rec['file'])}, which files does not list with its "
                                          "size and sha256")
        if any(n < 0 for n in rec["shape"]):
            _fail(where, f"{field}.shape", f"must hold non-negative sizes (got {shown(rec['shape'])})")
        if rec["dtype"] not in TENSOR_DTYPES:
            _fail(where, f"{field}.dtype", f"must be one of {', '.join(sorted(TENSOR_DTYPES))} "
                                           f"(got {shown(rec['dtype'])})")
        check_sha256(rec["sha256"], f"{field}.sha256", where)


# ----------------------------------------------------------------------------------------- files


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "of an unknown kind")


@contextmanager
def open_regular(root: Path, name: str, where: str) -> Iterator[tuple[int, int]]:
    """``(fd, size)`` of the regular file ``root/name``, opened without following links or blocking.

    ``name`` must already have passed :func:`check_member_name`. Refuses a missing file, a symlink, and
    anything that is not a regular file (FIFO, directory, device, socket) before opening it, and again on
    the open descriptor in case the entry was swapped in between.
    """
    path = root / name
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise ArtifactError(f"{where}: file {name} is missing") from None
    except OSError as exc:
        raise ArtifactError(f"{where}: cannot read {name} ({exc.strerror})") from None
    if stat.S_ISLNK(before.st_mode):
        raise ArtifactError(f"{where}: {name} is a symlink; an artifact holds only regular files")
    if not stat.S_ISREG(before.st_mode):
        raise ArtifactError(f"{where}: {name} is {_kind(before.st_mode)}, not a regular file")
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(root):
        raise ArtifactError(f"{where}: {name} resolves outside the artifact directory")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise ArtifactError(f"{where}: cannot open {name} ({exc.strerror})") from None
    try:
        after = os.fstat(fd)
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise ArtifactError(f"{where}: {name} changed while it was being opened")
        yield fd, after.st_size
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd`` (to its end if shorter)."""
    chunks, left = [], limit
    while left > 0:
        block = os.read(fd, min(left, 1 << 22))
        if not block:
            break
        chunks.append(block)
        left -= len(block)
    return b"".join(chunks)
