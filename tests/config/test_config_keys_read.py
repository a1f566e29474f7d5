"""Every config key is read by code: a key nothing reads is configuration that changes nothing.

Two checks, each as strong as it can be cheaply:

* ``method.*`` and ``rl.*`` (every method x model): each recipe's settings builder (``validate`` and
  ``data_needs``) and :func:`calib.run.method_name` run on the composed config wrapped so that every key
  they access is recorded; a leaf that no access reaches fails. This is exact: the recipes read their
  settings nowhere else.
* ``eval.*``, ``data.*`` (every data option) and ``collect.*``, read across the code base (evaluation,
  data sources, the collector): a leaf whose name occurs in no ``.py`` file under ``calib/`` or
  ``runtime_kernels/`` fails. A name check, so it cannot tell which node reads a name; it catches a key
  nobody reads anywhere.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from calib.config import available, available_methods, compose

ROOT = Path(__file__).resolve().parents[2]


class Recorder(Mapping):
    """A read-only view of a DictConfig that records the dotted path of every leaf accessed (a value, a
    list, an empty map); reaching a group of settings records nothing by itself."""

    def __init__(self, node: DictConfig, path: str, reads: set[str]) -> None:
        self._node, self._path, self._reads = node, path, reads

    def __getitem__(self, key: Any) -> Any:
        value = self._node[key]  # resolves interpolations; raises as the DictConfig would
        path = f"{self._path}.{key}" if self._path else str(key)
        if isinstance(value, DictConfig) and len(value):
            return Recorder(value, path, self._reads)  # a group: only the leaves read under it count
        self._reads.add(path)
        return value

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        return self[key]

    def __contains__(self, key: object) -> bool:
        return key in self._node

    def __iter__(self) -> Iterator[Any]:
        return iter(self._node)

    def __len__(self) -> int:
        return len(self._node)


def leaves(node: Any, path: str) -> Iterator[str]:
    """Dotted paths of the leaves under ``node`` (a list is one leaf; an empty map is one leaf)."""
    if isinstance(node, DictConfig) and len(node):
        for key in node.keys():
            yield from leaves(node._get_node(key), f"{path}.{key}")
    else:
        yield path


def unread(cfg: DictConfig, node: str, reads: set[str]) -> list[str]:
    """Leaves under ``cfg[node]`` that no recorded leaf access reached."""
    if node not in cfg:
        return []
    return [leaf for leaf in leaves(cfg._get_node(node), node)
            if leaf not in reads]


@pytest.mark.parametrize("method", available_methods())
@pytest.mark.parametrize("model", available("model"))
def test_every_method_key_is_read_by_its_recipe(method: str, model: str) -> None:
    from calib.run import method_name

    cfg = compose([f"+method={method}", f"model={model}"])
    reads: set[str] = set()
    view = Recorder(cfg, "", reads)
    recipe = importlib.import_module(f"calib.{method}.recipe")
    recipe.validate(view)
    recipe.data_needs(view)
    assert method_name(view) == method
    assert unread(cfg, "method", reads) == [] and unread(cfg, "rl", reads) == []


def test_the_recorder_sees_an_unread_key() -> None:
    """The check can fail: a key the SAAP recipe does not know is reported."""
    from calib.run import method_name

    cfg = compose(["+method=saap", "+method.unused_knob=1", "+method.kmeans.unused_too=2"])
    reads: set[str] = set()
    importlib.import_module("calib.saap.recipe").validate(Recorder(cfg, "", reads))
    method_name(Recorder(cfg, "", reads))
    assert sorted(unread(cfg, "method", reads)) == ["method.kmeans.unused_too", "method.unused_knob"]


@cache
def code_text() -> str:
    return "\n".join(p.read_text() for d in ("calib", "runtime_kernels") for p in sorted((ROOT / d).rglob("*.py")))


def named_in_code(leaf: str) -> bool:
    return re.search(rf"\b{re.escape(leaf.rsplit('.', 1)[-1])}\b", code_text()) is not None


@pytest.mark.parametrize("data", available("data"))
def test_every_eval_data_and_collect_key_is_named_in_code(data: str) -> None:
    for model in available("model"):
        cfg = compose([f"model={model}", f"data={data}"])
        missing = [leaf for node in ("eval", "data", "collect") for leaf in leaves(cfg._get_node(node), node)
                   if not named_in_code(leaf)]
        assert missing == [], f"keys no code names (model={model}, data={data}): {missing}"


def test_the_name_check_can_fail() -> None:
    assert named_in_code("eval.bootstrap") and not named_in_code("eval.no_code_names_this_key")


def test_leaves_are_the_config_leaves() -> None:
    cfg = OmegaConf.create({"m": {"a": 1, "b": {"c": [1, 2], "d": None}, "e": {}}})
    assert list(leaves(cfg.m, "m")) == ["m.a", "m.b.c", "m.b.d", "m.e"]
    assert isinstance(cfg.m.b.c, ListConfig)
