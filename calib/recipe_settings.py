"""What every method recipe reads: its config through typed getters, the report mode, the model's scales.

A recipe builds one frozen settings dataclass from its config node at its entry (``Settings.from_cfg``)
and reads plain attributes from then on. :class:`Section` is that builder's view of one node
(``method``, ``method.reward``, ``rl``): each getter returns one typed, range-checked value or raises a
one-line :class:`~calib.errors.UserError` that names the full key, e.g.
``method.clusters must be >= 2 (got 1)``. Every knob has its value in the YAML (conf/method/<m>/), so a
key that is absent is an error too, not a default hidden in code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf.errors import OmegaConfBaseException

from calib.collect.capture import attention_modules
from calib.errors import UserError

REPORT_MODES = ("artifact", "full")  # method.report: the artifact's numbers only | also the report extras


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value) and value == int(value)


def _range_text(at_least: float | None, above: float | None, at_most: float | None, below: float | None) -> str:
    """``>= 1``, ``> 0`` or ``in (0, 1]`` for the bounds given (None = no bound; above/below: strict)."""
    low = ("[", at_least) if above is None else ("(", above)
    high = ("]", at_most) if below is None else (")", below)
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    return f"{'<=' if high[0] == ']' else '<'} {high[1]}"


@dataclass(frozen=True)
class Section:
    """Typed reads of config node ``node`` whose dotted path is ``path`` (used in every error message)."""

    node: Any  # a DictConfig (or any mapping)
    path: str

    def key(self, name: str) -> str:
        return f"{self.path}.{name}"

    def value(self, name: str) -> Any:
        """The resolved value of ``name``; absent, missing (``???``) or unresolvable -> one-line UserError."""
        if not isinstance(self.node, Mapping) or name not in self.node:
            raise UserError(f"{self.key(name)} is not set: add it to the config")
        try:
            return self.node[name]
        except OmegaConfBaseException as exc:
            first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            raise UserError(f"{self.key(name)} cannot be read: {first}") from None

    def section(self, name: str) -> "Section":
        """The child node ``name`` (a mapping)."""
        child = self.value(name)
        if not isinstance(child, Mapping):
            raise UserError(f"{self.key(name)} must be a group of settings (got {child!r})")
        return Section(child, self.key(name))

    def _fail(self, name: str, what: str, value: Any, optional: bool) -> UserError:
        return UserError(f"{self.key(name)} must be {what}{' or null' if optional else ''} (got {value!r})")

    def _bounded(self, name: str, value: float, optional: bool, at_least: float | None, above: float | None,
                 at_most: float | None, below: float | None) -> None:
        if ((at_least is not None and value < at_least) or (above is not None and value <= above)
                or (at_most is not None and value > at_most) or (below is not None and value >= below)):
            raise UserError(f"{self.key(name)} must be {_range_text(at_least, above, at_most, below)}"
                            f"{' or null' if optional else ''} (got {value})")

    def number(self, name: str, *, optional: bool = False, at_least: float | None = None,
               above: float | None = None, at_most: float | None = None, below: float | None = None) -> Any:
        """A float within the bounds given (``above``/``below``: strict); ``optional``: null -> None."""
        value = self.value(name)
        if value is None and optional:
            return None
        if not _is_number(value) or not math.isfinite(value):
            raise self._fail(name, "a number", value, optional)
        self._bounded(name, float(value), optional, at_least, above, at_most, below)
        return float(value)

    def integer(self, name: str, *, optional: bool = False, at_least: int | None = None,
                at_most: int | None = None) -> Any:
        """An int (a float only when whole) within the bounds given; ``optional``: null -> None."""
        value = self.value(name)
        if value is None and optional:
            return None
        if not _is_whole(value):
            raise self._fail(name, "an integer", value, optional)
        self._bounded(name, int(value), optional, at_least, None, at_most, None)
        return int(value)

    def flag(self, name: str) -> bool:
        """``true`` or ``false``."""
        value = self.value(name)
        if not isinstance(value, bool):
            raise self._fail(name, "true or false", value, False)
        return value

    def choice(self, name: str, options: Sequence[Any]) -> Any:
        """One of ``options`` (strings, or booleans such as ``auto | true | false``)."""
        value = self.value(name)
        if not any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in options):
            listing = ", ".join(str(o).lower() if isinstance(o, bool) else str(o) for o in options)
            raise self._fail(name, f"one of {listing}", value, False)
        return value

    def _items(self, name: str, what: str, optional: bool, empty: bool = False) -> list[Any] | None:
        """The list at ``name``; ``optional``: null -> None; ``empty``: [] allowed (nothing to do)."""
        value = self.value(name)
        if value is None and optional:
            return None
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not (len(value) or empty):
            raise self._fail(name, f"a non-empty list of {what}", value, optional)
        return list(value)

    def integers(self, name: str, *, optional: bool = False, at_least: int | None = None) -> Any:
        """A non-empty list of ints, each within the bound; ``optional``: null -> None."""
        items = self._items(name, "integers", optional)
        if items is None:
            return None
        if not all(_is_whole(x) for x in items):
            raise self._fail(name, "a non-empty list of integers", items, optional)
        if at_least is not None and min(items) < at_least:
            raise UserError(f"{self.key(name)} must list integers >= {at_least} (got {items})")
        return [int(x) for x in items]

    def numbers(self, name: str, *, optional: bool = False, above: float | None = None,
                at_most: float | None = None, below: float | None = None, empty: bool = False) -> Any:
        """A list of floats, each within the bounds given; ``optional``: null -> None; ``empty``: [] allowed."""
        items = self._items(name, "numbers", optional, empty)
        if items is None:
            return None
        if not all(_is_number(x) and math.isfinite(x) for x in items):
            raise self._fail(name, "a non-empty list of numbers", items, optional)
        if any((above is not None and x <= above) or (at_most is not None and x > at_most)
               or (below is not None and x >= below) for x in items):
            raise UserError(f"{self.key(name)} must list numbers {_range_text(None, above, at_most, below)} "
                            f"(got {items})")
        return [float(x) for x in items]

    def names(self, name: str, *, optional: bool = False) -> Any:
        """A non-empty list of strings (task names, phases); ``optional``: null -> None."""
        items = self._items(name, "names", optional)
        if items is None:
            return None
        if not all(isinstance(x, str) for x in items):
            raise self._fail(name, "a non-empty list of names", items, optional)
        return [str(x) for x in items]


def report_mode(m: Section) -> str:
    """``method.report``: ``artifact`` (what the artifact holds and its headline metrics) or ``full``
    (also the method's report extras: baselines, curves, ablations)."""
    return str(m.choice("report", REPORT_MODES))


def layer_scales(model: Any) -> dict[int, float | None]:
    """Softmax scale per layer (the attention module's ``scaling``; None = 1/sqrt(D))."""
    return {i: (float(a.scaling) if getattr(a, "scaling", None) is not None else None)
            for i, a in attention_modules(model).items()}
