"""On-disk layout of a collected set, its content hash, and the reader.

::

    <cache_root>/<content hash[:32]>/
        set.json                  what the set is: full hash, model facts, budgets, prompt lengths
        rope.safetensors          the model's rotary ``inv_freq`` (+ attention_scaling), to rebuild post-RoPE
        prompt_00000.safetensors  one shard per prompt, written to a hidden temp file, fsync'ed and
        prompt_00001.safetensors  renamed: a shard that exists is complete (the rename is its done-marker)
        complete.json             written last: the set is complete and reusable; collection stats

Shard tensors, per collected layer ``l``: ``layer{l}.k_pos`` [Hkv, nk] and ``layer{l}.q_pos`` [Hq, nq]
(int32 positions, sorted per head) and ``layer{l}.<name>`` for each stored name: ``k_pre``/``k_post``/
``v`` [Hkv, nk, D] at the key positions, ``q_pre``/``q_post`` [Hq, nq, D] at the query positions.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from calib.errors import UserError
from calib.rope import apply_rope, cos_sin_from_inv_freq, derope

FORMAT_VERSION = 1
TENSOR_NAMES = ("q_pre", "q_post", "k_pre", "k_post", "v")
SET_FILE, ROPE_FILE, COMPLETE_FILE = "set.json", "rope.safetensors", "complete.json"


def content_hash(identity: dict[str, Any], prompts: Sequence[torch.Tensor]) -> str:
    """sha256 over the set's identity (format version, model, dtype, budgets) and every prompt's ids."""
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **identity}, sort_keys=True, default=str).encode())
    for p in prompts:
        ids = p.to(torch.int64).contiguous()
        h.update(int(ids.numel()).to_bytes(8, "little"))
        h.update(ids.numpy().astype("<i8").tobytes())
    return h.hexdigest()


def shard_name(prompt_index: int) -> str:
    return f"prompt_{prompt_index:05d}.safetensors"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Any) -> None:
    """``write(tmp_path)``, fsync, rename onto ``path``: readers see the whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def write_shard(directory: Path, prompt_index: int, tensors: dict[str, torch.Tensor], num_tokens: int) -> Path:
    path = directory / shard_name(prompt_index)
    meta = {"prompt_index": str(prompt_index), "num_tokens": str(num_tokens), "format": str(FORMAT_VERSION)}
    write_atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta))
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str)))


def sweep_temp_files(directory: Path) -> None:
    """Remove hidden temp files a killed run left behind."""
    for stale in directory.glob(".*.tmp"):
        stale.unlink(missing_ok=True)


class CollectedSet:
    """Reader of a collected set (see the module docstring); tensors load lazily, per layer and name.

    ``q_post``/``k_post`` that were not stored are rebuilt exactly from the stored pre-RoPE tensors and
    positions with the model's saved rotary frequencies (and ``*_pre`` from ``*_post`` by de-RoPE).
    """

    def __init__(self, directory: str | Path, *, reused: bool = False, stats: dict[str, Any] | None = None):
        self.directory = Path(directory)
        if not (self.directory / COMPLETE_FILE).is_file():
            raise UserError(f"{self.directory} is not a complete collected set (no {COMPLETE_FILE}): rerun collection")
        self.meta: dict[str, Any] = json.loads((self.directory / SET_FILE).read_text())
        self.complete: dict[str, Any] = json.loads((self.directory / COMPLETE_FILE).read_text())
        self.stats: dict[str, Any] = stats if stats is not None else dict(self.complete.get("stats", {}))
        self.reused = reused
        with safe_open(str(self.directory / ROPE_FILE), framework="pt") as f:
            self._inv_freq = f.get_tensor("inv_freq")
            self._attention_scaling = float(f.get_tensor("attention_scaling").item())

    @property
    def content_hash(self) -> str:
        return str(self.meta["content_hash"])

    @property
    def num_prompts(self) -> int:
        return int(self.meta["num_prompts"])

    @property
    def layers(self) -> list[int]:
        return [int(x) for x in self.meta["layers"]]

    @property
    def stored(self) -> list[str]:
        return list(self.meta["collect"]["store"])

    def shard_path(self, prompt_index: int) -> Path:
        return self.directory / shard_name(prompt_index)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [..., D] float32 for ``positions`` [...], as the model's rotary module computes them."""
        return cos_sin_from_inv_freq(positions, self._inv_freq, self._attention_scaling)

    def _read(self, f: Any, layer: int, name: str) -> torch.Tensor:
        key = f"layer{layer}.{name}"
        if name in ("q_pos", "k_pos") or name in self.stored:
            return f.get_tensor(key)
        if name not in TENSOR_NAMES or name == "v":
            raise KeyError(f"{name!r} is not in this set (stored: {self.stored}, positions: q_pos, k_pos)")
        kind, stage = name.split("_")
        other = f"{kind}_{'pre' if stage == 'post' else 'post'}"
        if other not in self.stored:
            raise KeyError(f"neither {name} nor {other} is stored in this set (stored: {self.stored})")
        x = f.get_tensor(f"layer{layer}.{other}")  # [H, n, D]
        cos, sin = self.cos_sin(f.get_tensor(f"layer{layer}.{kind}_pos").long())  # [H, n, D]
        return apply_rope(x, cos, sin) if stage == "post" else derope(x, cos, sin)

    def prompt(self, prompt_index: int, layer: int, names: Sequence[str] = ("k_pre",)) -> dict[str, torch.Tensor]:
        """One prompt's samples of ``layer``: ``{name: tensor}`` (see the module docstring for shapes)."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not collected (layers: {self.layers})")
        with safe_open(str(self.shard_path(prompt_index)), framework="pt") as f:
            return {name: self._read(f, layer, name) for name in names}

    def iter_layer(self, layer: int, names: Sequence[str] = ("k_pre",)) -> Iterator[dict[str, torch.Tensor]]:
        """Stream ``layer``'s samples prompt by prompt (bounded memory)."""
        for i in range(self.num_prompts):
            yield self.prompt(i, layer, names)

    def layer(self, layer: int, names: Sequence[str] = ("k_pre",)) -> dict[str, torch.Tensor]:
        """``layer``'s samples of all prompts concatenated on the sample dim (``[H, N_total, D]``).

        Adds ``k_prompt``/``q_prompt`` ([N_total] prompt index of each sample) for the kinds requested.
        """
        parts = list(self.iter_layer(layer, names))
        out = {name: torch.cat([p[name] for p in parts], dim=1) for name in names}
        for kind in sorted({_kind(n) for n in names}):
            member = next(n for n in names if _kind(n) == kind)
            counts = torch.tensor([p[member].shape[1] for p in parts])
            out[f"{kind}_prompt"] = torch.repeat_interleave(torch.arange(len(parts)), counts)
        return out


def _kind(name: str) -> str:
    """``q`` for query tensors, ``k`` for keys and values (they share the key positions)."""
    return "q" if name.startswith("q") else "k"
