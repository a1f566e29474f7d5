"""Content hashes of files (``sha256``), remembered in a sidecar so a large file is read once.

:func:`files_hash` identifies a set of weight files by content: sha256 over ``"<file name> <file sha256>"``
lines. Files in the HF cache are blobs named by their own sha256, so hashing them costs nothing; other
files are hashed once and remembered in ``artifacts/cache/model_hashes.json``, keyed by path, size and
mtime. :mod:`calib.models` hashes checkpoints with it, :mod:`calib.gguf_checkpoint` GGUF files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from filelock import FileLock

from calib.paths import artifacts_dir

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _sidecar_path() -> Path:
    return artifacts_dir() / "cache" / "model_hashes.json"


def _cached_file_sha256(path: Path, sidecar: dict[str, Any]) -> str:
    real = path.resolve()
    if path.is_symlink() and _HEX64.match(real.name):  # HF cache blob: named by its sha256
        return real.name
    st = real.stat()
    entry = sidecar.get(str(real))
    if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
        return entry["sha256"]
    digest = _file_sha256(real)
    sidecar[str(real)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return digest


def file_sha256s(files: list[Path]) -> list[str]:
    """The content sha256 (hex) of each file, from the sidecar when its size and mtime are unchanged."""
    side = _sidecar_path()
    side.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(side) + ".lock"):
        sidecar = json.loads(side.read_text()) if side.is_file() else {}
        before = json.dumps(sidecar, sort_keys=True)
        digests = [_cached_file_sha256(f, sidecar) for f in files]
        if json.dumps(sidecar, sort_keys=True) != before:
            tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sidecar, indent=1, sort_keys=True))
            os.replace(tmp, side)
    return digests


def files_hash(files: list[Path]) -> str:
    """``sha256:<hex>`` over ``"<file name> <file sha256>"`` lines of ``files`` (in the given order)."""
    lines = [f"{f.name} {digest}" for f, digest in zip(files, file_sha256s(files))]
    return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()
