"""The typed getters every recipe's settings builder reads its config with (calib/recipe_settings.py)."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from calib.errors import UserError
from calib.recipe_settings import Section, report_mode

NODE = OmegaConf.create({
    "n": 3, "whole": 4.0, "half": 2.5, "flag": True, "text": "abc", "none": None, "nan": math.nan,
    "ints": [1, 2, 3], "floats": [0.5, 1], "empty": [], "mode": "auto", "tasks": ["a", "b"],
    "missing": "???", "broken": "${no.such.key}", "group": {"x": 1}, "report": "full",
})
S = Section(NODE, "method.part")


def error(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_integers_and_numbers_with_bounds():
    assert S.integer("n", at_least=3, at_most=3) == 3 and S.integer("whole") == 4
    assert S.number("half", above=2, below=3) == 2.5 and isinstance(S.number("n"), float)
    assert S.integer("none", optional=True) is None and S.number("none", optional=True) is None
    assert error(S.integer, "n", at_least=4) == "method.part.n must be >= 4 (got 3)"
    assert error(S.integer, "n", at_least=0, at_most=2) == "method.part.n must be in [0, 2] (got 3)"
    assert error(S.number, "half", above=0, at_most=1) == "method.part.half must be in (0, 1] (got 2.5)"
    assert error(S.number, "half", at_least=0, below=2.5) == "method.part.half must be in [0, 2.5) (got 2.5)"
    assert error(S.number, "half", above=2.5) == "method.part.half must be > 2.5 (got 2.5)"
    assert error(S.integer, "n", optional=True, at_least=5) == "method.part.n must be >= 5 or null (got 3)"


def test_wrong_types_are_named_with_the_value():
    assert error(S.integer, "half") == "method.part.half must be an integer (got 2.5)"
    assert error(S.integer, "flag") == "method.part.flag must be an integer (got True)"  # a bool is no number
    assert error(S.number, "text") == "method.part.text must be a number (got 'abc')"
    assert error(S.number, "nan").startswith("method.part.nan must be a number")
    assert error(S.integer, "nan").startswith("method.part.nan must be an integer")
    assert error(S.integer, "none") == "method.part.none must be an integer (got None)"
    assert error(S.flag, "n") == "method.part.n must be true or false (got 3)"
    assert S.flag("flag") is True


def test_choices_tell_booleans_from_strings():
    assert S.choice("mode", ("auto", True, False)) == "auto" and S.choice("flag", ("auto", True, False)) is True
    assert error(S.choice, "n", ("auto", True, False)) == "method.part.n must be one of auto, true, false (got 3)"
    assert error(S.choice, "flag", (1, 2)) == "method.part.flag must be one of 1, 2 (got True)"  # True is not 1
    assert report_mode(S) == "full"


def test_lists():
    assert S.integers("ints", at_least=1) == [1, 2, 3] and S.numbers("floats", above=0) == [0.5, 1.0]
    assert S.names("tasks") == ["a", "b"] and S.names("none", optional=True) is None
    assert error(S.integers, "ints", at_least=2) == "method.part.ints must list integers >= 2 (got [1, 2, 3])"
    assert error(S.numbers, "floats", above=0, below=1) == \
        "method.part.floats must list numbers in (0, 1) (got [0.5, 1])"
    assert error(S.integers, "floats") == "method.part.floats must be a non-empty list of integers (got [0.5, 1])"
    assert error(S.integers, "empty").startswith("method.part.empty must be a non-empty list of integers")
    assert error(S.names, "text") == "method.part.text must be a non-empty list of names (got 'abc')"
    assert error(S.names, "ints", optional=True).endswith("must be a non-empty list of names or null (got [1, 2, 3])")


def test_absent_missing_and_unresolvable_keys():
    assert error(S.value, "nope") == "method.part.nope is not set: add it to the config"
    assert error(S.integer, "missing") == "method.part.missing is not set: add it to the config"
    assert error(S.value, "broken").startswith("method.part.broken cannot be read: ")
    assert S.section("group").integer("x") == 1 and S.section("group").path == "method.part.group"
    assert error(S.section, "n") == "method.part.n must be a group of settings (got 3)"
