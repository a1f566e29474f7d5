"""Shared pytest setup: skip `gpu` tests without CUDA; isolate the embedded stores per test session."""

from __future__ import annotations

import os

import pytest


# Triton kernels run on the CPU under Triton's interpreter when there is no GPU (CI), so a kernel
# regression fails CI too. The variable is read when a kernel module is imported (``@triton.jit``), so it
# must be set before collection imports any of them; a CUDA machine compiles the kernels normally.
def _cuda_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (the README runs ``-n 2``) each worker gets its share of the cores for torch's
    intra-op threads. The default run on this project's 2-core machine (2026-11-26): 778 s serial,
    491 s with ``-n 2`` and torch's default threads, 434 s with one thread per worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_cores_between_workers()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_present():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def calib_home(tmp_path, monkeypatch):
    """A private CALIB_HOME (MLflow SQLite store + artifact store) and no inherited tracking URI."""
    monkeypatch.setenv("CALIB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    (tmp_path / "home" / "artifacts").mkdir(parents=True)
    yield tmp_path / "home"
    try:
        import mlflow

        while mlflow.active_run() is not None:
            mlflow.end_run()
    except ImportError:
        pass


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    yield
