"""Import a script of scripts/research/ as a module, as the tests of those scripts need."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def load_script(name: str) -> ModuleType:
    """``scripts/research/<name>.py`` imported under ``name`` (registered in ``sys.modules`` first: its
    dataclasses resolve their annotations through it); ``scripts/bench`` on the path for its helpers."""
    if str(ROOT / "scripts" / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "research" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
