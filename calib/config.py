"""Hydra configuration: resolvers, the list of methods, and validation that fails in one line.

The config groups live in ``conf/`` (``method/``, ``model/``, ``data/``, ``tracking/``, ``collect/``).
``method`` is not in the defaults list: the user writes ``+method=<name>``. A method's settings are
``conf/method/<name>/default.yaml`` and, for one model, ``conf/method/<name>/<model>.yaml`` (a delta), both
selected by ``conf/config.yaml``; recipes read them through :mod:`calib.recipe_settings`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from calib.errors import UserError
from calib.paths import config_dir, project_root

# hydra is imported where used: the GPU benchmarks import this module (for the resolver) without hydra.

CONFIG_NAME = "config"


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("calib_root"):
        OmegaConf.register_new_resolver("calib_root", lambda: str(project_root()))


_register_resolvers()


def available(group: str) -> list[str]:
    """Options of a config group, i.e. the YAML files under ``conf/<group>/``."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def available_methods() -> list[str]:
    return available("method")


_METHOD_OVERRIDE = re.compile(r"^\+{0,2}method=(.*)$")


def method_overrides(overrides: Sequence[str]) -> list[str]:
    """The method names requested by ``+method=a`` / ``method=a,b`` overrides (sweeps expanded)."""
    names: list[str] = []
    for o in overrides:
        m = _METHOD_OVERRIDE.match(o.strip())
        if m:
            value = m.group(1)
            value = re.sub(r"^(choice|glob)\((.*)\)$", r"\2", value)
            names += [v.strip().strip("'\"") for v in value.split(",") if v.strip()]
    return names


def check_method_choice(overrides: Sequence[str], required: bool = True) -> None:
    """Raise a one-line :class:`UserError` when no method, or an unknown one, is requested."""
    names = method_overrides(overrides)
    methods = available_methods()
    listing = ", ".join(methods) if methods else "(none installed)"
    if not names and required:
        raise UserError(f"no method given: add +method=<name>, one of: {listing}")
    unknown = [n for n in names if n not in methods]
    if unknown:
        raise UserError(f"unknown method {unknown[0]!r}: use +method=<name>, one of: {listing}")


def _first_of_sweeps(overrides: Sequence[str]) -> list[str]:
    """Replace each sweep (``a=1,2`` / ``range(...)``) by its first value so one job can be composed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    out = []
    for o in parsed:
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()))
            out.append(f"{o.get_key_element()}={first}")
        else:
            out.append(o.input_line)
    return out


def compose(overrides: Sequence[str] = (), config_name: str = CONFIG_NAME) -> DictConfig:
    """Compose the config as the CLI would (for tests and pre-validation), errors in one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=_first_of_sweeps(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise UserError(one_line(exc)) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def one_line(exc: BaseException) -> str:
    """A Hydra/OmegaConf error as one line, with the hint Hydra gives for unknown keys."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    hint = next((ln for ln in lines[1:] if ln.startswith("To append")), None)
    if "Could not override" in text and hint:
        text = f"{text} ({hint}); unknown key: check the spelling or list keys with --cfg job"
    method_data = re.search(r"Could not find 'data/(saap|sampleattention)/([\w.-]+)'", text)
    if method_data:  # a method whose conf/method/<m>.yaml selects data/<m>/<model>: a model without that file
        method, model = method_data.groups()
        title = {"saap": "SAAP", "sampleattention": "SampleAttention"}[method]
        return (f"{title} has no calibration data for model {model!r}: add conf/data/{method}/{model}.yaml "
                f"(one line, `defaults: [/data/{method}/books@_here_]` for a model that reads natural text, "
                f"`[/data/synthetic@_here_]` for one that does not; docs/configuration.md) or pass data=<source>")
    if "Could not find" in text or "Could not load" in text:
        group = re.search(r"'([\w/]+)/[\w.-]+'", text)
        if group:
            text += f"; available: {', '.join(available(group.group(1).split('/')[0]))}"
    return "invalid configuration: " + text


def require(cond: bool, message: str) -> None:
    """Validation helper: raise a one-line :class:`UserError` when ``cond`` is false."""
    if not cond:
        raise UserError(message)


def layer_map(raw: Any, name: str) -> dict[int, int]:
    """A ``{layer: ℓ}`` setting (SAAP's per-layer ℓ: ``method.top_l_layers``, ``eval.top_l_layers``) as
    ``{int: int}`` with layers >= 0 and ℓ >= 1; null / empty -> ``{}``; anything else -> one-line UserError."""
    if not raw:
        return {}
    try:
        if not hasattr(raw, "items") or any(isinstance(x, bool) for kv in raw.items() for x in kv):
            raise ValueError
        out = {int(k): int(v) for k, v in raw.items()}
    except (TypeError, ValueError):
        raise UserError(f"{name} must map layer numbers to ℓ, e.g. {{3: 192}} (got {raw!r})") from None
    require(all(k >= 0 for k in out) and all(v >= 1 for v in out.values()),
            f"{name} needs layers >= 0 and ℓ >= 1 (got {out})")
    return out


def validate_common(cfg: DictConfig) -> None:
    """Range checks shared by every command (methods check their own keys)."""
    require(cfg.get("device", "auto") in ("auto", "cpu", "cuda") or str(cfg.device).startswith("cuda:"),
            f"device={cfg.device!r} is not one of auto, cpu, cuda, cuda:N")
    ev = cfg.get("eval")
    if ev is not None:
        require(int(ev.num_prompts) >= 1, f"eval.num_prompts must be >= 1 (got {ev.num_prompts})")
        require(int(ev.max_new_tokens) >= 1, f"eval.max_new_tokens must be >= 1 (got {ev.max_new_tokens})")
        nll = ev.get("nll")
        if nll is not None and int(nll.chunks) > 0:
            require(int(nll.chunk_tokens) >= int(nll.decode_tokens) + 2 and int(nll.decode_tokens) >= 0,
                    f"eval.nll needs chunk_tokens >= decode_tokens + 2 and decode_tokens >= 0 "
                    f"(got {nll.chunk_tokens}, {nll.decode_tokens})")
        data = cfg.get("data")
        if data is not None and data.get("seed") is not None:
            require(int(ev.seed) != int(data.seed),
                    f"eval.seed ({ev.seed}) must differ from data.seed: evaluation prompts must be held out")


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain JSON-able containers (recorded in manifests and MLflow)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]


def conf_path(*parts: str) -> Path:
    return config_dir().joinpath(*parts)
