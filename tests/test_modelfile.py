"""A model file is parsed once per process: budget, backend, drafters and vocabulary check share it."""
from __future__ import annotations

import os
import shutil

from conftest import SMALL
from edgespec.engine import Engine, EngineConfig
from edgespec.files import gguf, modelfile


def test_a_file_is_read_once_until_it_changes(model_path, tmp_path):
    copy = tmp_path / "m.gguf"
    shutil.copyfile(model_path(SMALL), copy)
    first = modelfile.model_file(copy)
    assert modelfile.model_file(str(copy)) is first
    assert first.fingerprint == gguf.tokenizer_fingerprint(gguf.read_gguf(copy))
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert modelfile.model_file(copy) is not first  # a changed file is read again


def test_building_a_budgeted_engine_with_a_drafter_parses_each_file_once(model_path, monkeypatch):
    reads: list[str] = []
    real = modelfile.read_gguf

    def counting(path):
        reads.append(os.path.realpath(path))
        return real(path)

    monkeypatch.setattr(modelfile, "read_gguf", counting)
    modelfile._cached.cache_clear()
    path = str(model_path(SMALL))
    cfg = EngineConfig(model=path, n_ctx=512, draft="model", draft_model=path, ram_budget=4 << 30)
    with Engine(cfg) as engine:
        assert engine.drafter is not None and engine.drafter.name == "model"
    assert reads == [os.path.realpath(path)]
