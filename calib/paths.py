"""Where the project's embedded stores live.

``CALIB_HOME`` overrides the root (tests point it at a temporary directory); otherwise the root is
the checkout that holds this package, so ``artifacts/`` is found the same way from any working dir.
"""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """The directory holding ``conf/`` and ``artifacts/`` (absolute)."""
    return Path(__file__).resolve().parents[1]


def home() -> Path:
    """Root of the embedded stores: ``$CALIB_HOME`` if set, else the project root."""
    env = os.environ.get("CALIB_HOME")
    return Path(env).resolve() if env else project_root()


def artifacts_dir() -> Path:
    """``<home>/artifacts``: the MLflow SQLite store, its artifact store and the collector cache."""
    return home() / "artifacts"


def config_dir() -> Path:
    """The Hydra config directory shipped with the package."""
    return project_root() / "conf"
