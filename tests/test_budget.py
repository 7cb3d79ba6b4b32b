"""Memory budgets with the real models: both drafters, drafter dropped, file-backed, refused.

Each scenario runs in a fresh interpreter: resident memory is a property of the process, and
a test process that already loaded other models keeps some of that memory mapped.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import DRAFTER, TARGET

from edgespec.files.modelfile import model_file

from edgespec.memory.footprint import footprint_of
from edgespec.memory import planner

SCENARIO = textwrap.dedent('''
    import json, sys
    from edgespec.engine import Engine, EngineConfig
    from edgespec.errors import BudgetExceeded
    from edgespec.decode.request import GenerationRequest
    from edgespec.memory.rss import PeakRSS
    from edgespec.decode.sampling import SamplingParams
    budget, draft, n_ctx, max_tokens = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    msgs = [{"role": "user", "content": "Repeat exactly: def add(a, b):\\n    return a + b\\n\\n"
             "def sub(a, b):\\n    return a - b\\n\\ndef mul(a, b):\\n    return a * b\\n"}]
    req = GenerationRequest(max_tokens=max_tokens, sampling=SamplingParams(temperature=0), ignore_eos=True)
    try:
        engine = Engine(EngineConfig(model=%r, n_ctx=n_ctx, draft=draft, ram_budget=budget))
    except BudgetExceeded as exc:
        print(json.dumps({"refused": str(exc)}))
        sys.exit(0)
    with engine:
        with PeakRSS(interval_s=0.005) as rss:
            done = engine.chat(msgs, req)
        p = engine.load_plan
        print(json.dumps({"peak": rss.peak, "tokens": done.stats.generated_tokens, "draft": p.draft,
                          "drafter": engine.drafter.name, "has_model": getattr(engine.drafter, "model", None)
                          is not None, "notes": list(p.notes), "file_backed": p.file_backed,
                          "releases": engine.releaser.releases if engine.releaser else 0,
                          "plan_flash_attn": p.plan.flash_attn, "ctx_flash_attn": engine.ctx.params.flash_attn,
                          "plan_kv": p.plan.parts and [x.bytes for x in p.plan.parts if x.component == "target KV cache"][0],
                          "ctx_kv": engine.ctx.kv_bytes()}))
''' % TARGET)


# Tokens per answer: the peak is reached by the load and the first passes (at 12 tokens and at 24
# the same 0.87 of the file-backed budget and 0.85 of the budget for both models, here), and a
# file-backed load drops pages ~20 times over 12.
TOKENS = 12


def run_scenario(budget: int, draft: str, n_ctx: int = 2048, max_tokens: int = TOKENS) -> dict:
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(budget), draft, str(n_ctx), str(max_tokens)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _smallest(model_path, with_drafter: bool) -> int:
    """The planner's smallest resident budget for the target (with or without the drafter)."""
    t = footprint_of(model_file(model_path(TARGET)))
    d = footprint_of(model_file(model_path(DRAFTER))) if with_drafter else None
    plan = planner.make_plan(t, d, ram_budget=64 << 30, n_ctx=2048, suffix=True, draft_max=16)
    return plan.ram_bytes


# The two budgeted loads of the hybrid drafter, each run once for the module: one fits the
# target and the drafter model, one only the target (its drafter is dropped).
@pytest.fixture(scope="module")
def budget_both(model_path) -> tuple[int, dict]:
    budget = int(_smallest(model_path, True) * 1.15)
    return budget, run_scenario(budget, "hybrid")


@pytest.fixture(scope="module")
def budget_between(model_path) -> tuple[int, dict]:
    alone, both = _smallest(model_path, False), _smallest(model_path, True)
    assert alone < both
    budget = int(alone * 1.1) if alone * 1.1 < both else (alone + both) // 2
    return budget, run_scenario(budget, "hybrid")


def test_a_budgeted_load_builds_what_the_plan_planned(budget_both, budget_between):
    # The planner asks for the attention kernel instead of assuming it: on the CPU with an f16
    # cache the engine turns flash attention on with edgespec's kernels and off without them
    # (edgespec.llama.kernels), and so must the plan. Read off the budgeted loads below, with
    # and without the drafter model.
    from edgespec.llama.backend import qmatmul_loaded

    for _, r in (budget_both, budget_between):
        assert r["ctx_flash_attn"] is qmatmul_loaded() and r["plan_flash_attn"] is qmatmul_loaded()
        assert r["plan_kv"] == r["ctx_kv"]


def test_budget_fitting_target_and_drafter_uses_both(budget_both):
    budget, r = budget_both
    assert r["draft"] == "hybrid" and r["has_model"]
    assert r["tokens"] == TOKENS
    assert r["peak"] < budget, r


def test_budget_between_target_and_both_drops_the_model_drafter(budget_between):
    budget, r = budget_between
    assert r["draft"] == "suffix" and r["drafter"] == "suffix"
    assert any("does not fit" in n for n in r["notes"])
    assert r["peak"] < budget, r


def test_budget_below_the_weights_runs_file_backed_under_budget(model_path):
    budget = 600 << 20  # the 1.5B target's weights are 1.06 GiB
    r = run_scenario(budget, "suffix", n_ctx=1024)
    assert r["file_backed"] and r["tokens"] == TOKENS
    assert r["releases"] > 1  # pages really were dropped during the passes
    assert r["peak"] < budget, r


def test_budget_below_the_minimum_is_refused_before_loading(model_path):
    r = run_scenario(100 << 20, "suffix")
    assert "refused" in r and ("smallest" in r["refused"] or "at least" in r["refused"])


def test_drafter_model_is_allowed_only_where_the_plan_counted_it(model_path, store):
    from edgespec.engine import EngineConfig
    from edgespec.load import resolve
    from edgespec.memory.machine import machine

    target = str(model_path(TARGET))
    model_path(DRAFTER)
    common = dict(model=target, n_ctx=2048, draft_max=32, draft_tree=False, n_seq_max=33)

    def placement(budget, **options):
        return resolve(EngineConfig(ram_budget=budget, **{**common, **options}), machine(), store)
    roomy = 64 << 30
    assert placement(roomy, draft="auto").model_drafter_allowed
    # Planned for the suffix drafter alone: an `auto` built on this placement (the bench's
    # case) must not load the drafter model on top of the budget.
    assert not placement(roomy, draft="suffix").model_drafter_allowed
    tight = placement(600 << 20, draft="auto")
    assert tight.file_backed and not tight.model_drafter_allowed and tight.draft == "auto"
    # `model` whose drafter does not fit drafts with the suffix drafter, planned: its index and
    # a target context with a sequence per draft path
    swapped = placement(1400 << 20, draft="model", draft_max=None, draft_tree=None, n_seq_max=1)
    assert (swapped.draft, swapped.plan.draft_max, swapped.context.n_seq_max) == ("suffix", 32, 33)
    assert swapped.drafter.suffix_cap_tokens > 0 and swapped.plan.suffix_drafter


def test_a_planned_load_that_drops_the_drafter_counts_it_where_the_rule_read(model_path, tmp_path):
    """auto_skips_drafter reads the drafter's measured gain under the key of the plan *with*
    it; the target planned anew without it (here 29 GPU layers instead of 18) learns under
    another, so the load counts the request under the first (REPROBE_AFTER), once."""
    from test_planner import GiB, MiB, gpu_machine

    from edgespec.drafters.auto.memory import PolicyMemory, drafter_key
    from edgespec.files.store import ModelStore
    from edgespec.load.drafter import left_out, target_key

    target, drafter = str(model_path(TARGET)), str(model_path(DRAFTER))
    t, d = planner.estimate_model(target), planner.estimate_model(drafter)
    m = gpu_machine(16 * GiB)
    beside = planner.make_plan(t, d, 8 * GiB, 1500 * MiB, 4096, machine_info=m, placement="offload")
    alone = planner.make_plan(t, None, 8 * GiB, 1500 * MiB, 4096, machine_info=m)
    assert beside.n_gpu_layers < alone.n_gpu_layers
    home = ModelStore(tmp_path).home
    left_out(beside, alone, target, drafter).record(home)
    left_out(beside, beside, target, drafter).record(home)  # the same key: its AutoDrafter counts
    memory = PolicyMemory(home, target_key(beside, target))
    assert memory.load()["sat_out"] == {drafter_key(drafter, beside.draft_tree): 1}
    # Trees that measured a loss: the rule read the chain name, and the trees sat out too.
    assert beside.draft_tree
    memory.save({}, drafter_key(drafter, True), [[1.0, 1.0]], gain_state=[50.0, 100.0])
    left_out(beside, alone, target, drafter).record(home)
    assert memory.load()["sat_out"] == {drafter_key(drafter, True): 1, drafter_key(drafter): 1}


def test_a_planned_load_keeps_a_drafter_whose_trees_lost_for_its_chains(model_path, tmp_path):
    """auto_skips_drafter asks the name `auto` will draft under (draft_shape_name): trees that
    measured a loss leave the drafter its chains, which carry their own gain; chains that lost
    too leave it out."""
    import json

    from test_planner import GiB, MiB, gpu_machine

    from edgespec.drafters.auto.calibrate import (
        calibration_key,
        draft_path,
        verify_path,
    )
    from edgespec.drafters.auto.memory import PolicyMemory, drafter_key
    from edgespec.drafters.model import ModelDrafter
    from edgespec.files.store import ModelStore
    from edgespec.llama.backend import default_threads
    from edgespec.load.drafter import auto_skips_drafter, drafter_model_params, target_key

    target, drafter = str(model_path(TARGET)), str(model_path(DRAFTER))
    t, d = planner.estimate_model(target), planner.estimate_model(drafter)
    plan = planner.make_plan(t, d, 8 * GiB, 1500 * MiB, 4096, machine_info=gpu_machine(16 * GiB))
    assert plan.draft_tree
    store = ModelStore(tmp_path)
    key = target_key(plan, target)
    verify_path(store.home, key).parent.mkdir(parents=True, exist_ok=True)
    verify_path(store.home, key).write_text(json.dumps({"batch_sizes": [1, 8, 64], "verify_s": [0.1, 0.11, 0.2]}))
    dkey = calibration_key(drafter, drafter_model_params(plan), plan.threads or default_threads(),
                           ModelDrafter.context_params(plan.n_ctx).flash_attn)
    draft_path(store.home, dkey).write_text(json.dumps({"draft_token_s": 0.002}))
    memory = PolicyMemory(store.home, key)
    skips = lambda: auto_skips_drafter(plan, target, drafter, store)  # noqa: E731
    assert skips() is None  # nothing measured: the prior pays at 2 ms a token
    memory.save({}, drafter_key(drafter, True), [[1.0, 1.0]], gain_state=[50.0, 100.0])
    assert skips() is None  # trees lost: chains, unmeasured, still pay
    memory.save({}, drafter_key(drafter), [[1.0, 1.0]], gain_state=[50.0, 100.0])
    assert "not loaded" in skips()
    memory.save({}, drafter_key(drafter, True), [[1.0, 1.0]], gain_state=[150.0, 100.0])
    assert skips() is None  # trees that pay: their name is the one read
