"""Running a recipe end to end inside a private CALIB_HOME (shared by the methods' recipe tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest


def in_calib_home(home: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the MLflow stores under ``home`` and no inherited tracking URI; ends open runs."""
    import mlflow

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CALIB_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_REGISTRY_URI", raising=False)
        (home / "artifacts").mkdir(parents=True, exist_ok=True)
        try:
            return fn(*args)
        finally:
            while mlflow.active_run() is not None:
                mlflow.end_run()


def run_recipe(home: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """``calib.run.run`` on the composed overrides inside ``home``; the result must be one JSON object."""
    import calib.run
    from calib.config import compose

    result = in_calib_home(home, lambda: calib.run.run(compose(list(overrides))))
    json.dumps(result)
    return result
