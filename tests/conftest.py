"""Shared fixtures: real models from the store (pulled on demand), loaded once per session."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel
from edgespec.files.store import ENV_HOME, ModelStore

TARGET = "qwen2.5-coder-1.5b"
DRAFTER = "qwen2.5-coder-0.5b"
SMALL = "smollm2-135m"
GEMMA = "gemma3-270m"


# Modules none of whose tests load a model into llama.cpp (pure Python and numpy, GGUF files, the
# store's pulls): `make test` runs them first on every core (pytest-xdist, `-m model_free`), then
# the rest one test at a time, since two llama.cpp processes on a 2-core machine slow each other
# down by orders of magnitude. A test here that loads a model fails (see _models_refused).
MODEL_FREE = {"test_acceptance", "test_plumbing", "test_policy", "test_recheck", "test_replay",
              "test_sampling", "test_suffix_index", "test_text", "test_gguf", "test_store",
              "test_cli_models", "test_tree_search", "test_llama_patches", "test_qmatmul"}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.module.__name__ in MODEL_FREE:
            item.add_marker("model_free")


@pytest.fixture(autouse=True)
def _models_refused(request, monkeypatch):
    """In model_free tests, loading a model into llama.cpp is an error, not a slowdown."""
    if request.node.get_closest_marker("model_free"):
        def refuse(self, *args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} is in conftest.MODEL_FREE but loads a model")
        monkeypatch.setattr(LlamaModel, "__init__", refuse)


# Build caches and reports kept in the user's store between sessions: the F32 copy of SmolLM2
# costs a minute to build. Nothing else of the user's store is written by the tests.
_SHARED_DIRS = ("test-cache", "test-reports")
_USER_STORE: list[ModelStore] = []  # the user's store, as found before the session's override


@pytest.fixture(scope="session", autouse=True)
def edgespec_home(tmp_path_factory) -> Path:
    """A temporary store home, $EDGESPEC_HOME for the whole session, holding the user's models.

    Built-in models pulled into the user's store ($EDGESPEC_HOME or ~/.cache/edgespec; `make
    test` pulls them) are hard-linked in (symlinked across file systems) with copies of their
    verification stamps, so calibration and anything else a test writes lands here, and `auto`
    calibrates afresh each session instead of trusting an earlier run's numbers.
    """
    _USER_STORE[:] = [ModelStore()]
    user = _USER_STORE[0]
    home = tmp_path_factory.mktemp("edgespec-home")
    for name in user.manifests():
        if user.is_present(name):
            _link_model(user, name, home)
    for name in _SHARED_DIRS:
        (user.home / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(user.home / name, target_is_directory=True)
    saved = os.environ.get(ENV_HOME)
    os.environ[ENV_HOME] = str(home)
    yield home
    if saved is None:
        os.environ.pop(ENV_HOME, None)
    else:
        os.environ[ENV_HOME] = saved


@pytest.fixture(scope="session")
def store(edgespec_home) -> ModelStore:
    """The session's store (see edgespec_home)."""
    return ModelStore(edgespec_home)


def _link_model(user: ModelStore, name: str, home: Path) -> None:
    src = user.path_for(name)
    dst = home / "models" / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        dst.symlink_to(src)
    stamp = src.with_name(src.name + ".sha256")
    if stamp.exists():
        shutil.copyfile(stamp, dst.with_name(dst.name + ".sha256"))


@pytest.fixture(scope="session")
def model_path(store):
    """Factory: path of a named model, pulled into the user's store if missing, then linked."""
    def get(name: str):
        if not store.is_present(name):
            user = _USER_STORE[0]
            logging.getLogger(__name__).warning("pulling %s for the tests", name)
            user.pull(name)
            _link_model(user, name, store.home)
        return store.resolve(name)
    return get


@pytest.fixture(scope="session")
def small_model(model_path) -> LlamaModel:
    """SmolLM2-135M: fast enough to generate hundreds of tokens in a test."""
    return LlamaModel(model_path(SMALL))


@pytest.fixture(scope="session")
def target_model(model_path) -> LlamaModel:
    return LlamaModel(model_path(TARGET))


@pytest.fixture(scope="session")
def onnx_exact(model_path, tmp_path_factory):
    """One exact ONNX conversion of the drafter for the session, in a store of its own (the
    source GGUF outside it): (store, conversion directory). Tests only read it."""
    pytest.importorskip("onnx")
    from edgespec.onnx.convert import convert

    store = ModelStore(home=tmp_path_factory.mktemp("onnx-store"))
    return store, convert(store, model_path(DRAFTER), "exact")


@pytest.fixture
def small_ctx(small_model):
    ctx = LlamaContext(small_model, ContextParams(n_ctx=1024, n_seq_max=4))
    yield ctx
    ctx.close()
