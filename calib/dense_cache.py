"""The dense model's side of an evaluation, computed once: ``artifacts/cache/<kind>/<key>.json``.

Evaluating several artifacts of one model on one held-out set needs the dense answers (``calib.evaluate``) and
the dense real-text NLL (``calib.perplexity``) only once. A key covers everything the result depends on: the
weights' content hash, dtype, device type, the torch and transformers versions, the caller's settings and its
inputs (prompt tokens, text chunks). Weights without a content hash (a random dry run) are never cached.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from typing import Any, Iterable

import torch

from calib.paths import artifacts_dir

# what the dense forward itself is, beyond the versions in the key: bump when the loop computes it
# differently (rounding included), so results of the old path are not paired with new ones
DENSE_PATH = "static loop with fused q/k/v and gate/up projections"


def cache_key(loaded: Any, settings: list[Any], items: Iterable[Any]) -> str | None:
    """The key of a dense result of ``loaded`` under ``settings`` over ``items`` (each JSON-serializable);
    ``None`` when the weights have no content hash or are a dry run."""
    model_hash = getattr(loaded.facts, "model_hash", None)
    if not model_hash or getattr(loaded.facts, "dry_run", False):
        return None
    digest = hashlib.sha256()
    digest.update(json.dumps([model_hash, str(loaded.model.dtype), loaded.device.type, torch.__version__,
                              metadata.version("transformers"), DENSE_PATH, *settings]).encode())
    for item in items:
        digest.update(json.dumps(item).encode())
    return digest.hexdigest()[:32]


def read(kind: str, key: str | None) -> Any | None:
    """The cached JSON of ``kind``/``key``, or None (no key, or nothing cached)."""
    path = artifacts_dir() / "cache" / kind / f"{key}.json"
    return json.loads(path.read_text()) if key is not None and path.is_file() else None


def write(kind: str, key: str | None, data: Any) -> None:
    """Store ``data`` as ``kind``/``key`` (atomically: concurrent evaluations never read half a file)."""
    if key is None:
        return
    path = artifacts_dir() / "cache" / kind / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
