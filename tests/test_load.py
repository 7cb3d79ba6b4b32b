"""edgespec.load: one resolution of options, which `plan` prints and the engine loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import SMALL, TARGET
from edgespec.engine import Engine, EngineConfig
from edgespec.errors import BudgetExceeded, InvalidRequest
from edgespec.llama import invariant
from edgespec.load import resolve
from edgespec.memory.machine import machine

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))


def _plan_json(*args: str) -> dict:
    proc = subprocess.run([EDGESPEC, "plan", *args, "--json"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("args,config", [
    (["--draft", "suffix", "--ctx", "1024"], EngineConfig(model=SMALL, draft="suffix", n_ctx=1024)),
    (["--draft", "suffix", "--ctx", "1024", "--ram-budget", "1GiB"],
     EngineConfig(model=SMALL, draft="suffix", n_ctx=1024, ram_budget=1 << 30)),
    (["--draft", "none", "--ctx", "512", "--placement", "cpu", "--kv-type", "q8_0"],
     EngineConfig(model=SMALL, draft="none", n_ctx=512, placement="cpu", kv_type="q8_0")),
])
def test_plan_prints_what_the_engine_loads(store, args, config):
    """`edgespec plan` with run's options prints the parameters the engine hands llama.cpp."""
    printed = _plan_json("-m", SMALL, *args)
    with Engine(config, store) as engine:
        loaded = engine.load_plan
        assert engine.model.params == loaded.model and engine.ctx.params == loaded.context
        assert engine.ctx.n_ctx == config.n_ctx
    assert printed["model_params"] == json.loads(json.dumps(asdict(loaded.model)))  # tuples print as lists
    assert printed["context_params"] == json.loads(json.dumps(asdict(loaded.context)))
    assert (printed["draft"], printed["draft_max"], printed["draft_tree"]) == \
        (loaded.draft, loaded.shape.draft_max, loaded.shape.tree)
    assert (printed["placement"] is None) == (not config.planned)


def test_resolving_loads_and_writes_nothing(store, tmp_path):
    """The resolution reads metadata and caches only: no model is loaded, no file is written."""
    before = sorted(p for p in store.home.rglob("*") if not p.is_symlink())
    stamps = {p: p.stat().st_mtime_ns for p in before if p.is_file()}
    plan = resolve(EngineConfig(model=TARGET, draft="auto", ram_budget=3 << 30), machine(), store)
    assert plan.plan is not None and plan.mode is not None
    after = sorted(p for p in store.home.rglob("*") if not p.is_symlink())
    assert after == before and all(p.stat().st_mtime_ns == t for p, t in stamps.items())


def test_refusals_come_before_loading(store):
    """A context beyond the trained one and a budget nothing fits are refused by the plan."""
    with pytest.raises(InvalidRequest, match="trained context"):
        resolve(EngineConfig(model=SMALL, n_ctx=1 << 20), machine(), store)
    with pytest.raises(BudgetExceeded, match="smallest plan needs"):
        resolve(EngineConfig(model=TARGET, ram_budget=64 << 20), machine(), store)


def test_the_bench_and_the_engine_place_drafters_alike(store, monkeypatch):
    """The plan's draft_config is the one rule: a planned drafter gets the plan's placement, an
    unplanned one the defaults; exact mode makes every drafter propose chains."""
    planned = resolve(EngineConfig(model=TARGET, draft="auto", ram_budget=8 << 30, placement="cpu"), machine(), store)
    cfg = planned.draft_config("model", planned.shape)
    assert (cfg.allow_model, cfg.allow_onnx, cfg.model_params) == \
        (planned.drafter.model_allowed, False, planned.drafter.model_params)
    monkeypatch.delenv(invariant.TILED_MM_ENV, raising=False)  # exact mode's switch, restored after
    as_asked = resolve(EngineConfig(model=TARGET, draft="suffix", exact=True), machine(), store)
    cfg = as_asked.draft_config()
    assert cfg.kind == "suffix" and cfg.chains and cfg.model_params is None and cfg.allow_onnx


def test_the_suffix_index_drafts_trees_only_where_the_plan_does(store):
    """A tree's accepted tokens sit in cache cells out of position order, which parts answers
    from plain decoding's: a CPU target's suffix index drafts chains unless --draft-tree."""
    def chains(**kw) -> bool:
        return resolve(EngineConfig(model=TARGET, draft="suffix", **kw), machine(), store).draft_config().chains
    assert chains(placement="cpu")
    assert not chains(placement="cpu", draft_tree=True)
