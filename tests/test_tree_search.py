"""Best-first trees (edgespec.spec.tree_search) against brute force, and the drafter's path KV
(edgespec.drafters.tree_kv) against plain decoding of each path, on the exact fake model."""
from __future__ import annotations

import heapq

import numpy as np
import pytest

from edgespec.decode.sampling import greedy_logprob, logsumexp, top_ids
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.tree_kv import PathKV
from edgespec.spec.tree_search import (
    Children,
    accepted_by,
    accepted_path,
    best_first,
    top_children,
)
from tests.fake_model import FakeContext, FakeModel

MODEL = FakeModel(n_vocab=40, seed=3, sharpness=2.5)
CONTEXT = [0, 5, 9, 13, 5, 9]


def children_of(path, branch=4) -> Children:
    return top_children(MODEL.logits(np.asarray(CONTEXT + list(path))), branch)


def brute_force_top(budget: int, branch: int = 4) -> list[tuple[float, tuple[int, ...]]]:
    """The top nodes one at a time: pop the most probable known node, then learn its children
    (a child never outscores its parent, so the pops come best first)."""
    root = children_of((), branch)
    heap = [(-lp, (t,)) for t, lp in zip(root.ids, root.logps)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < budget:
        neg, path = heapq.heappop(heap)
        out.append((-neg, path))
        c = children_of(path, branch)
        for t, lp in zip(c.ids, c.logps):
            heapq.heappush(heap, (neg - lp, path + (t,)))
    return out


@pytest.mark.parametrize("budget,round_size", [(1, 32), (5, 1), (12, 4), (30, 32), (30, 7)])
def test_the_tree_is_the_exact_top_budget_whatever_the_rounds(budget, round_size):
    calls = []

    def expand(paths):
        calls.append(len(paths))
        return [children_of(p) for p in paths]

    found = best_first(children_of(()), expand, budget, round_size=round_size)
    tree = found.tree
    got = sorted(tuple(int(tree.tokens[i]) for i in tree.path_to(k)) for k in range(len(tree)))
    want = sorted(path for _, path in brute_force_top(budget))
    assert got == want and len(tree) == budget
    assert all(tree.scores[i] <= tree.scores[int(tree.parents[i])] for i in range(len(tree)) if tree.parents[i] >= 0)
    assert list(tree.scores) == sorted(tree.scores, reverse=True)  # best first: prefixes are smaller trees
    assert max(calls) <= round_size and found.rounds == len(calls) and found.expansions == sum(calls)


def test_trees_are_nested_so_one_tree_tells_every_smaller_budget():
    expand = lambda paths: [children_of(p) for p in paths]
    big = best_first(children_of(()), expand, 40).tree
    plain = [int(big.tokens[i]) for i in big.path_to(len(big) - 1)] + [7]  # a continuation deep in the tree
    path = accepted_path(big, plain)
    for b, accepted in accepted_by(path, (1, 4, 10, 25, 40)).items():
        small = best_first(children_of(()), expand, b).tree
        assert len(accepted_path(small, plain)) == accepted


def test_max_expansions_bounds_the_decodes_and_floor_prunes():
    expand = lambda paths: [children_of(p) for p in paths]
    capped = best_first(children_of(()), expand, 30, round_size=4, max_expansions=6)
    assert capped.expansions == 6 and len(capped.tree) == 4 + 6 * 4  # all it discovered
    floored = best_first(children_of(()), expand, 30, min_logp=np.log(0.05))
    assert 0 < len(floored.tree) < 30 and floored.tree.scores.min() >= 0.05 - 1e-12


def test_path_kv_rows_equal_plain_decoding_and_it_frees_every_sequence():
    ctx = FakeContext(MODEL, n_ctx=256, n_seq_max=6, n_ubatch=64)
    ctx.decode(CONTEXT, range(len(CONTEXT)), [[0]] * len(CONTEXT), [True] * len(CONTEXT))
    kv = PathKV(ctx)
    base = len(CONTEXT)
    rng = np.random.default_rng(0)
    paths = [()]
    for _ in range(40):  # random trees; more paths than sequences force releases and re-decodes
        parent = paths[int(rng.integers(len(paths)))]
        batch = [parent + (int(t),) for t in rng.choice(np.arange(2, 40), size=int(rng.integers(1, 3)), replace=False)]
        batch = [p for p in dict.fromkeys(batch) if p not in paths]
        rows = kv.decode([(base, p) for p in batch])
        for p, row in zip(batch, rows):
            np.testing.assert_array_equal(row, MODEL.logits(np.asarray(CONTEXT + list(p))))
        paths += batch
        if rng.random() < 0.2:
            kv.release(lambda n: len(n[1]) > 2)
    kv.release()
    assert ctx.cells(0) == list(enumerate(CONTEXT)) and ctx.used_cells == len(CONTEXT)
    assert all(ctx.seq_pos_max(s) == -1 for s in range(1, ctx.n_seq_max))


def test_the_model_drafter_drafts_the_search_tree_and_leaves_only_its_context():
    ctx = FakeContext(MODEL, n_ctx=512, n_seq_max=64, n_ubatch=64)
    drafter = ModelDrafter(MODEL, tree=True, min_confidence=0.0, ctx=ctx, branch=4)
    drafter.begin(CONTEXT)
    tree = drafter.propose(CONTEXT, 40)  # the largest size of the menu within 40
    want = sorted(path for _, path in brute_force_top(31))
    assert sorted(tuple(int(tree.tokens[i]) for i in tree.path_to(k)) for k in range(len(tree))) == want
    assert ctx.cells(0) == list(enumerate(CONTEXT)) and ctx.used_cells == len(CONTEXT)


@pytest.mark.parametrize("budget,round_size", [(30, None), (63, None), (63, 16)])
def test_a_search_holds_at_most_its_budget_of_nodes_so_it_needs_no_more_sequences(budget, round_size):
    """``forget`` frees the nodes that left the top: a search that decodes more nodes than its
    context has sequences runs there, every node decoded once (no release, no re-decoded path),
    and still finds the exact top."""
    ctx = FakeContext(MODEL, n_ctx=512, n_seq_max=budget + 1, n_ubatch=64)
    ctx.decode(CONTEXT, range(len(CONTEXT)), [[0]] * len(CONTEXT), [True] * len(CONTEXT))
    kv, base, held = PathKV(ctx), len(CONTEXT), []

    def expand(paths):
        rows = kv.decode([(base, p) for p in paths])
        held.append(ctx.used_cells - base)
        for p, row in zip(paths, rows):
            np.testing.assert_array_equal(row, MODEL.logits(np.asarray(CONTEXT + list(p))))
        return [top_children(row, 4) for row in rows]

    found = best_first(children_of(()), expand, budget, round_size,
                       forget=lambda paths: kv.forget([(base, p) for p in paths]))
    assert found.expansions > budget  # more nodes than sequences
    assert ctx.rows_evaluated - base == found.expansions and max(held) <= budget
    tree = found.tree
    got = sorted(tuple(int(tree.tokens[i]) for i in tree.path_to(k)) for k in range(len(tree)))
    assert got == sorted(path for _, path in brute_force_top(budget))
    kv.release()
    assert ctx.cells(0) == list(enumerate(CONTEXT)) and ctx.used_cells == base


@pytest.mark.parametrize("scale", [0.5, 3.0, 40.0])  # flat (every token within 16 nats), a drafter's, peaked
def test_top_ids_and_the_normaliser_agree_with_the_whole_row_in_float64(scale):
    rng = np.random.default_rng(7)
    for _ in range(20):
        row = (rng.standard_normal(151936) * scale).astype(np.float32)
        row[rng.integers(0, len(row), 50)] = -np.inf  # masked tokens
        for k in (1, 8, 40):
            assert set(top_ids(row, k)) == set(np.argsort(-row.astype(np.float64), kind="stable")[:k])
        x = row.astype(np.float64)
        want = x.max() + np.log(np.exp(x - x.max()).sum())
        assert abs(logsumexp(row) - want) < 1e-6
        token, logp = greedy_logprob(row)
        assert token == int(np.argmax(row)) and abs(logp - (x[token] - want)) < 1e-6


def test_top_ids_on_short_rows_and_rows_mostly_masked():
    """The sampled threshold falls back to a partition of the whole row where it cannot serve:
    rows shorter than a few samples, k above the row, rows whose sample is masked (-inf)."""
    rng = np.random.default_rng(11)
    for n, k in ((1, 1), (10, 20), (130, 8), (200, 64), (5000, 40)):
        row = rng.standard_normal(n).astype(np.float32)
        assert set(top_ids(row, k)) == set(np.argsort(-row, kind="stable")[:k]), (n, k)
    row = np.full(151936, -np.inf, np.float32)
    live = rng.choice(len(row), 30, replace=False)
    row[live] = rng.standard_normal(30)
    assert set(top_ids(row, 8)) == set(np.argsort(-row, kind="stable")[:8])
    assert set(top_ids(row, 40)) >= set(live)  # all 30 live tokens, then any 10 masked ones
    broken = rng.standard_normal(151936).astype(np.float32)
    broken[::50] = np.nan  # NaN ranks below every number, as candidate_ids always took it
    finite = np.where(np.isnan(broken), -np.inf, broken)
    for k in (8, 40):
        assert set(top_ids(broken, k)) == set(np.argsort(-finite, kind="stable")[:k])
