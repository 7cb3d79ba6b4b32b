"""A bench whose best plain is another load than its speculative configurations': plain runs
first on its own load, the speculative layout's plain decoding runs interleaved as the secondary
`plain-in-layout`, and every ratio is over plain (a real small model, two prompts)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import SMALL

from edgespec.bench import runner
from edgespec.bench.prompts import BenchPrompt
from edgespec.bench.summary import IN_LAYOUT, OVERALL, PLAIN
from edgespec.engine import EngineConfig
from edgespec.load import resolve
from edgespec.memory.machine import machine

GiB = 1 << 30


def test_plain_on_its_own_load_comes_first_and_in_layout_is_secondary(model_path, store, monkeypatch):
    model_path(SMALL)
    settings = runner.BenchSettings(EngineConfig(model=SMALL, n_ctx=512, ram_budget=4 * GiB), max_tokens=8)
    shared, same = runner.load_plans(settings, ["plain", "suffix"], machine(), store)
    assert same is None  # a CPU-only budget: plain's best layout is the speculative one
    # Another layout for plain (here its cache type) stands for a whole target on a GPU.
    alone = resolve(replace(runner.plain_config(settings.engine, machine()), kv_type="q8_0"), machine(), store)
    monkeypatch.setattr(runner, "load_plans", lambda *a, **k: (shared, alone))
    prompts = [BenchPrompt(id=f"p{i}", category="c", text=text, templated=False)
               for i, text in enumerate(["The capital of France is", "def add(a, b):"])]
    result = runner.run_bench(prompts, ["plain", "suffix"], settings)
    configs = [r.config for r in result.records]
    assert configs == [PLAIN, PLAIN, IN_LAYOUT, "suffix", IN_LAYOUT, "suffix"]
    b = result.settings["baseline"]
    assert b["separate_load"] and b["in_layout"] == IN_LAYOUT and b["config"] == PLAIN
    s = result.summary
    assert s[PLAIN][OVERALL]["speedup"] == pytest.approx(1.0)
    assert s["suffix"][OVERALL]["speedup_in_layout"] is not None
    assert s[IN_LAYOUT][OVERALL]["speedup_in_layout"] == pytest.approx(1.0)
    assert all(r.same_as_plain is not None for r in result.records if r.config != PLAIN)


def test_exactness_is_judged_within_the_speculative_layout(model_path, store, monkeypatch):
    """Another layout's kernels may part from it at near-ties, so a speculative answer is compared
    with plain-in-layout's, and plain-in-layout's with plain's."""
    model_path(SMALL)
    settings = runner.BenchSettings(EngineConfig(model=SMALL, n_ctx=512, ram_budget=4 * GiB), max_tokens=8)
    shared, _ = runner.load_plans(settings, ["plain", "suffix"], machine(), store)
    alone = resolve(replace(runner.plain_config(settings.engine, machine()), kv_type="q8_0"), machine(), store)
    monkeypatch.setattr(runner, "load_plans", lambda *a, **k: (shared, alone))
    run_one = runner._run_one

    def marked(engine, runners, p, answers, config, *args):  # plain's load answers otherwise
        rec = run_one(engine, runners, p, answers, config, *args)
        if config == PLAIN:
            rec.text += " [another layout]"
        return rec
    monkeypatch.setattr(runner, "_run_one", marked)
    prompts = [BenchPrompt(id="p0", category="c", text="The capital of France is", templated=False)]
    records = runner.run_bench(prompts, ["plain", "suffix"], settings).records
    by = {r.config: r for r in records}
    assert by[IN_LAYOUT].same_as_plain is False
    assert by["suffix"].same_as_plain == (by["suffix"].text == by[IN_LAYOUT].text)
    assert by["suffix"].same_as_plain  # greedy suffix speculation on the layout plain-in-layout ran on
