"""The adaptive policy's pure decisions and estimators."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.decode.sampling import SamplingParams
from edgespec.drafters.auto.policy import (CostModel, DepthAcceptance, RatioEstimate, TreeDepthCalibration, best_chain_length,
                             best_tree_prefix, path_probabilities)

# Shaped like this machine's measurements: a 2-token batch costs 1.7x a 1-token one.
CPU = CostModel((1, 2, 4, 8, 16, 32), (0.038, 0.064, 0.102, 0.234, 0.299, 0.478))
# A file-backed target: every pass streams the weights, whatever the batch size.
FLAT = CostModel((1, 2, 4, 8, 16, 32, 64), (0.40, 0.40, 0.41, 0.41, 0.42, 0.43, 0.45))


def test_interpolation_and_extrapolation():
    assert CPU.verify(1) == pytest.approx(0.038)
    assert CPU.verify(3) == pytest.approx((0.064 + 0.102) / 2)
    assert CPU.verify(64) > CPU.verify(32)


def test_unlikely_drafts_are_not_verified():
    m, rate = best_tree_prefix([0.3, 0.1, 0.05], CPU, 16)
    assert m == 0 and rate == pytest.approx(1.1 / 0.038)


def test_a_near_certain_long_copy_is_verified():
    m, _ = best_tree_prefix([0.99 ** k for k in range(1, 17)], CPU, 16)
    assert m >= 12


def test_flat_costs_make_large_trees_pay():
    probs = [0.5 ** (k // 4 + 1) for k in range(64)]  # a bushy tree of modest paths
    m_flat, _ = best_tree_prefix(probs, FLAT, 64)
    m_cpu, _ = best_tree_prefix(probs, CPU, 64)
    assert m_flat > 16 and m_cpu == 0


def test_chain_length_needs_cheap_drafts_and_high_acceptance():
    cheap = CostModel(CPU.batch_sizes, CPU.verify_s, draft_token_s=0.002)
    dear = CostModel(CPU.batch_sizes, CPU.verify_s, draft_token_s=0.017)
    assert best_chain_length([0.95] * 16, cheap, 16)[0] > 2
    assert best_chain_length([0.6] * 16, dear, 16)[0] == 0


def test_estimators():
    r = RatioEstimate(prior=0.5, weight=2.0)
    for _ in range(50):
        r.update(1.0, 1.0)
    assert r.value > 0.9
    d = DepthAcceptance(max_depth=4, prior=0.5)
    for _ in range(30):
        d.update(drafted=4, accepted=1)  # depth 1 accepted, depth 2 rejected, 3-4 unseen
    a = d.alphas()
    assert a[0] > 0.9 and a[1] < 0.1 and a[2] == pytest.approx(0.5)


def test_path_probabilities():
    assert path_probabilities([-1, 0, 0, 1], [0.5, 0.5, 0.2, 0.1]) == pytest.approx([0.5, 0.25, 0.1, 0.025])


def test_tree_calibration_learns_per_depth_and_inherits_upward():
    # A chain of 4 certain-looking nodes (score 1) whose first two tokens are always right and
    # whose third is always wrong: depth 1-2 factors rise, depth 3 falls, depth 4 is unseen.
    cal = TreeDepthCalibration(max_depth=8, prior=0.5)
    tokens, parents, scores = [10, 11, 12, 13], [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0]
    for _ in range(40):
        cal.update(tokens, parents, scores, truth=[10, 11, 99, 13])
    f = cal.factors()
    assert f[0] > 0.9 and f[1] > 0.9 and f[2] < 0.15
    assert f[3] == pytest.approx(f[2])  # no data below depth 3: inherits its factor
    probs = cal.path_probs(parents, scores)
    assert probs[0] > 0.9 and probs[1] > 0.8 and probs[2] < 0.15 and probs[3] <= probs[2]


def test_tree_calibration_uses_conditional_scores_and_sibling_sets():
    cal = TreeDepthCalibration(max_depth=4, prior=1.0)
    # Two roots with frequencies 0.75 / 0.25, one child under the first.
    parents, scores = [-1, -1, 0], [0.75, 0.25, 0.75]
    assert cal.path_probs(parents, scores) == pytest.approx([0.75, 0.25, 0.75])
    # A miss at depth 1 by both siblings is one miss against a prediction of 1.0.
    cal.update([1, 2, 3], parents, scores, truth=[7])
    assert cal.num[0] == 0.0 and cal.den[0] == pytest.approx(1.0)
    # A hit on the second sibling, then the walk stops: it has no children.
    cal.update([1, 2, 3], parents, scores, truth=[2, 5])
    assert cal.num[0] == pytest.approx(1.0) and cal.den[1] == 0.0


def test_match_length_classes():
    from edgespec.drafters.auto.drafter import MATCH_CLASSES, match_class

    assert [match_class(n) for n in (0, 1, 3, 4, 11, 12, 31)] == [1, 1, 1, 4, 4, 12, 12]
    assert match_class(0) in MATCH_CLASSES


def test_tree_sizes_probe_the_largest_then_pick_what_pays_and_fall_back_to_plain():
    from edgespec.drafters.auto.policy import TreeSizes
    from edgespec.decode.tree import DraftTree

    flat = CostModel((1, 8, 64), (1.0, 2.0, 2.5), draft_token_s=0.001)  # op offload: big batches cost alike
    sizes = TreeSizes((3, 7, 15, 31, 63), probe_every=4)
    assert sizes.size(40) == 31 and sizes.size(2) == 0  # no cost model: the largest size allowed
    assert sizes.choose(flat, 63) == 63  # the first step probes the largest size
    # a 63-node tree whose nodes 0, 1, 5, 9, 40 spell the answer: every size learns its share
    parents = [-1, 0] + [-1] * 3 + [1] + [-1] * 3 + [5] + [-1] * 30 + [9] + [-1] * 22
    tokens = [10, 11] + [0] * 3 + [12] + [0] * 3 + [13] + [0] * 30 + [14] + [0] * 22
    tree = DraftTree(np.asarray(tokens), np.asarray(parents))
    for _ in range(400):  # the shapes' priors fade
        sizes.learn(tree, [10, 11, 12, 13, 14, 99])
        sizes.searched(63, 0.3)
    assert {b: sizes.expected(b) for b in sizes.sizes} == pytest.approx({3: 2, 7: 3, 15: 4, 31: 4, 63: 5}, rel=0.02)
    assert sizes.choose(flat, 63) == 15  # 5 tokens for 2.0 + a node-priced search: the size that pays
    steep = CostModel((1, 8, 64), (1.0, 8.0, 64.0), draft_token_s=0.001)  # every row costs a step
    assert [sizes.choose(steep, 63) for _ in range(3)] == [0, 0, 63]  # plain pays; the 4th step probes


def test_tree_sizes_learn_nothing_about_sizes_larger_than_the_tree_drafted():
    """A small tree that accepted little lowers the level every size scales, not the shape of
    sizes it could not see: the larger sizes keep their prior's ratio to the smallest."""
    from edgespec.drafters.auto.policy import PRIOR_TREE_ACCEPTED, TreeSizes
    from edgespec.decode.tree import DraftTree

    sizes = TreeSizes((3, 7, 15, 31, 63))
    assert {b: sizes.expected(b) for b in sizes.sizes} == pytest.approx(PRIOR_TREE_ACCEPTED)
    ratio = {b: PRIOR_TREE_ACCEPTED[b] / PRIOR_TREE_ACCEPTED[3] for b in sizes.sizes}
    sizes.learn(DraftTree.chain([10, 11, 0], "model"), [10, 99])  # a 3-node tree accepted 1 token
    level = 0.8 * PRIOR_TREE_ACCEPTED[3] + 0.2 * 1  # a fifth of the way from the prior
    assert sizes.expected(3) == pytest.approx(level)
    assert sizes.expected(63) == pytest.approx(level * ratio[63])  # its shape is still the prior's
    # a tree whose 4th node extends the answer: 2 accepted by every size that holds it, 1 by the
    # 3-node tree; the larger sizes' shapes move (weight 4, decay 0.99)
    wide = DraftTree(np.asarray([10, 0, 0, 11] + [0] * 59), np.asarray([-1, -1, -1, 0] + [-1] * 59))
    sizes.learn(wide, [10, 11, 99])
    level = 0.8 * level + 0.2 * 1
    for b in (7, 15, 31, 63):
        assert sizes.expected(b) == pytest.approx(level * (ratio[b] * 4 * 0.99 + 2) / (4 * 0.99 + 1))
    # sizes off the prior's menu start from every node accepted
    assert TreeSizes((2, 4)).expected(4) == 4


def test_tree_sizes_price_trees_again_after_steps_without_them():
    from edgespec.drafters.auto.policy import PRIOR_TREE_ACCEPTED, TreeSizes
    from edgespec.decode.tree import DraftTree

    sizes = TreeSizes((3, 7, 15, 31, 63))
    for _ in range(40):  # trees that accept nothing
        sizes.learn(DraftTree.chain([10, 11, 12], "model"), [99])
    assert sizes.level < 0.01
    for _ in range(30):  # choices that drafted no tree: the level reverts a tenth a choice
        sizes.choose(FLAT, 63)
    assert sizes.level == pytest.approx(PRIOR_TREE_ACCEPTED[3], rel=0.05)


def test_tree_sizes_level_follows_trees_drafted_at_every_step():
    """Where every step drafts a tree, each one measures the level: it is what they accept, not
    pulled toward the prior (which held 3-node trees accepting 1 token at a level of 1.22)."""
    from edgespec.drafters.auto.policy import TreeSizes
    from edgespec.decode.tree import DraftTree

    sizes = TreeSizes((3, 7, 15, 31, 63))
    for _ in range(60):
        sizes.choose(FLAT, 3)
        sizes.learn(DraftTree.chain([10, 11, 12], "model"), [10, 99])  # each accepts 1 token
    assert sizes.level == pytest.approx(1.0, abs=1e-4)


def test_confidence_calibration_starts_from_the_drafter_and_learns_where_it_is_wrong():
    from edgespec.drafters.auto.policy import ConfidenceCalibration

    cal = ConfidenceCalibration()
    assert cal.value(0.55) == pytest.approx(0.55) and cal.value(0.95) == pytest.approx(0.95)
    assert cal.path_probs([0.95, 0.55]) == pytest.approx([0.95, 0.95 * 0.55])
    for _ in range(50):  # unsure tokens the target keeps accepting, then one it refuses
        cal.update([0.15, 0.15, 0.15, 0.95], [True, True, True, False])
    assert cal.value(0.15) > 0.8 and cal.value(0.95) < 0.2
    before = cal.state()
    cal.update([0.55, 0.55], [False, True])  # nothing after the first miss is graded
    assert cal.state()[1][5] == pytest.approx(before[1][5] * 0.995 + 1.0)
    carried = ConfidenceCalibration()
    carried.restore(cal.state(), weight=4.0)
    assert carried.den.max() <= 4.0 + 1e-9 and carried.value(0.15) > 0.6  # prior 0.15, evidence 4 of 6


class _FixedChain:
    """A greedy chain drafter over fixed tokens and confidences (the protocol, no model)."""

    name, tree = "model", False

    def __init__(self, confidences):
        self.confidences, self.asked = confidences, []

    def begin(self, prompt, sampling=None, rng=None):
        pass

    def observe(self, emitted):
        pass

    def end(self):
        pass

    def propose(self, context, budget, stop=None):
        from edgespec.decode.tree import DraftTree

        conf = []
        for c in self.confidences[:budget]:
            conf.append(c)
            if stop is not None and stop(conf):
                break
        self.asked.append(len(conf))
        return DraftTree.chain(list(range(100, 100 + len(conf))), "model", scores=np.cumprod(conf))


def test_auto_verifies_the_chain_up_to_where_the_drafter_turns_unsure():
    from edgespec.drafters.auto.drafter import AutoDrafter
    from edgespec.drafters.suffix import SuffixDrafter

    # a CPU-verified target: 3 tokens verify for 1.3 steps, 8 for 3
    curve = ((1, 2, 4, 8, 16), (0.1, 0.11, 0.13, 0.3, 0.35))
    steep = CostModel(*curve, draft_token_s=0.0012)
    model = _FixedChain([0.99, 0.98, 0.99, 0.35, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3])
    auto = AutoDrafter(SuffixDrafter(), steep, model=model)
    auto.begin([1, 2, 3])
    draft = auto.propose([1, 2, 3], 8)
    assert draft.source == "model" and len(draft) == 3
    # drafting stops where the chain's survival (0.99 * 0.98 * 0.99 * 0.35 * 0.3 ** k) times the
    # best prefix's seconds per token (0.13 s / 3.92 tokens) is below a drafter pass: 1.2 ms, 20 ms
    assert model.asked == [6]
    auto.observe([100, 101, 102, 7])  # the target took the three sure tokens and not the 4th
    cal = auto.confidence  # graded: three hits at 0.9-1.0, one miss at 0.3-0.4, nothing after it
    assert cal.num[9] == pytest.approx(cal.den[9]) and cal.den[9] > 2.9 and (cal.num[3], cal.den[3]) == (0, 1)
    assert cal.den.sum() == pytest.approx(cal.den[9] + 1) and cal.value(0.35) < 0.35
    dear = AutoDrafter(SuffixDrafter(), CostModel(*curve, draft_token_s=0.02), model=_FixedChain(model.confidences))
    dear.begin([1, 2, 3])
    assert len(dear.propose([1, 2, 3], 8)) == 3 and dear.model.asked == [4]


class _TreeOrChain(_FixedChain):
    """A drafter that drafts a best-first tree or a chain as asked (ModelDrafter's ``tree``
    argument), its trees learned by a real TreeSizes; every drafted token is wrong."""

    tree = True

    def __init__(self, confidences):
        from edgespec.drafters.auto.policy import TreeSizes
        from edgespec.drafters.model import TREE_SIZES

        super().__init__(confidences)
        self.sizes, self.shapes, self._verifying = TreeSizes(TREE_SIZES), [], None

    def propose(self, context, budget, stop=None, tree=None):
        from edgespec.decode.tree import DraftTree

        self.shapes.append(("tree" if tree else "chain", budget))
        if not tree:
            return super().propose(context, budget, stop)
        self._verifying = DraftTree(np.full(budget, 100), np.full(budget, -1), source="model")
        return self._verifying

    def observe(self, emitted):
        self.sizes.learn(self._verifying, emitted)
        self._verifying = None


def test_a_smaller_tree_than_the_largest_is_drafted_only_where_the_chain_prices_lower():
    """Where a tree below the menu's largest size prices above the chain's learned price, the chain is
    drafted first and its own confidences decide: a sure chain is verified, an unsure one gives
    way to the tree."""
    from edgespec.drafters.auto.drafter import AutoDrafter
    from edgespec.drafters.suffix import SuffixDrafter

    # 16 rows cost 2.5 steps, 64 ten: a tree below 63 nodes prices highest, chains at the
    # prior's 0.6 a depth lower (2.2 tokens / 1.5 steps for 3)
    cost = CostModel((1, 4, 16, 64), (1.0, 1.5, 2.5, 10.0), draft_token_s=0.001)
    drafted = {}
    for confidence in (0.99, 0.05):
        model = _TreeOrChain([confidence] * 64)
        auto = AutoDrafter(SuffixDrafter(), cost, model=model)
        auto.begin([1, 2, 3])
        first = auto.propose([1, 2, 3], 63)  # the first step's probe of 63 nodes prices below the chain
        emitted = list(range(100, 100 + len(first))) + [7]  # the verified chain taken, graded
        auto.observe(emitted)
        assert model.shapes == [("chain", 63)]
        drafted[confidence] = auto.propose([1, 2, 3] + emitted, 63)
        assert model.shapes[1] == ("chain", 63)  # drafted first, though a tree priced higher
        drafted[confidence, "after"] = model.shapes[2:]
        alphas, graded = auto.model_acceptance.alphas(), auto.confidence.den.sum()
        auto.observe([7])  # nothing taken
        drafted[confidence, "learned"] = auto.model_acceptance.alphas() != alphas, auto.confidence.den.sum() > graded
    assert len(drafted[0.99]) >= 15 and drafted[0.99, "after"] == []  # sure: the chain, no tree
    (shape, size), = drafted[0.05, "after"]  # unsure: the tree that priced higher
    assert shape == "tree" and size < 63 and len(drafted[0.05]) == size and drafted[0.05].source == "model"
    # a verified chain teaches its depths; a chain drafted and set aside for the tree only its
    # confidences (graded by what the target emitted)
    assert drafted[0.99, "learned"] == (True, True) and drafted[0.05, "learned"] == (False, True)


def test_auto_drafts_a_tree_or_a_chain_whichever_prices_higher():
    from edgespec.drafters.auto.drafter import AutoDrafter
    from edgespec.drafters.suffix import SuffixDrafter

    model = _TreeOrChain([0.99] * 64)
    auto = AutoDrafter(SuffixDrafter(), FLAT, model=model)  # verification flat: 64 rows cost one
    auto.begin([1, 2, 3])
    context = [1, 2, 3]

    def step(emitted):
        draft = auto.propose(context, 63)
        auto.observe(emitted)
        context.extend(emitted)
        return draft

    alphas = auto.model_acceptance.alphas()
    first = step([7])  # the first step probes the largest tree; it accepts nothing
    assert model.shapes == [("tree", 63)] and first.source == "model" and len(first) == 63
    assert auto.model_acceptance.alphas() == alphas  # a tree teaches TreeSizes, not the chain's depths
    assert model.sizes.level == pytest.approx(0.8 * 1.76)  # one tree moves the level a fifth of the way
    # priced, not probed: 63 nodes expected to accept ~1.4 x 4.1 tokens beat a chain at 0.6 a depth
    step([8])
    assert model.shapes[-1] == ("tree", 63)
    for _ in range(40):  # trees that accept nothing: the level falls to ~0
        model.sizes.learn(first, [7])
    level, shape = model.sizes.level, model.sizes.shape[63].state()
    step([9])
    assert model.shapes[-1][0] == "chain"  # a chain prices higher now: asked with tree=False
    # it taught no tree size: the shape is as it was; the level, just measured by trees, stays
    assert model.sizes.shape[63].state() == shape
    assert model.sizes.level == pytest.approx(level)
    step([9])  # a step after one without a tree: the level reverts a tenth toward its prior
    assert model.sizes.level == pytest.approx(level + (1.76 - level) * 0.1)
    for _ in range(30):  # steps without trees: their level reverts toward its prior
        step([9])
        if model.shapes[-1][0] == "tree":
            break
    assert model.shapes[-1][0] == "tree"  # trees are priced back in, not locked out
    sampling = AutoDrafter(SuffixDrafter(), FLAT, model=_TreeOrChain([0.99] * 64))
    sampling.begin([1, 2, 3], sampling=SamplingParams(temperature=1.0))
    sampling.propose([1, 2, 3], 63)
    assert sampling.model.shapes and all(shape == "chain" for shape, _ in sampling.model.shapes)  # trees: greedy only


def test_what_the_confidences_taught_is_kept_for_the_next_request(tmp_path):
    from edgespec.drafters.auto.drafter import AutoDrafter
    from edgespec.drafters.auto.memory import CARRY_WEIGHT, PolicyMemory
    from edgespec.drafters.suffix import SuffixDrafter

    memory = PolicyMemory(tmp_path, "placement")
    first = AutoDrafter(SuffixDrafter(), CPU, model=_FixedChain([0.5]), memory=memory, model_name="d.gguf")
    first.begin([1, 2, 3])
    for _ in range(20):  # half-sure tokens the target always took
        first.confidence.update([0.55], [True])
    first.end()
    second = AutoDrafter(SuffixDrafter(), CPU, model=_FixedChain([0.5]), memory=memory, model_name="d.gguf")
    assert second.confidence.den[5] == pytest.approx(CARRY_WEIGHT)  # scaled down: a new request can move it
    assert second.confidence.value(0.55) > 0.8 and second.confidence.value(0.95) == pytest.approx(0.95)
    other = AutoDrafter(SuffixDrafter(), CPU, model=_FixedChain([0.5]), memory=memory, model_name="other.gguf")
    assert other.confidence.value(0.55) == pytest.approx(0.55)  # another drafter model learns apart


def test_a_requests_learning_is_written_after_its_answer_and_reads_wait_for_it(tmp_path, monkeypatch):
    """The write (a read, a write and an fsync) runs in a thread of its own, outside the
    request's clock; every later read of the memory sees it."""
    import threading
    import time

    from edgespec.drafters.auto import memory as mem

    release, written = threading.Event(), mem.write_or_keep
    monkeypatch.setattr(mem, "write_or_keep", lambda *args: release.wait(10) and written(*args))
    memory = mem.PolicyMemory(tmp_path, "placement")
    start = time.perf_counter()
    memory.save_after({"1": [1.0, 2.0]}, None, None)
    assert time.perf_counter() - start < 5 and not memory.path.exists()  # the request did not wait
    threading.Timer(0.2, release.set).start()
    assert memory.load()["suffix"] == {"1": [1.0, 2.0]}  # the read did
    assert mem.PolicyMemory(tmp_path, "placement").load()["suffix"] == {"1": [1.0, 2.0]}


def test_a_chains_price_pays_its_drafting_whether_or_not_it_is_verified():
    from edgespec.drafters.auto.policy import ConfidenceCalibration, chain_rate

    flat = CostModel((1, 2, 4, 8, 16), (0.100, 0.104, 0.108, 0.116, 0.132))
    cal = ConfidenceCalibration()
    assert chain_rate([[1.0] * 8], cal, flat, 8) == pytest.approx(9 / flat.verify(9))  # free and sure: all of it
    assert chain_rate([[1.0] * 8], cal, flat, 4) == pytest.approx(5 / flat.verify(5))  # the budget caps it
    # a token dearer than a target step: the chain stops after one, which is still verified
    dear = CostModel(flat.batch_sizes, flat.verify_s, draft_token_s=0.2)
    assert chain_rate([[1.0] * 8], cal, dear, 8) == pytest.approx(2 / (0.2 + 0.104))
    # a chain nobody would verify (1% sure) costs its drafting and yields a plain step
    cheap = CostModel(flat.batch_sizes, flat.verify_s, draft_token_s=0.01)
    assert chain_rate([[0.01] * 8], cal, cheap, 8) == pytest.approx(1 / (0.01 + 0.100))


def test_the_drafters_prior_gain_falls_with_its_cost_per_token():
    from dataclasses import replace

    from edgespec.drafters.auto.policy import drafter_gain

    flat = CostModel((1, 2, 4, 8, 16), (0.100, 0.104, 0.108, 0.116, 0.132))
    gains = [drafter_gain(replace(flat, draft_token_s=s), 16) for s in (0.0, 0.01, 0.03, 0.05, 0.08)]
    assert gains == sorted(gains, reverse=True) and gains[0] > 3 and gains[-1] < 1
    assert drafter_gain(flat, 16, learned=[3.0, 4.0]) == pytest.approx(0.75)  # measured: the prior is gone


class _TimedChain(_FixedChain):
    """A _FixedChain whose drafting advances a clock by ``token_s`` a drafted token."""

    def __init__(self, confidences, clock, token_s):
        super().__init__(confidences)
        self.clock, self.token_s = clock, token_s

    def propose(self, context, budget, stop=None):
        draft = super().propose(context, budget, stop)
        self.clock[0] += self.token_s * len(draft)
        return draft


def test_auto_measures_what_its_model_steps_gain_over_the_steps_without_it(tmp_path):
    from edgespec.drafters.auto.drafter import GAIN_DECAY, GAIN_WEIGHT, AutoDrafter
    from edgespec.drafters.auto.memory import PolicyMemory
    from edgespec.drafters.auto.policy import drafter_gain
    from edgespec.drafters.suffix import SuffixDrafter

    steep = CostModel((1, 2, 4, 8, 16), (0.1, 0.11, 0.13, 0.3, 0.35), draft_token_s=0.0012)
    clock = [0.0]
    memory = PolicyMemory(tmp_path, "placement")
    model = _TimedChain([0.99, 0.98, 0.99, 0.35, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], clock, 0.01)
    auto = AutoDrafter(SuffixDrafter(), steep, model=model, memory=memory, model_name="d.gguf",
                       clock=lambda: clock[0])
    auto.begin([1, 2, 3])
    prior = drafter_gain(steep, 8)
    assert len(auto.propose([1, 2, 3], 8)) == 3 and model.asked == [6]  # as in the test above
    auto.observe([100, 101, 102, 7])
    # 4 tokens in 0.06 s of drafting (as clocked) + 0.13 s verifying, where a plain step (no
    # suffix draft on offer) was expected to emit 0.19 s / 0.1 s = 1.9
    num, den = prior * GAIN_WEIGHT * GAIN_DECAY + 4, GAIN_WEIGHT * GAIN_DECAY + 1.9
    assert auto.model_gain.state() == pytest.approx([num, den])
    auto.end()
    assert memory.drafter_gain("d.gguf") == pytest.approx([num, den])
    plain = AutoDrafter(SuffixDrafter(), steep, model=_TimedChain([0.2], clock, 0.01), clock=lambda: clock[0])
    plain.begin([1, 2, 3])
    assert not len(plain.propose([1, 2, 3], 8))  # unsure from the first token: nothing verified ...
    plain.observe([5])
    assert plain.model_gain.state()[1] == pytest.approx(GAIN_WEIGHT * GAIN_DECAY + 0.11 / 0.1)  # ... its pass counted


def _loop_tree_prefix(probs, cost, max_nodes, margin):
    """The prefix search as a running loop: the definition the vectorised one must equal."""
    best_m, best_rate, expected = 0, (1.0 + margin) / cost.verify(1), 1.0
    for m, p in enumerate(probs[:max_nodes], start=1):
        expected += p
        rate = expected / cost.verify(1 + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m, best_rate


def _loop_chain_length(alphas, cost, max_len, margin):
    best_k, best_rate, expected, survive = 0, (1.0 + margin) / cost.verify(1), 1.0, 1.0
    for k in range(1, max_len + 1):
        survive *= alphas[min(k, len(alphas)) - 1]
        expected += survive
        rate = expected / (k * cost.draft_token_s + cost.verify(1 + k))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


def test_the_searches_equal_their_running_loops_bit_for_bit():
    """Same choice and the same rate to the last bit, inside the measured curve and beyond it
    (extrapolated), ties and flat probabilities included."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        sizes = (1, *sorted(rng.choice(np.arange(2, 80), int(rng.integers(0, 16)), replace=False).tolist()))
        cost = CostModel(sizes, tuple(np.sort(rng.uniform(1e-3, 5e-2, len(sizes))).tolist()),
                         float(rng.choice([0.0, rng.uniform(0, 1e-2)])))
        probs = (rng.random(int(rng.integers(0, 70))) ** rng.choice([0.1, 1.0, 3.0])).tolist()
        if rng.random() < 0.2:
            probs = [1.0] * len(probs)
        alphas = rng.random(int(rng.integers(1, 65))).tolist()
        limit, margin = int(rng.integers(0, 90)), float(rng.choice([0.0, 0.1]))
        assert best_tree_prefix(probs, cost, limit, margin) == _loop_tree_prefix(probs, cost, limit, margin)
        assert best_chain_length(alphas, cost, limit, margin) == _loop_chain_length(alphas, cost, limit, margin)


class _DecodeLog:
    """A context that records the sizes of the batches it is asked to decode."""

    n_seq_max, n_ctx, n_batch, n_outputs_max = 1, 4096, 512, 65

    def __init__(self):
        self.sizes: list[int] = []
        self.model = type("M", (), {"tokenize": lambda self, text, add_special=True: [5]})()
        self.picks: list[tuple[bool, bool]] = []  # pick_on_backend's calls
        self.picking = False

    def pick_on_backend(self, on: bool, every_row: bool = False) -> bool:
        self.picks.append((on, every_row))
        return False

    def top_on_backend(self, k: int) -> bool:
        return False

    def decode(self, tokens, positions, seq_ids, logits):
        self.sizes.append(len(tokens))

    def decode_rows(self, tokens, positions, seq_ids, logits):
        self.decode(tokens, positions, seq_ids, logits)
        return lambda i: None

    def seq_rm(self, seq, p0=0, p1=-1):
        pass


def test_a_gpu_calibration_warms_each_size_up_and_times_the_round_trip_from_a_one_token_decode(monkeypatch):
    from edgespec.drafters.auto import calibrate
    ctx = _DecodeLog()
    monkeypatch.setattr(calibrate, "graphs_warm_up", lambda c: True)
    calibrate.measure_verify(ctx, sizes=(1, 3))
    warm, timed = [1] * calibrate.WARMUPS, [1] * calibrate.REPEATS
    # the first decode, the one-token decode subtracted, then each size: warmed up, then timed
    # (3 tokens: after a one-token decode, with the one-token decode after it)
    assert ctx.sizes == [512] + timed + timed + warm + timed + [3] * calibrate.WARMUPS + [1, 3, 1] * calibrate.REPEATS
    assert ctx.picks == [(True, True), (False, False)]  # rows read as greedy verification reads them
    ctx = _DecodeLog()
    monkeypatch.setattr(calibrate, "graphs_warm_up", lambda c: False)  # a CPU: as before
    calibrate.measure_verify(ctx, sizes=(1, 3))
    assert ctx.sizes == [512] + timed + timed + [3] * calibrate.REPEATS


def test_a_calibration_where_the_backend_picks_every_row_reads_no_logits(monkeypatch):
    """On a build with output argmax verification reads picks, so the curve is timed that way:
    filling the context, the one-token decodes and the timed batches read no logits row (a
    picked row has none), and picks are off again afterwards."""
    from edgespec.drafters.auto import calibrate
    from fake_model import FakeContext, FakeModel
    model = FakeModel(n_vocab=64)
    model.tokenize = lambda text, add_special=True: [5]
    monkeypatch.setattr(calibrate, "graphs_warm_up", lambda c: True)  # a GPU's: after one-token decodes
    ctx = FakeContext(model, n_ctx=1024, n_batch=256, n_seq_max=2, n_outputs_max=65, greedy_on_backend=True,
                      output_argmax=True)
    sizes, times = calibrate.measure_verify(ctx, sizes=(1, 2, 8))
    assert sizes == (1, 2, 8) and all(t > 0 for t in times) and not ctx.picking


def test_the_depth_calibration_learns_and_prices_as_its_definition():
    """Factors down to a depth are the first factors of all depths, and an update walks each
    node's children in drafting order (the sums and the first hit as a scan of every node)."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        fast, slow = TreeDepthCalibration(max_depth=16), TreeDepthCalibration(max_depth=16)
        for _ in range(5):
            n = int(rng.integers(1, 40))
            parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
            tokens = rng.integers(0, 4, n).tolist()
            scores = rng.random(n).tolist()
            truth = rng.integers(0, 4, int(rng.integers(0, 20))).tolist()
            fast.update(tokens, parents, scores, truth)
            node = -1  # the definition: scan every node for the children of the one reached
            for depth, true_token in enumerate(truth[:len(slow.num)]):
                base = 1.0 if node < 0 else scores[node]
                kids = [i for i in range(n) if parents[i] == node]
                if not kids or base <= 0:
                    break
                hit = next((i for i in kids if tokens[i] == true_token), None)
                slow.num[depth] = slow.num[depth] * slow.decay + (hit is not None)
                slow.den[depth] = slow.den[depth] * slow.decay + min(1.0, sum(scores[i] for i in kids) / base)
                if hit is None:
                    break
                node = hit
        assert fast.num == slow.num and fast.den == slow.den
        k = int(rng.integers(0, 20))
        assert fast.factors(k) == fast.factors()[:k]
