"""Random small checkpoints of both supported families, written once per session (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from calib.models import write_random_checkpoint
from tests.models.helpers import LLAMA_ARCH, QWEN2_ARCH


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("llama"), "llama", LLAMA_ARCH, seed=1)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", QWEN2_ARCH, seed=2)


@pytest.fixture
def private_home(tmp_path, monkeypatch) -> Path:
    """CALIB_HOME in a temp dir (the weight-hash sidecar lives under it) and an empty HF cache."""
    monkeypatch.setenv("CALIB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "home"
