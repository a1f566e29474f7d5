"""``collect``: sampled Q/K/V of every layer and head over a prompt set, streamed to a resumable cache.

Budgets are per prompt: from each prompt, per (layer, KV head) ``keys_per_head`` key positions (keys
and values at the same positions) and per (layer, query head) ``queries_per_head`` query positions
(``reservoir`` or ``stratified``, see :mod:`calib.collect.sampling`). One shard per prompt is written
as soon as its forward pass ends, so an interrupted run resumes at the first missing prompt, and a
complete set is reused by any later run with the same content hash (model weights, arch, dtype,
prompt token ids, budgets). Memory caps are config values: the batch is reduced to fit them, a CUDA
allocation beyond ``max_gpu_bytes`` is refused by the allocator, and a prompt that cannot fit even
alone is a one-line UserError.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch
from filelock import FileLock
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file
from tqdm.auto import tqdm

from calib.collect.capture import LayerCapture, capture_session, check_prompt_lengths, normalize_prompts
from calib.collect.memory import (forward_bytes, gpu_memory_cap, model_bytes, peak_gpu_bytes, peak_host_rss_bytes,
                                  reset_gpu_peak)
from calib.collect.sampling import SAMPLING_MODES, gather_heads, sample_generator, sample_positions
from calib.collect.store import (COMPLETE_FILE, FORMAT_VERSION, ROPE_FILE, SET_FILE, TENSOR_NAMES, CollectedSet,
                                 content_hash, shard_name, sweep_temp_files, write_atomic, write_json, write_shard)
from calib.errors import UserError
from calib.models import resolve_dtype
from calib.paths import artifacts_dir
from calib.rope import rotary_module

log = logging.getLogger(__name__)


@dataclass
class CollectConfig:
    """The ``collect`` config group (conf/collect/default.yaml documents each key)."""

    keys_per_head: int = 1024
    queries_per_head: int = 512
    sampling: str = "stratified"
    seed: int = 0
    layers: list[int] | None = None
    store: list[str] = field(default_factory=lambda: ["q_pre", "k_pre", "v"])
    store_dtype: str = "auto"
    batch_size: int = 1
    cache_dir: str | None = None
    max_host_bytes: int | None = None
    max_gpu_bytes: int | None = None
    progress: bool = True

    @classmethod
    def from_any(cls, cfg: Any) -> "CollectConfig":
        """From None, a dict, an OmegaConf node or a CollectConfig; unknown keys and bad values -> UserError."""
        if isinstance(cfg, CollectConfig):
            return cfg
        data: dict[str, Any] = {}
        if cfg is not None:
            is_node = isinstance(cfg, DictConfig)
            data = OmegaConf.to_container(cfg, resolve=True) if is_node else dict(cfg)  # type: ignore[assignment]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"unknown collect key(s) {unknown}: valid keys are {sorted(known)}")
        out = cls(**data)
        out.validate()
        return out

    def validate(self) -> None:
        for key in ("keys_per_head", "queries_per_head", "batch_size"):
            if int(getattr(self, key)) < 1:
                raise UserError(f"collect.{key} must be >= 1 (got {getattr(self, key)})")
        if self.sampling not in SAMPLING_MODES:
            raise UserError(f"collect.sampling={self.sampling!r} is not one of {', '.join(SAMPLING_MODES)}")
        bad = [s for s in self.store if s not in TENSOR_NAMES]
        if bad or not self.store:
            raise UserError(f"collect.store={list(self.store)}: choose from {', '.join(TENSOR_NAMES)}")
        for key in ("max_host_bytes", "max_gpu_bytes"):
            value = getattr(self, key)
            if value is not None and int(value) <= 0:
                raise UserError(f"collect.{key} must be a positive byte count or null (got {value})")

    def identity(self, layers: list[int]) -> dict[str, Any]:
        """The keys that decide the content (part of the content hash); not batch size, paths or caps."""
        keep = ("keys_per_head", "queries_per_head", "sampling", "seed", "store", "store_dtype")
        return {**{k: v for k, v in asdict(self).items() if k in keep}, "layers": layers}


def default_cache_root() -> Path:
    return artifacts_dir() / "cache" / "collect"


def sample_bytes(facts: Any, num_layers: int, tokens: int, cfg: CollectConfig, elem: int) -> int:
    """Host bytes of one prompt's samples (all collected layers)."""
    nk, nq = min(cfg.keys_per_head, tokens), min(cfg.queries_per_head, tokens)
    k_names = sum(1 for s in cfg.store if not s.startswith("q"))
    q_names = len(cfg.store) - k_names
    per_layer = (facts.num_kv_heads * nk * (facts.head_dim * elem * k_names + 4)
                 + facts.num_heads * nq * (facts.head_dim * elem * q_names + 4))
    return per_layer * num_layers


def plan_batch_size(cfg: CollectConfig, loaded: Any, max_tokens: int, num_layers: int, store_elem: int) -> int:
    """The largest batch <= cfg.batch_size whose estimated working set fits both caps."""
    model = loaded.model
    on_gpu = loaded.device.type == "cuda"
    dtype = next(model.parameters()).dtype
    weights = model_bytes(model)
    fwd = forward_bytes(model.config, max_tokens, 1, dtype, str(model.config._attn_implementation))
    sample = sample_bytes(loaded.facts, num_layers, max_tokens, cfg, store_elem)

    def needs(batch: int) -> dict[str, int]:
        host = batch * sample + (0 if on_gpu else weights + batch * fwd)
        return {"max_host_bytes": host, **({"max_gpu_bytes": weights + batch * (fwd + sample)} if on_gpu else {})}

    for batch in range(cfg.batch_size, 0, -1):
        over = {k: v for k, v in needs(batch).items() if getattr(cfg, k) is not None and v > int(getattr(cfg, k))}
        if not over:
            if batch < cfg.batch_size:
                log.info("collect: batch size %d -> %d to fit the memory caps", cfg.batch_size, batch)
            return batch
    key, need = next(iter(over.items()))
    raise UserError(f"collecting a {max_tokens}-token prompt needs about {need / 2**30:.2f} GiB but "
                    f"collect.{key}={int(getattr(cfg, key)) / 2**30:.2f} GiB: raise collect.{key}, shorten the "
                    f"prompts or lower collect.keys_per_head/queries_per_head")


class _Sampler:
    """The capture callback: draws each head's positions and keeps the samples (on CPU) per prompt."""

    def __init__(self, cfg: CollectConfig, store_dtype: torch.dtype):
        self.cfg, self.store_dtype = cfg, store_dtype
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, cap: LayerCapture) -> None:
        cfg, layer, index = self.cfg, cap.layer, cap.prompt_index
        out = self.buffers.setdefault(index, {})
        pos = {
            "k": sample_positions(cap.num_tokens, cfg.keys_per_head, cap.k_pre.shape[0], cfg.sampling,
                                  sample_generator(cfg.seed, index, layer, "k")),  # [Hkv, nk]
            "q": sample_positions(cap.num_tokens, cfg.queries_per_head, cap.q_pre.shape[0], cfg.sampling,
                                  sample_generator(cfg.seed, index, layer, "q")),  # [Hq, nq]
        }
        out[f"layer{layer}.k_pos"] = pos["k"].to(torch.int32)
        out[f"layer{layer}.q_pos"] = pos["q"].to(torch.int32)
        for name in cfg.store:
            picked = gather_heads(getattr(cap, name), pos["q" if name.startswith("q") else "k"])  # [H, n, D]
            out[f"layer{layer}.{name}"] = picked.to(self.store_dtype).cpu()


def _prepare_directory(directory: Path, meta: dict[str, Any], model: torch.nn.Module) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    sweep_temp_files(directory)
    set_file = directory / SET_FILE
    if set_file.is_file():
        old = json.loads(set_file.read_text()).get("content_hash")
        if old != meta["content_hash"]:
            raise RuntimeError(f"{directory} holds set {old}, not {meta['content_hash']}: remove the directory")
        return
    rotary = rotary_module(model)
    rope = {"inv_freq": rotary.inv_freq.detach().float().cpu(),
            "attention_scaling": torch.tensor(float(getattr(rotary, "attention_scaling", 1.0)))}
    write_atomic(directory / ROPE_FILE, lambda tmp: save_file(rope, str(tmp)))
    write_json(set_file, meta)


def _model_identity(facts: Any) -> dict[str, Any]:
    """The model's part of the content hash: the weights' hash and the architecture.

    With a weights hash, the YAML name and the revision label are left out, so the same weights
    reuse a set whether they were loaded from a local copy or from the HF cache.
    """
    out = facts.to_dict()
    if out.get("model_hash"):
        out.pop("name", None)
        out.pop("revision", None)
    return out


def collect(loaded: Any, prompts: Any, collect_cfg: Any = None, cache_root: str | Path | None = None) -> CollectedSet:
    """Collect (or reuse) the sampled Q/K/V set of ``prompts``; returns its reader with ``.stats``.

    ``loaded``: :class:`calib.models.LoadedModel`; ``prompts``: token-id lists / 1-D tensors / [N, T];
    ``collect_cfg``: the ``collect`` config group; ``cache_root``: default ``collect.cache_dir``, else
    ``<artifacts>/cache/collect``. Stats: tokens/s of the forward passes and peak host/GPU memory.
    """
    start = time.perf_counter()
    cfg = CollectConfig.from_any(collect_cfg)
    items = normalize_prompts(prompts)
    if not items:
        raise UserError("no prompts to collect: the calibration data is empty")
    facts = loaded.facts
    check_prompt_lengths(items, facts.max_position_embeddings, facts.name)
    layers = sorted(set(cfg.layers)) if cfg.layers is not None else list(range(facts.num_layers))
    if not layers or layers[0] < 0 or layers[-1] >= facts.num_layers:
        raise UserError(f"collect.layers={cfg.layers} out of range: model {facts.name!r} has layers "
                        f"0..{facts.num_layers - 1}")
    compute_dtype = next(loaded.model.parameters()).dtype
    store_dtype = compute_dtype if cfg.store_dtype == "auto" else resolve_dtype(cfg.store_dtype, loaded.device)
    identity = {"model": _model_identity(facts), "compute_dtype": str(compute_dtype), "collect": cfg.identity(layers)}
    digest = content_hash(identity, items)
    root = Path(cache_root or cfg.cache_dir or default_cache_root()).expanduser()
    directory = root / digest[:32]
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory) + ".lock"):
        if (directory / COMPLETE_FILE).is_file():
            log.info("collect: reusing the collected set %s at %s (nothing recomputed)", digest[:12], directory)
            reused = CollectedSet(directory, reused=True)
            reused.stats.update(reused=True, wall_s=time.perf_counter() - start)
            return reused
        meta = {**identity, "content_hash": digest, "format": FORMAT_VERSION, "num_prompts": len(items), "layers": layers,
                "prompt_lengths": [int(p.numel()) for p in items], "store_dtype": str(store_dtype)}
        _prepare_directory(directory, meta, loaded.model)
        stats = _collect_missing(loaded, items, cfg, layers, store_dtype, directory)
        stats.update(content_hash=digest, directory=str(directory), reused=False, wall_s=time.perf_counter() - start,
                     bytes_on_disk=sum(p.stat().st_size for p in directory.iterdir() if p.is_file()))
        write_json(directory / COMPLETE_FILE, {"content_hash": digest, "stats": stats})
    log.info("collect: %d prompts, %.0f tokens/s, peak GPU %s B, peak host RSS %s B", len(items),
             stats["tokens_per_s"], stats["peak_gpu_bytes"], stats["peak_host_rss_bytes"])
    return CollectedSet(directory, stats=stats)


def _collect_missing(loaded: Any, items: Sequence[torch.Tensor], cfg: CollectConfig, layers: list[int],
                     store_dtype: torch.dtype, directory: Path) -> dict[str, Any]:
    todo = [i for i in range(len(items)) if not (directory / shard_name(i)).is_file()]
    if len(todo) < len(items):
        log.info("collect: resuming, %d of %d prompts already collected", len(items) - len(todo), len(items))
    elem = torch.finfo(store_dtype).bits // 8
    batch = plan_batch_size(cfg, loaded, max((int(items[i].numel()) for i in todo), default=1), len(layers), elem)
    sampler = _Sampler(cfg, store_dtype)
    pad = getattr(loaded.tokenizer, "pad_token_id", None) or 0
    device = loaded.device
    reset_gpu_peak(device)
    tokens, forward_s, queue = 0, 0.0, list(todo)
    with gpu_memory_cap(device, cfg.max_gpu_bytes), \
            capture_session(loaded.model, sampler, layers=layers, pad_token_id=pad) as session, \
            tqdm(total=len(items), initial=len(items) - len(todo), desc="collect", unit="prompt",
                 disable=not cfg.progress) as bar:
        while queue:
            chunk = queue[:batch]
            t0 = time.perf_counter()
            try:
                session.forward([items[i] for i in chunk], chunk)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except torch.cuda.OutOfMemoryError:
                sampler.buffers.clear()
                if batch == 1:
                    raise UserError(f"prompt {chunk[0]} ({items[chunk[0]].numel()} tokens) does not fit in "
                                    f"collect.max_gpu_bytes={cfg.max_gpu_bytes}: raise it or shorten the prompt") from None
                batch = max(1, batch // 2)
                log.info("collect: out of GPU memory, batch size -> %d", batch)
                torch.cuda.empty_cache()
                continue
            forward_s += time.perf_counter() - t0
            for i in chunk:
                write_shard(directory, i, sampler.buffers.pop(i), int(items[i].numel()))
                tokens += int(items[i].numel())
                bar.update(1)
            queue = queue[len(chunk):]
    return {"prompts": len(items), "prompts_computed": len(todo), "prompts_resumed": len(items) - len(todo),
            "tokens_computed": tokens, "forward_s": forward_s, "tokens_per_s": tokens / forward_s if forward_s else 0.0,
            "batch_size": batch, "peak_gpu_bytes": peak_gpu_bytes(device), "peak_host_rss_bytes": peak_host_rss_bytes()}
