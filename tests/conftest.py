"""Shared fixtures: real models from the store (pulled on demand), loaded once per session."""
from __future__ import annotations

import logging

import pytest

from edgespec.backend import ContextParams, LlamaContext, LlamaModel
from edgespec.store import ModelStore

TARGET = "qwen2.5-coder-1.5b"
DRAFTER = "qwen2.5-coder-0.5b"
SMALL = "smollm2-135m"
GEMMA = "gemma3-270m"


@pytest.fixture(scope="session")
def store() -> ModelStore:
    """The user's store ($EDGESPEC_HOME or ~/.cache/edgespec): `make test` pulls into it."""
    return ModelStore()


@pytest.fixture(scope="session")
def model_path(store):
    """Factory: path of a named model, pulled if missing (idempotent, offline once pulled)."""
    def get(name: str):
        if not store.is_present(name):
            logging.getLogger(__name__).warning("pulling %s for the tests", name)
            store.pull(name)
        return store.resolve(name)
    return get


@pytest.fixture(scope="session")
def small_model(model_path) -> LlamaModel:
    """SmolLM2-135M: fast enough to generate hundreds of tokens in a test."""
    return LlamaModel(model_path(SMALL))


@pytest.fixture(scope="session")
def target_model(model_path) -> LlamaModel:
    return LlamaModel(model_path(TARGET))


@pytest.fixture
def small_ctx(small_model):
    ctx = LlamaContext(small_model, ContextParams(n_ctx=1024, n_seq_max=4))
    yield ctx
    ctx.close()
