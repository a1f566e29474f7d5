"""SANTA tests: make the helper modules beside the tests (santa_checks, synthetic_reward) importable
(the suite runs with --import-mode=importlib, which does not put test folders on sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
