"""`auto` loads only a drafter that can pay: priced from the calibration cache, before loading."""
from __future__ import annotations

import json

import pytest
from conftest import SMALL

from edgespec.decode.request import GenerationRequest
from edgespec.drafters.auto.policy import CostModel, RatioEstimate
from edgespec.drafters.auto.select import DrafterOption, cheapest_paying, choose, pays
from edgespec.engine import Engine, EngineConfig

# A target whose verification grows slowly with the batch: 100 ms for one token, 104 for two.
VERIFY = CostModel((1, 2, 4, 8, 16, 32, 64), (0.100, 0.104, 0.108, 0.116, 0.132, 0.164, 0.228))


def test_a_drafter_pays_only_if_its_tokens_cost_less_than_what_they_save():
    assert pays(VERIFY, 0.010, budget=8)  # 10 ms a token against 100 ms a step
    assert not pays(VERIFY, 0.120, budget=8)  # a token costs more than a target step
    # Before any evidence a drafter is priced on typical chains sized by their confidence
    # (policy.PRIOR_CHAIN_LENGTHS at 0.9 a token) against a plain step with a 10% margin: at
    # 50 ms a token their chains gain 1.10x, at 80 ms 0.94x.
    assert pays(VERIFY, 0.050, budget=8) and not pays(VERIFY, 0.080, budget=8)


def test_a_drafter_left_out_within_its_noise_is_measured_again(tmp_path):
    """A measured loss within 1/sqrt(den) of even is forgotten after REPROBE_AFTER requests
    without the drafter (the load rule then asks its prior); a clear loss is kept."""
    from edgespec.drafters.auto.memory import REPROBE_AFTER, PolicyMemory

    near, clear = PolicyMemory(tmp_path, "near"), PolicyMemory(tmp_path, "clear")
    near.save({}, "d", [[1.0, 1.0]], gain_state=[76.0, 77.0])  # 0.99 > 1 - 1/sqrt(77) = 0.886
    clear.save({}, "d", [[1.0, 1.0]], gain_state=[63.0, 100.0])  # 0.63 < 0.90
    for k in range(REPROBE_AFTER):
        assert near.drafter_gain("d") == [76.0, 77.0] and clear.drafter_gain("d") == [63.0, 100.0], k
        near.save({}, "d", None)  # a request without the drafter loaded
        clear.save({}, "d", None)
    assert near.drafter_gain("d") is None and clear.drafter_gain("d") == [63.0, 100.0]
    near.save({}, "d", [[1.0, 1.0]], gain_state=[80.0, 90.0])  # loaded again: the count restarts
    assert near.drafter_gain("d") == [80.0, 90.0]


def test_cheapest_paying_drafter_wins_and_none_when_none_pays():
    assert cheapest_paying({"model": 0.030, "onnx": 0.020}, VERIFY, 8) == "onnx"
    assert cheapest_paying({"model": 0.030, "onnx": 0.500}, VERIFY, 8) == "model"
    assert cheapest_paying({"model": 0.200, "onnx": 0.500}, VERIFY, 8) is None
    assert cheapest_paying({}, VERIFY, 8) is None


class _Loads:
    """Counts loads and closes of named drafters that cost ``cost`` seconds a token."""

    def __init__(self):
        self.loaded, self.closed = [], []

    def option(self, name: str, cost: float) -> DrafterOption:
        def load():
            self.loaded.append(name)
            return _Closable(name, self.closed)
        return DrafterOption(name, f"key-{name}-{cost}", load, lambda d: cost)


class _Closable:
    def __init__(self, name, closed):
        self.name, self._closed = name, closed

    def close(self):
        self._closed.append(self.name)

    def begin(self, prompt, sampling=None, rng=None):
        pass

    def end(self):
        pass


def test_choose_measures_once_then_loads_only_the_winner(tmp_path):
    first = _Loads()
    drafter, cost = choose([first.option("model", 0.03), first.option("onnx", 0.02)], VERIFY, tmp_path, 8)
    assert drafter.name == "onnx" and cost == 0.02
    assert first.loaded == ["model", "onnx"] and first.closed == ["model"]  # measured both, kept one
    again = _Loads()
    drafter, _ = choose([again.option("model", 0.03), again.option("onnx", 0.02)], VERIFY, tmp_path, 8)
    assert drafter.name == "onnx" and again.loaded == ["onnx"] and again.closed == []


def test_choose_loads_nothing_once_it_knows_nothing_pays(tmp_path):
    first = _Loads()
    assert choose([first.option("model", 0.2)], VERIFY, tmp_path, 8) == (None, 0.0)
    assert first.loaded == ["model"] and first.closed == ["model"]  # measured, then released
    again = _Loads()
    assert choose([again.option("model", 0.2)], VERIFY, tmp_path, 8) == (None, 0.0)
    assert again.loaded == []  # the cache says it cannot pay: never loaded


def test_a_shared_drafter_is_never_closed(tmp_path):
    loads = _Loads()
    shared = DrafterOption("model", "k", lambda: _Closable("model", loads.closed), lambda d: 0.2, owned=False)
    assert choose([shared], VERIFY, tmp_path, 8) == (None, 0.0)
    assert loads.closed == []


# -- real llama.cpp: the engine and `plan` act on the cached verdict ------------------------------
# A store of the module's own: its tests doctor the calibration cache, which the session's other
# tests must not read. A short context and drafts of up to 8 tokens keep its calibrations small
# (~240 tokens of context and batches of up to 9 instead of 512 and 33); what is under test is
# what the engine does with the cached verdict, whatever the curve.
N_CTX, DRAFT_MAX = 256, 8


@pytest.fixture(scope="module")
def own_store(tmp_path_factory):
    from edgespec.files.store import ModelStore

    return ModelStore(tmp_path_factory.mktemp("auto-select-home"))


def _set_draft_costs(home, seconds: float) -> int:
    """Doctors every cached cost: drafted tokens cost ``seconds``, any verification 10 ms."""
    files = list((home / "calibration").glob("draft-*.json"))
    for f in files:
        f.write_text(json.dumps({"draft_token_s": seconds}))
    for f in (home / "calibration").glob("verify-*.json"):
        sizes = json.loads(f.read_text())["batch_sizes"]
        f.write_text(json.dumps({"batch_sizes": sizes, "verify_s": [0.010] * len(sizes)}))
    return len(files)


@pytest.mark.parametrize("seconds, loaded", [(10.0, False), (0.0, True)])
def test_engine_loads_the_drafter_only_when_its_calibration_pays(seconds, loaded, own_store, model_path):
    small = str(model_path(SMALL))
    cfg = EngineConfig(model=small, n_ctx=N_CTX, draft="auto", draft_model=small, draft_max=DRAFT_MAX)
    with Engine(cfg, store=own_store) as engine:  # measures (or finds) this configuration's costs
        assert engine.drafter.cost.verify_s
    assert _set_draft_costs(own_store.home, seconds) >= 1
    with Engine(cfg, store=own_store) as engine:
        assert (engine.drafter.model is not None) is loaded
        done = engine.generate("Repeat: a b c a b c a b c", GenerationRequest(max_tokens=8, ignore_eos=True))
        assert done.stats.generated_tokens == 8


def test_a_planned_load_leaves_out_a_drafter_that_cannot_pay_and_says_so(own_store, model_path):
    small = str(model_path(SMALL))
    cfg = EngineConfig(model=small, n_ctx=N_CTX, draft="auto", draft_model=small, draft_max=DRAFT_MAX,
                       ram_budget=4 << 30)
    with Engine(cfg, store=own_store) as engine:  # this plan's placement: its costs measured (or found)
        assert engine.load_plan.plan.drafter_placement != "none"
    assert _set_draft_costs(own_store.home, 10.0) >= 1
    with Engine(cfg, store=own_store) as engine:
        assert engine.drafter.model is None
        assert engine.load_plan.plan.drafter_placement == "none"  # not counted either
        assert any("auto: the drafter model is not loaded" in n for n in engine.load_plan.notes)


def test_the_gain_measured_here_overrides_the_prior():
    assert pays(VERIFY, 0.010, 8) and not pays(VERIFY, 0.010, 8, learned=[9.0, 10.0])  # its steps lost here
    assert not pays(VERIFY, 0.120, 8) and pays(VERIFY, 0.120, 8, learned=[12.0, 10.0])  # they won, dear or not
    assert cheapest_paying({"model": 0.010}, VERIFY, 8, learned=[9.0, 10.0]) is None


def test_what_auto_learned_is_kept_across_requests_scaled_down(tmp_path):
    from edgespec.drafters.auto.drafter import AutoDrafter
    from edgespec.drafters.auto.memory import CARRY_WEIGHT, PolicyMemory
    from edgespec.drafters.suffix import SuffixDrafter

    memory = PolicyMemory(tmp_path, "placement-key")
    assert memory.drafter_gain("d.gguf") is None and memory.load() == {}  # nothing measured yet
    first = AutoDrafter(SuffixDrafter(), VERIFY, model=_Closable("d", []), memory=memory, model_name="d.gguf")
    for _ in range(40):  # a drafter whose first token is always right and second never
        first.model_acceptance.update(2, 1)
    first.model_gain = RatioEstimate(1.0, weight=1.0)
    first.model_gain.update(10.0, 30.0)  # its steps emitted a third of what the suffix draft would have
    first.suffix_calibration[12].num[0], first.suffix_calibration[12].den[0] = 30.0, 40.0
    first.suffix.begin([1, 2, 3])
    first.end()
    assert memory.drafter_gain("d.gguf") == pytest.approx([10.98, 30.98])
    assert not pays(VERIFY, 0.010, 8, memory.drafter_gain("d.gguf"))  # the next load leaves it out
    second = AutoDrafter(SuffixDrafter(), VERIFY, model=_Closable("d", []), memory=memory, model_name="d.gguf")
    alphas = second.model_acceptance.alphas()
    assert alphas[0] > 0.95 and alphas[1] < 0.1
    carried = second.model_acceptance.rates[0]
    assert carried.den == pytest.approx(CARRY_WEIGHT)  # evidence scaled: a new request can move it
    assert second.model_gain.state() == pytest.approx([10.98 * CARRY_WEIGHT / 30.98, CARRY_WEIGHT])
    cal = second.suffix_calibration[12]
    assert (cal.num[0], cal.den[0]) == pytest.approx((30.0 * CARRY_WEIGHT / 40.0, CARRY_WEIGHT))
    # Another placement learns apart.
    assert PolicyMemory(tmp_path, "other-key").drafter_gain("d.gguf") is None


def test_hybrid_takes_the_cheaper_runtime_of_its_drafter_model(tmp_path):
    from edgespec.drafters.auto.select import cheapest

    first = _Loads()
    assert cheapest([first.option("model", 0.039), first.option("onnx", 0.034)], tmp_path).name == "onnx"
    assert first.loaded == ["model", "onnx"] and first.closed == ["model"]
    again = _Loads()
    assert cheapest([again.option("model", 0.039), again.option("onnx", 0.034)], tmp_path).name == "onnx"
    assert again.loaded == ["onnx"]  # priced from the cache: only the winner loads
    only = _Loads()
    assert cheapest([only.option("model", 9.9)], tmp_path).name == "model"  # one runtime: no measuring
    assert cheapest([], tmp_path) is None


def test_trees_that_measured_a_loss_leave_the_drafter_drafting_chains(tmp_path):
    """draft_shape_name, asked at every request: where the tree name measured a loss and the
    chain name nothing, `auto` loads the drafter for chains (their prior pays at these costs),
    drafts no tree, and counts each request as one the trees sat out; the same AutoDrafter (an
    Engine serves many requests) drafts trees again once their re-probe is due."""
    from edgespec.drafters.auto.memory import REPROBE_AFTER, PolicyMemory, drafter_key
    from edgespec.drafters.auto.policy import TreeSizes
    from edgespec.drafters.model import TREE_SIZES
    from replay import MachineCosts, ReplaySettings, _auto, curve

    costs = MachineCosts("offload-like", ((512, VERIFY),), curve({1: 2.0, 8: 3.0, 64: 8.0}, 1e-3))
    memory = PolicyMemory(tmp_path, "replay")
    trees, chains = drafter_key("model", True), drafter_key("model")
    memory.save({}, trees, [[1.0, 1.0]], gain_state=[95.0, 100.0])  # a loss within 1/sqrt(100)
    model = _Closable("model", [])
    model.tree, model.sizes = True, TreeSizes(TREE_SIZES)
    auto = _auto(model, None, costs, ReplaySettings(draft_max=63), memory, tree=True)
    for k in range(REPROBE_AFTER):
        auto.begin([1, 2, 3])
        assert auto.model is model and auto.model_name == chains and not auto.trees, k
        assert auto._tree_choice(63) == (0, 0.0)
        auto.end()
        assert memory.load()["sat_out"] == {trees: k + 1, chains: 0}
    auto.begin([1, 2, 3])  # the trees' re-probe is due
    assert auto.model_name == trees and auto.trees and auto._tree_choice(63)[0] > 0
    auto.end()
    assert memory.load()["sat_out"] == {trees: 0, chains: 0}
    memory.save({}, trees, [[1.0, 1.0]], gain_state=[150.0, 100.0])  # trees that pay keep trees
    memory.save({}, chains, [[1.0, 1.0]], gain_state=[30.0, 100.0])
    auto = _auto(model, None, costs, ReplaySettings(draft_max=63), memory, tree=True)
    auto.begin([1, 2, 3])
    assert auto.model is model and auto.model_name == trees and auto.trees and auto.sits_out is None
    assert auto.model_gain.state()[0] > auto.model_gain.state()[1]  # what trees learned, restored
    memory.save({}, trees, [[1.0, 1.0]], gain_state=[94.0, 100.0])  # trees lose: chains, restored
    auto.end()  # (saves the trees' state this request learned: none)
    memory.save({}, trees, [[1.0, 1.0]], gain_state=[94.0, 100.0])
    auto.begin([1, 2, 3])
    assert auto.model_name == chains and not auto.trees
    assert auto.model_gain.state()[0] < 0.5 * auto.model_gain.state()[1]
    auto.end()

    # Chains lost too: no drafter is loaded, and the trees' sit-out is still counted.
    sat = memory.load()["sat_out"][trees]
    auto = _auto(model, None, costs, ReplaySettings(draft_max=63), memory, tree=True)
    assert auto.model is None
    auto.begin([1, 2, 3])
    auto.end()
    assert memory.load()["sat_out"][trees] == sat + 1
