"""Memory budgets with the real models: both drafters, drafter dropped, file-backed, refused."""
from __future__ import annotations

import pytest

from conftest import DRAFTER, TARGET
from edgespec import planner
from edgespec.engine import Engine, EngineConfig
from edgespec.errors import BudgetExceeded
from edgespec.generate import GenerationRequest
from edgespec.gguf import read_gguf
from edgespec.memwatch import PeakRSS
from edgespec.sampling import SamplingParams

GREEDY = GenerationRequest(max_tokens=24, sampling=SamplingParams(temperature=0), ignore_eos=True)
CODE = [{"role": "user", "content": "Repeat exactly: def add(a, b):\n    return a + b\n\n"
                                     "def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"}]


def _smallest(model_path, with_drafter: bool) -> int:
    """The planner's smallest resident budget for the target (with or without the drafter)."""
    t = planner.estimate_model(read_gguf(model_path(TARGET)))
    d = planner.estimate_model(read_gguf(model_path(DRAFTER))) if with_drafter else None
    plan = planner.make_plan(t, d, ram_budget=64 << 30, n_ctx=2048, suffix=True, draft_max=16)
    return plan.ram_bytes


def test_budget_fitting_target_and_drafter_uses_both(model_path):
    budget = int(_smallest(model_path, True) * 1.15)
    with Engine(EngineConfig(model=TARGET, n_ctx=2048, draft="hybrid", ram_budget=budget)) as e:
        assert e.placement.draft == "hybrid" and e.drafter.model is not None
        with PeakRSS() as rss:
            done = e.generate_chat(CODE, GREEDY)
        assert done.stats.generated_tokens == 24
    assert rss.peak < budget


def test_budget_between_target_and_both_drops_the_model_drafter(model_path):
    alone, both = _smallest(model_path, False), _smallest(model_path, True)
    assert alone < both
    budget = int(alone * 1.1) if alone * 1.1 < both else (alone + both) // 2
    with Engine(EngineConfig(model=TARGET, n_ctx=2048, draft="hybrid", ram_budget=budget)) as e:
        assert e.placement.draft == "suffix" and e.drafter.name == "suffix"
        assert any("does not fit" in n for n in e.placement.notes)
        with PeakRSS() as rss:
            e.generate_chat(CODE, GREEDY)
    assert rss.peak < budget


def test_budget_below_the_weights_runs_file_backed_under_budget(model_path):
    budget = 600 << 20  # the 1.5B target's weights are 1.06 GiB
    with Engine(EngineConfig(model=TARGET, n_ctx=1024, draft="suffix", ram_budget=budget)) as e:
        assert e.placement.file_backed
        with PeakRSS(interval_s=0.005) as rss:
            done = e.generate_chat(CODE, GREEDY)
        assert done.stats.generated_tokens == 24
        assert e.releaser.releases > 1  # pages really were dropped during the passes
    assert rss.peak < budget, (rss.peak, budget)


def test_budget_below_the_minimum_is_refused_before_loading(model_path):
    with pytest.raises(BudgetExceeded, match="smallest|at least"):
        Engine(EngineConfig(model=TARGET, n_ctx=2048, draft="suffix", ram_budget=100 << 20))
