"""Engine fixtures: the tiny random qwen3_moe (float32) and engines over it."""

from __future__ import annotations

import pytest

from lowbit.config import EngineConfig
from lowbit.engine.engine import LLMEngine
from tests.engine.tiny_model import make_tiny_model


@pytest.fixture(autouse=True, scope="module")
def _single_thread(one_torch_thread):
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="session")
def loaded_tiny(tiny_model):
    """The tiny model loaded once; engines built from it share the weights."""
    return LLMEngine(EngineConfig(model=str(tiny_model), kv_cache_tokens=64)).loaded


@pytest.fixture
def make_engine(tiny_model, loaded_tiny):
    engines = []

    def make(**overrides) -> LLMEngine:
        args = {"kv_cache_tokens": 4096, **overrides}
        engines.append(LLMEngine(EngineConfig(model=str(tiny_model), **args), loaded=loaded_tiny))
        return engines[-1]

    yield make
    for engine in engines:  # an expert cache hooks the shared model's MoE layers: unhook them
        if getattr(engine, "expert_cache", None) is not None:
            engine.expert_cache.detach()
