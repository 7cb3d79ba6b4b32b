"""Exact replay (benchmarks/replay/replay.py, on pytest's pythonpath), proved on the exact fake
model: a trace recorded from plain decoding and a teacher-forced drafter predicts the steps,
drafted and accepted tokens and every decoded batch of a real speculative run, for each
replayable drafter. Plus hand cases of the chain rule and the cost model. No model files; seconds."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import replay as rp
import replay_trees as rt
from fake_model import BOS, FakeContext, FakeModel

from edgespec.bench.summary import PLAIN
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.decode.sequence import KVSequence
from edgespec.drafters.auto.drafter import AutoDrafter
from edgespec.drafters.auto.policy import CostModel, TreeSizes
from edgespec.drafters.hybrid import HybridDrafter
from edgespec.drafters.model import MAX_TREE_NODES, TREE_SIZES, ModelDrafter
from edgespec.drafters.suffix import SuffixDrafter
from edgespec.spec.step import SpeculativeStep

# eos_bias 0: some answers end with EOS within MAX_TOKENS, others by length.
TARGET = FakeModel(n_vocab=96, seed=0, eos_bias=0.0)
DRAFT_MODEL = FakeModel(n_vocab=96, seed=0, eos_bias=0.0, perturb=1.0, perturb_seed=5)
N_CTX, DRAFT_MAX, MAX_TOKENS = 512, 8, 60
CHEAP = CostModel((1, 2, 4, 8, 16, 32, 64), (1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.8), 0.02)
# Unit costs: seconds = rows, so the ledger can be read back.
UNIT = rp.MachineCosts("unit", ((0, rp.curve({1: 1.0, 2: 2.0})),), drafter=rp.curve({1: 1.0, 2: 2.0}),
                       policy=CHEAP)
SETTINGS = rp.ReplaySettings(max_tokens=MAX_TOKENS, draft_max=DRAFT_MAX, n_ctx=N_CTX)
GREEDY = SamplingParams(temperature=0.0)
TREE_BUDGETS = (3, 7)  # the menu's sizes within DRAFT_MAX
MIN_CONFIDENCE = 0.2  # the fake drafter is rarely sure: below the default 0.4 chains run longer


def prompts(n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        toks = [BOS] + rng.integers(2, TARGET.n_vocab, 20).tolist()
        out.append(toks + toks[3:15])  # a copied span, as code edits have
    return out


def drafter_ctx() -> FakeContext:
    return FakeContext(DRAFT_MODEL, n_ctx=N_CTX, n_seq_max=MAX_TREE_NODES + 1, n_ubatch=64)


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> rp.Trace:
    recorded = []
    for k, prompt in enumerate(prompts()):
        decoder = Decoder(TARGET, KVSequence(FakeContext(TARGET, n_ctx=N_CTX, n_seq_max=1 + DRAFT_MAX)))
        output, finish = rp.record_plain(decoder, prompt, MAX_TOKENS)
        big = FakeContext(DRAFT_MODEL, n_ctx=4096, n_seq_max=MAX_TREE_NODES + 1, n_ubatch=64)
        drafter = rp.record_drafter(big, prompt, output, MIN_CONFIDENCE, off_cap=DRAFT_MAX - 1)
        # the fake holds 64 sequences, as the drafter's default context: trees expand at most 63 nodes
        trees = rt.record_trees(big, prompt, output, budgets=TREE_BUDGETS, max_expansions=MAX_TREE_NODES)
        recorded.append(rp.PromptTrace(f"p{k}", "fake", tuple(prompt), output, finish, drafter, trees))
    path = tmp_path_factory.mktemp("replay") / "fake.json.gz"
    rp.save_trace(rp.Trace("fake", MAX_TOKENS, tuple(recorded)), path)
    return rp.load_trace(path)


def real_run(config: str, prompt: list[int]):
    """A real speculative run on the fake target; returns (DoneEvent, target ctx, drafter ctx, how
    many trees and chains the model drafted).
    Trees are sized by a fresh TreeSizes pricing with CHEAP (UNIT's policy)."""
    target = FakeContext(TARGET, n_ctx=N_CTX, n_seq_max=1 + DRAFT_MAX)
    dctx = drafter_ctx()
    model = ModelDrafter(DRAFT_MODEL, ctx=dctx, min_confidence=MIN_CONFIDENCE, tree=config.endswith("-tree"))
    model.cost = CHEAP if model.tree and config != "auto-tree" else None  # auto sizes its trees itself
    model.clock = lambda: dctx.rows_evaluated  # UNIT books a drafter row as a second
    drafter = {"suffix": lambda: SuffixDrafter(), "model": lambda: model, "model-tree": lambda: model,
               "hybrid": lambda: HybridDrafter(SuffixDrafter(), model),
               "hybrid-tree": lambda: HybridDrafter(SuffixDrafter(), model),
               "auto": lambda: AutoDrafter(SuffixDrafter(), CHEAP, model=model),
               "auto-tree": lambda: AutoDrafter(SuffixDrafter(), CHEAP, model=model)}[config]()
    decoder = Decoder(TARGET, KVSequence(target), SpeculativeStep(drafter, DRAFT_MAX))
    shapes = {"tree": 0, "chain": 0}

    def counted(shape):
        draft = getattr(model, f"_{shape}")

        def counting(*args):
            shapes[shape] += 1
            return draft(*args)
        return counting

    model._tree, model._chain = counted("tree"), counted("chain")
    done = decoder.generate(prompt, GenerationRequest(max_tokens=MAX_TOKENS, sampling=GREEDY))
    return done, target, dctx, shapes


def test_trace_records_plain_output_and_both_endings(trace):
    assert {p.finish for p in trace.prompts} == {"stop", "length"}  # both endings covered
    for p in trace.prompts:
        body = p.output[:-1] if p.finish == "stop" else p.output
        assert list(body) == TARGET.greedy(list(p.prompt), len(body))
        assert p.finish == "length" or p.output[-1] == TARGET.eos
        assert len(p.drafter.top_ids) == len(p.drafter.off_run) == len(p.output)
    assert sum(bool(r) for p in trace.prompts for r in p.drafter.off_run) > 10  # off-path runs recorded


@pytest.mark.parametrize("config", ["suffix", "model", "hybrid", "auto", "model-tree", "hybrid-tree", "auto-tree"])
def test_replay_predicts_every_step_and_batch_of_a_real_run(trace, config):
    """Same output, steps, drafted, accepted, per-drafter split, and the same decoded rows
    (trees: the same sizes chosen, so the same rows verified and the same drafter decodes)."""
    total_accepted, shapes = 0, {"tree": 0, "chain": 0}
    for p in trace.prompts:
        done, target, dctx, drafted = real_run(config, list(p.prompt))
        shapes = {k: shapes[k] + drafted[k] for k in shapes}
        replayed, ledger = rp.run_replay(p, config, UNIT, SETTINGS, sizes=TreeSizes(TREE_SIZES))
        assert replayed.token_ids == done.token_ids
        real, sim = done.stats.spec, replayed.stats.spec
        # A tree may hold the EOG token and tokens after it: the real step counts those as
        # accepted (the answer ends at the EOG); the trace knows nothing past the answer.
        past_eog = real.accepted - sim.accepted
        assert past_eog == 0 or (p.finish == "stop" and config.endswith("-tree") and 0 < past_eog < DRAFT_MAX)
        assert (sim.steps, sim.drafted) == (real.steps, real.drafted)
        if not past_eog:
            assert {k: vars(v) for k, v in sim.by_drafter.items()} == {k: vars(v) for k, v in real.by_drafter.items()}
        assert ledger.target_rows == target.rows_evaluated - len(p.prompt)  # prefill not booked
        assert (ledger.drafter_rows, ledger.drafter_decodes) == (dctx.rows_evaluated, dctx.decodes)
        total_accepted += real.accepted
    assert total_accepted > 0
    assert (shapes["tree"] > 0) == config.endswith("-tree")
    if config == "auto-tree":
        assert shapes["chain"] > 0  # it drafts both, step by step


def test_replayed_record_prices_the_ledger(trace):
    p = trace.prompts[0]
    costs = rp.MachineCosts("t", ((0, rp.curve({1: 2.0, 8: 9.0})),), drafter=rp.curve({1: 0.5, 4: 2.0}), step_s=0.25)
    done, ledger = rp.run_replay(p, "model", costs, SETTINGS)
    rec = rp.replay_prompt(p, "model", costs, SETTINGS)
    assert ledger.target_decodes == done.stats.spec.steps
    assert rec.gen_s == pytest.approx(ledger.target_s + ledger.drafter_s + 0.25 * done.stats.spec.steps)
    assert rec.steps == done.stats.spec.steps and rec.gen_tokens == len(done.token_ids) - 1
    plain = rp.replay_prompt(p, PLAIN, costs, SETTINGS)
    # The bench counts plain steps as tokens after the first; an EOG answer pays one step more.
    decodes = plain.gen_tokens + (p.finish == "stop")
    assert p.finish == "stop" and plain.steps == plain.gen_tokens and plain.gen_s == pytest.approx(decodes * 2.25)


def test_replay_books_every_greedy_pick_of_a_real_chain_at_its_price(trace, monkeypatch):
    """A chain's Python (MachineCosts.pick_s) is booked once for each greedy pick the real
    drafter makes: one per drafted token, and the pick that ends a chain."""
    from edgespec.drafters import model as dm

    picks = []
    greedy_logprob = dm.greedy_logprob
    monkeypatch.setattr(dm, "greedy_logprob", lambda row: picks.append(1) or greedy_logprob(row))
    priced = dataclasses.replace(UNIT, pick_s=0.125)
    for p in trace.prompts:
        picks.clear()
        real_run("model", list(p.prompt))
        _, free = rp.run_replay(p, "model", UNIT, SETTINGS)
        _, ledger = rp.run_replay(p, "model", priced, SETTINGS)
        assert len(picks) > 0 and ledger.picks_booked == len(picks)
        assert ledger.drafter_s == pytest.approx(free.drafter_s + 0.125 * len(picks))


def test_shared_drafter_cache_carries_over_like_one_drafter_model(trace):
    p = trace.prompts[1]
    cache: list[int] = []
    _, first = rp.run_replay(p, "model", UNIT, SETTINGS, cache)
    _, second = rp.run_replay(p, "hybrid", UNIT, SETTINGS, cache)
    assert first.drafter_rows >= len(p.prompt)  # the first run prefills the drafter
    _, fresh = rp.run_replay(p, "hybrid", UNIT, SETTINGS)
    assert second.drafter_rows < fresh.drafter_rows


# -- pure cases ---------------------------------------------------------------------------------
def hand_trace(output, tops, confident, off_run, finish="length") -> rp.PromptTrace:
    n = len(output)
    d = rp.DrafterTrace(tuple((t,) for t in tops), ((0.0,),) * n, (0.0,) * n, tuple(confident), tuple(off_run), 0.4, 7)
    return rp.PromptTrace("h", "hand", (0, 2, 3), tuple(output), finish, d)


def test_chain_follows_the_plain_output_then_the_recorded_off_path_run():
    out = [10, 11, 12, 13, 14, 15]
    t = hand_trace(out, [10, 11, 99, 13, 14, 15], [1, 1, 1, 1, 0, 1], [0, 0, 3, 0, 0, 0])
    chain = lambda p, budget: rp.TraceChainDrafter(t, rp.Ledger(UNIT), N_CTX).chain(p, budget)[0]
    tokens, confidences, decoded = rp.TraceChainDrafter(t, rp.Ledger(UNIT), N_CTX).chain(0, 8)
    # hand_trace's log-probs are 0 (confidence 1); the off-path run was recorded without its
    # own, so it is priced at min_confidence; low confidence after the run ended the chain
    assert confidences == [1.0, 1.0, 1.0, 0.4, 0.4, 0.4] and decoded == 6
    stop = lambda conf: len(conf) == 2  # noqa: E731
    assert rp.TraceChainDrafter(t, rp.Ledger(UNIT), N_CTX).chain(0, 8, stop)[::2] == ([10, 11], 1)
    assert rp.TraceChainDrafter(t, rp.Ledger(UNIT), N_CTX).chain(0, 2)[::2] == ([10, 11], 1)  # the budget
    assert chain(0, 8) == [10, 11, 99, rp.OFF_PATH, rp.OFF_PATH, rp.OFF_PATH]  # miss at 2, 3 more
    assert chain(0, 4) == [10, 11, 99, rp.OFF_PATH]  # the budget cuts the off-path run
    assert chain(0, 2) == [10, 11]
    assert chain(3, 8) == [13]  # confidence falls at 4
    assert chain(4, 8) == []
    assert chain(5, 8) == [15]  # past the recorded output: not confident
    with pytest.raises(ValueError, match="off-path cap"):
        rp.TraceChainDrafter(hand_trace(out, [99] * 6, [1] * 6, [7] * 6), rp.Ledger(UNIT), N_CTX).chain(0, 12)


def test_costs_interpolate_in_depth_and_default_policy_is_the_curve_near_512():
    c = rp.costs_from_json({"target": {"0": {"1": 1.0, "4": 2.0}, "1000": {"1": 3.0, "4": 6.0}},
                            "drafter": {"1": 0.1}})
    assert c.verify(1, 500) == pytest.approx(2.0) and c.verify(4, 2000) == pytest.approx(6.0)
    assert c.verify(2, 0) == pytest.approx(1 + 1 / 3)
    pm = c.policy_model()
    assert pm.batch_sizes == (1, 4) and pm.verify_s == (3.0, 6.0) and pm.draft_token_s == pytest.approx(0.1)


def test_settings_the_trace_cannot_answer_are_refused(trace):
    with pytest.raises(ValueError, match="longer recording"):
        rp.replay(trace, ["suffix"], UNIT, rp.ReplaySettings(max_tokens=MAX_TOKENS + 1, draft_max=DRAFT_MAX))
    with pytest.raises(ValueError, match="draft_max"):
        rp.replay(trace, ["model"], UNIT, rp.ReplaySettings(max_tokens=MAX_TOKENS, draft_max=DRAFT_MAX + 1))
    with pytest.raises(ValueError, match="cannot be replayed"):
        rp.replay_prompt(trace.prompts[0], "ngram", UNIT, SETTINGS)
    with pytest.raises(ValueError, match="tree records up to"):
        rp.check_settings(rp.Trace("t", MAX_TOKENS, (dataclasses.replace(trace.prompts[0], trees=None),)),
                          SETTINGS, ["model-tree"])


def test_replay_is_bench_ordered_and_summarizes_like_the_bench(trace):
    records = rp.replay(trace, ["suffix", "model"], UNIT, SETTINGS, ids=["p0", "p1"])
    assert [(r.id, r.config) for r in records] == [(i, c) for i in ("p0", "p1") for c in (PLAIN, "suffix", "model")]
    summary = rp.overall(records)
    assert summary[PLAIN]["speedup"] == pytest.approx(1.0) and summary["suffix"]["mean_emitted"] >= 1.0


def test_overlap_replays_the_same_answer_and_hides_drafting_behind_verification(trace):
    p = trace.prompts[0]
    costs = rp.MachineCosts("t", ((0, rp.curve({1: 2.0, 8: 9.0})),), drafter=rp.curve({1: 0.5, 4: 2.0}))
    base, base_ledger = rp.run_replay(p, "model", costs, SETTINGS)
    over, ledger = rp.run_replay(p, "model-overlap", costs, SETTINGS)
    assert over.token_ids == base.token_ids
    assert over.stats.spec.drafted_ahead > 0  # some drafts were made during the previous verification
    # Each step's drafting beside the verification is booked only where it outlasts it.
    assert 0 < ledger.hidden_s <= ledger.drafter_s and ledger.seconds < base_ledger.seconds


# -- the ceiling: the best any policy could do with the recorded drafts ------------------------
CURVED = rp.MachineCosts("curved", ((0, rp.curve({1: 1.0, 2: 1.3, 4: 1.6, 8: 2.4, 16: 3.0})),),
                         drafter=rp.curve({1: 0.05, 8: 0.2}), step_s=0.01)


def test_ceiling_without_drafts_is_plain_and_bounds_every_replayed_policy(trace):
    from ceiling import ceiling, ceiling_record

    for p in trace.prompts:
        plain = rp.replay_prompt(p, PLAIN, CURVED, SETTINGS)
        alone, steps = ceiling(p, CURVED, SETTINGS, sources=())
        decodes = plain.gen_tokens + (p.finish == "stop")  # the EOG is decoded, not emitted
        assert alone == pytest.approx(plain.gen_s) and len(steps) == decodes
        best, steps = ceiling(p, CURVED, SETTINGS)
        assert sum(c.accepted + 1 for c in steps) >= decodes
        assert ceiling_record(p, CURVED, SETTINGS).gen_tokens == plain.gen_tokens
        for config in ("suffix", "model", "hybrid", "auto", "model-tree", "hybrid-tree"):
            assert best <= rp.replay_prompt(p, config, CURVED, SETTINGS).gen_s + 1e-9, (p.id, config)
        assert best < alone  # the fake drafter agrees often enough that some step pays


def test_ceiling_picks_the_cheapest_sequence_of_steps():
    from ceiling import ceiling

    out = [10, 11, 12, 13, 14, 15, 16, 17]
    t = hand_trace(out, [10, 11, 12, 13, 99, 15, 16, 17], [1] * 8, [0] * 8)
    flat = rp.MachineCosts("flat", ((0, rp.curve({1: 1.0, 8: 1.0})),), drafter=rp.curve({1: 0.0}))
    s = rp.ReplaySettings(max_tokens=8, draft_max=4)
    seconds, steps = ceiling(t, flat, s, sources=("model",))
    # p=1: 11 12 13 accepted (99 refused), 14 the bonus; p=5: 15 16 accepted, 17 the bonus: the end
    assert [(c.source, c.accepted) for c in steps] == [("model", 3), ("model", 2)] and seconds == 2.0
    unsure = hand_trace(out, [10, 11, 12, 13, 99, 15, 16, 17], [1, 1, 1, 0, 1, 1, 1, 1], [0] * 8)
    seconds, steps = ceiling(unsure, flat, s, sources=("model",))  # the drafter stops before 13
    assert [c.accepted for c in steps] == [2, 0, 2] and seconds == 3.0
    steep = dataclasses.replace(flat, target=((0, rp.curve({1: 1.0, 2: 5.0, 8: 5.0})),))
    assert ceiling(t, steep, s, sources=("model",))[0] == 7.0  # drafting never pays: 7 plain steps


def test_replayed_auto_loads_the_drafter_only_where_its_rule_says_it_pays(trace):
    steep = rp.MachineCosts("steep", ((0, rp.curve({1: 1.0, 2: 1.9, 16: 20.0})),), drafter=rp.curve({1: 0.3}))
    cheap = rp.MachineCosts("cheap", ((0, rp.curve({1: 1.0, 2: 1.05, 16: 1.5})),), drafter=rp.curve({1: 0.01}))
    assert not rp.auto_loads(steep, SETTINGS) and rp.auto_loads(cheap, SETTINGS)
    p = trace.prompts[0]
    assert rp.run_replay(p, "auto", steep, SETTINGS)[1].drafter_rows == 0  # never loaded, never synced
    assert rp.run_replay(p, "auto", cheap, SETTINGS)[1].drafter_rows > 0


def test_a_decode_replays_its_graph_only_after_two_of_its_shape():
    """llama.cpp keeps one CUDA graph per context: a batch shaped like the two decodes before it
    in its context replays it; any other pays the miss (the target's and the drafter's apart)."""
    costs = dataclasses.replace(UNIT, graph_miss_s=(10.0, 100.0))
    ledger = rp.Ledger(costs)
    sizes = (1, 1, 1, 2, 1, 1, 1)  # miss miss warm miss miss miss warm
    for n in sizes:
        ledger.target(n, 0)
    assert ledger.target_s == sum(sizes) + 10 * 5 and ledger.graph_misses == [5, 0]
    # the drafter's context has its own graph: a catch-up, then a chain of single tokens
    for n in (2, 1, 1, 1):  # miss miss miss warm, whatever the target did
        ledger.drafter(n)
    assert ledger.drafter_s == 2 + 1 + 1 + 1 + 100 * 3 and ledger.graph_misses == [5, 3]
    free = rp.Ledger(UNIT)  # no miss priced: the curve alone, nothing counted
    for n in (1, 2, 1):
        free.target(n, 0)
    assert free.target_s == 4 and free.graph_misses == [0, 0]


def test_with_a_graph_per_shape_only_a_change_of_size_misses():
    """edgespec's llama.cpp keeps a graph per batch shape: a decode shaped like the one before it
    replays; a change (or a context's first decode) pays the per-shape miss."""
    ledger = rp.Ledger(dataclasses.replace(UNIT, graph_miss_s=(10.0, 100.0), graphs_per_shape=True))
    sizes = (1, 1, 2, 2, 1, 3, 3)  # miss warm miss warm miss miss warm
    for n in sizes:
        ledger.target(n, 0)
    assert ledger.target_s == sum(sizes) + 10 * 4 and ledger.graph_misses == [4, 0]
    for n in (2, 1, 1):  # miss miss warm
        ledger.drafter(n)
    assert ledger.drafter_s == 4 + 100 * 2 and ledger.graph_misses == [4, 2]


def test_graph_miss_is_the_median_extra_of_random_order_over_one_size_at_a_time():
    entry = {"curve": [{"n": 1, "ms": 1.0}, {"n": 2, "ms": 2.0}, {"n": 3, "ms": 3.0}],
             "mixed_ms": {"1": 2.0, "2": 2.5, "3": 7.0}}
    assert rp.graph_miss(entry) == pytest.approx(1e-3)  # extras 1.0, 0.5, 4.0 ms
    curves = {f"curve-{c}.json": {"curve": entry["curve"], "chain_ms_per_token": 1.0} for c in ("t", "d", "cpu")}
    costs = rp.costs_from_device_curves(curves, "t", "d", mixed={"mixed-d.json": entry})
    assert costs.graph_miss_s == (0.0, pytest.approx(1e-3))  # the target has no mixed entry
    assert not costs.graphs_per_shape
    shaped = rp.costs_from_device_curves(curves, "t", "d", per_shape=True,
                                         mixed={"mixed-d.json": entry, "mixed-t-per-shape.json": entry})
    assert shaped.graph_miss_s == (pytest.approx(1e-3), 0.0) and shaped.graphs_per_shape
    assert shaped.calibration_miss_s == 0.0  # the target has no stock entry: its calibration misses nothing
    stock_too = rp.costs_from_device_curves(curves, "t", "d", per_shape=True, mixed={
        "mixed-t.json": {**entry, "mixed_ms": {"1": 3.0, "2": 4.0, "3": 5.0}}, "mixed-t-per-shape.json": entry})
    assert stock_too.graph_miss_s[0] == pytest.approx(1e-3) and stock_too.calibration_miss_s == pytest.approx(2e-3)
    # auto's calibration meets a size's first two decodes, without a graph on either build
    assert stock_too.policy_model().verify(2) == pytest.approx(2e-3 + 2e-3)
    assert rp.costs_from_device_curves(curves, "cpu", "d").graph_miss_s == (0.0, 0.0)


def test_the_policy_sees_what_calibration_measures_on_a_gpu():
    """auto's calibration times each new size twice and keeps the faster: on a GPU both run
    without the context's graph, so batches of 2+ are priced with the miss; one token (after a
    warm-up) and a drafted token are timed with it."""
    costs = rp.MachineCosts("g", ((512, rp.curve({1: 1.0, 2: 2.0, 8: 3.0})),), drafter=rp.curve({1: 0.5}),
                            graph_miss_s=(0.25, 7.0))
    policy = costs.policy_model()
    assert (policy.verify(1), policy.verify(2), policy.verify(8)) == (1.0, 2.25, 3.25)
    assert policy.draft_token_s == 0.5
    free = dataclasses.replace(costs, graph_miss_s=(0.0, 0.0)).policy_model()
    assert (free.verify(1), free.verify(2)) == (1.0, 2.0)
