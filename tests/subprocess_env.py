"""Environment for tests that start ``python`` subprocesses."""

from __future__ import annotations

import os


def python_path(*dirs: object) -> str:
    """``dirs`` first, then any inherited ``PYTHONPATH``: packages installed with ``pip --target`` (an
    offline GPU box, README) stay importable in the child."""
    return os.pathsep.join(filter(None, [*map(str, dirs), os.environ.get("PYTHONPATH")]))
