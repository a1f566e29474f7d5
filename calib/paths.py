"""Where the project's embedded stores live, and whether they can be written.

``CALIB_HOME`` overrides the root (tests point it at a temporary directory); otherwise the root is
the checkout that holds this package, so ``artifacts/`` is found the same way from any working dir.
"""

from __future__ import annotations

import os
from pathlib import Path

from calib.errors import UserError


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


def check_writable_dir(path: Path, what: str, hint: str = "") -> None:
    """A one-line :class:`UserError` unless ``path`` is a directory this process can write, or one it can
    create: every part of ``path`` that exists must be a directory and the deepest one writable.
    ``what`` names the setting in the message (``CALIB_HOME=/x``); ``hint`` says how to fix it."""
    path, deepest = Path(os.path.abspath(path)), None
    for part in [*reversed(path.parents), path]:
        try:
            if not part.is_dir():
                if part.exists():
                    kind = "a file, not" if part.is_file() else "not"
                    raise UserError(f"{what} is not usable: {part} is {kind} a directory{hint}")
                break
        except PermissionError:
            raise UserError(f"{what} is not usable: no permission to look into {part.parent}{hint}") from None
        deepest = part
    if deepest is None or not os.access(deepest, os.W_OK | os.X_OK):
        raise UserError(f"{what} is not writable: cannot create files in {deepest or path.anchor}{hint}")


def check_home() -> None:
    """:func:`check_writable_dir` on :func:`artifacts_dir` (the commands' stores and caches)."""
    env = os.environ.get("CALIB_HOME")
    what = f"CALIB_HOME={env}" if env else f"the project's store {artifacts_dir()}"
    check_writable_dir(artifacts_dir(), what, " (point CALIB_HOME at a writable directory)")
