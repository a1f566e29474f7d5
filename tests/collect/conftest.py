"""In-memory random models (Llama with Llama-3 RoPE scaling, Qwen2) wrapped as LoadedModel."""

from __future__ import annotations

import pytest

from calib.models import LoadedModel, loaded_from_model, random_model
from tests.models.helpers import LLAMA_ARCH, QWEN2_ARCH


@pytest.fixture(scope="session")
def llama() -> LoadedModel:
    return loaded_from_model(random_model("llama", LLAMA_ARCH, seed=3), name="rand-llama", family="llama",
                             model_hash="sha256:rand-llama-3")


@pytest.fixture(scope="session")
def qwen2() -> LoadedModel:
    return loaded_from_model(random_model("qwen2", QWEN2_ARCH, seed=4), name="rand-qwen2", family="qwen2",
                             model_hash="sha256:rand-qwen2-4")


@pytest.fixture(scope="session")
def llama_eager() -> LoadedModel:
    return loaded_from_model(random_model("llama", LLAMA_ARCH, seed=3, attn_implementation="eager"),
                             name="rand-llama", family="llama", model_hash="sha256:rand-llama-3")
