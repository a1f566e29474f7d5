"""Per-layer checkpoints of a recipe's long stages, so a killed run started again continues.

A recipe opens :func:`stage_checkpoints` with everything its results depend on (the resolved config,
the model hash, the calibration data hash); that key picks a directory
``<artifacts>/scratch/checkpoints/<method>-<key sha256[:16]>/``, so a changed config, model or prompt
set never reuses another run's results. Inside it each finished (stage, layer) is one safetensors file
``<stage>.layer_<l>.safetensors`` (never pickle), written to a temp file in the same directory, fsynced
and renamed into place: a kill leaves either the whole file or none. :meth:`StageCheckpoints.layer`
returns the saved tensors when the file exists (counting it in ``loaded``) and otherwise computes,
saves and returns them (counting it in ``computed``). The recipe removes the directory once its last
stage has finished (:meth:`StageCheckpoints.clear`).

Each file also records the seconds its layer took to compute (``_compute_seconds``, dropped from the
tensors handed back), and :attr:`StageCheckpoints.seconds` sums them per stage over every layer the run
holds, computed now or by a killed run it resumed: a run finished in several attempts still reports
what each stage cost (a recipe logs them as ``compute_<stage>_s`` beside its own ``time_<stage>_s``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import load_file, save_file

from calib.paths import artifacts_dir

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
SECONDS_KEY = "_compute_seconds"


def checkpoint_key(config: Mapping[str, Any], **identity: Any) -> str:
    """sha256 (hex) of the config (without ``tracking``: where results are logged changes nothing) and ``identity``."""
    body = {k: v for k, v in config.items() if k != "tracking"}
    text = json.dumps({"config": body, **identity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class StageCheckpoints:
    """Finished (stage, layer) results of one calibration under ``directory`` (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.loaded = 0
        self.computed = 0
        self.seconds: dict[str, float] = {}  # stage -> compute seconds of the layers held (module docstring)

    def path(self, stage: str, layer: int) -> Path:
        return self.directory / f"{stage}.layer_{layer}.safetensors"

    def has(self, stage: str, layer: int) -> bool:
        return self.path(stage, layer).is_file()

    def _count(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def load(self, stage: str, layer: int) -> Tensors | None:
        """The saved tensors of (stage, layer), or None when that layer has not finished."""
        path = self.path(stage, layer)
        if not path.is_file():
            return None
        tensors = load_file(str(path))
        seconds = tensors.pop(SECONDS_KEY, None)
        self._count(stage, float(seconds) if seconds is not None else 0.0)
        self.loaded += 1
        log.info("checkpoint: loaded %s layer %d from %s (not recomputed)", stage, layer, path)
        return tensors

    def save(self, stage: str, layer: int, tensors: Mapping[str, torch.Tensor], seconds: float = 0.0) -> Tensors:
        """Write (stage, layer) atomically (temp file + fsync + rename) with the ``seconds`` it took to
        compute; returns ``tensors`` (on the CPU)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(stage, layer)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        plain = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        save_file({**plain, SECONDS_KEY: torch.tensor(float(seconds), dtype=torch.float64)}, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._count(stage, float(seconds))
        self.computed += 1
        return plain

    def layer(self, stage: str, layer: int, compute: Callable[[], Mapping[str, torch.Tensor]]) -> Tensors:
        """The saved result of (stage, layer), else ``compute()`` (timed) saved and returned."""
        saved = self.load(stage, layer)
        if saved is not None:
            return saved
        t0 = time.perf_counter()
        fresh = compute()
        return self.save(stage, layer, fresh, seconds=time.perf_counter() - t0)

    def clear(self) -> None:
        """Remove the directory: every stage has finished and its results are in the artifact."""
        shutil.rmtree(self.directory, ignore_errors=True)


def stage_checkpoints(method: str, config: Mapping[str, Any], **identity: Any) -> StageCheckpoints:
    """The checkpoints of ``method`` for this config and ``identity`` (e.g. model and data hashes)."""
    key = checkpoint_key(config, method=method, **identity)
    return StageCheckpoints(artifacts_dir() / "scratch" / "checkpoints" / f"{method}-{key[:16]}")
