"""Exact replay of best-first model trees (edgespec.spec.tree_search), SpecExec-sized.

A greedy step accepts the longest path of the draft that follows the plain output, so what a
tree of any budget accepts after ``output[:p]`` is a function of the drafter and the plain
output alone. The recorder runs the drafter's real search (``best_first``, the runtime's code)
at every position ``p`` for every budget of a menu and keeps, per budget, what the tree accepted
and what growing it cost (rounds, expansions), plus the node indices of the accepted path in
the largest tree (what smaller budgets would have accepted: the policy's evidence). Node
expansions off the plain path are decoded once and shared between positions and budgets
(``PathKV`` keeps their cells while a later root still lies above them); nodes on the plain path
are read from one teacher-forced pass. Replay (``TraceTreeDrafter``) then drafts, for the
budget its policy picks, a tree of that many nodes holding the recorded accepted path, and books
the recorded rounds on the drafter's batch curve.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from replay import OFF_PATH, Ledger, PromptTrace, TraceChainDrafter, TreeTrace, teacher_forced

from edgespec.drafters.auto.policy import CostModel, TreeSizes
from edgespec.drafters.model import MAX_EXPANSIONS, TREE_SIZES
from edgespec.drafters.tree_kv import PathKV
from edgespec.decode.tree import DraftTree
from edgespec.spec.tree_search import Children, accepted_path, best_first, top_children

BRANCH = 8
ROUND = None  # every unexpanded node of the current top per round (edgespec.spec.tree_search)


def _plain_children(ctx, prompt: Sequence[int], output: Sequence[int], branch: int) -> list[Children]:
    """Sequence 0 := prompt + output; the drafter's children after prompt + output[:q], q = 0..n."""
    return [top_children(row, branch) for _, row in teacher_forced(ctx, list(prompt) + list(output), len(prompt) - 1)]


def record_trees(ctx, prompt: Sequence[int], output: Sequence[int], budgets: Sequence[int] = TREE_SIZES,
                 branch: int = BRANCH, round_size: int | None = ROUND, max_expansions: int = MAX_EXPANSIONS) -> TreeTrace:
    """The TreeTrace of one prompt (``ctx``: the drafter's context, cleared here; it needs
    ``max_expansions`` + 1 sequences and room for prompt + output + the live off-path cells)."""
    ctx.clear()
    plain = _plain_children(ctx, prompt, output, branch)
    base = len(prompt)
    kv = PathKV(ctx)
    cache: dict[tuple[int, tuple[int, ...]], Children] = {}  # off-path node (q, tokens) -> children
    budgets = tuple(sorted(budgets, reverse=True))
    rows: list[tuple[list[int], list[int], list[int], tuple[int, ...]]] = []
    try:
        for p in range(len(output)):
            expand = _expander(p, output, plain, cache, kv, base, branch)
            acc, rnd, exp = {}, {}, {}
            for b in budgets:
                found = best_first(plain[p], expand, b, round_size, max_expansions)
                path = accepted_path(found.tree, output[p:])
                acc[b], rnd[b], exp[b] = len(path), found.rounds, found.expansions
                if b == budgets[0]:
                    ranks = tuple(path)
            order = sorted(acc)
            rows.append(([acc[b] for b in order], [rnd[b] for b in order], [exp[b] for b in order], ranks))
            cache = {k: v for k, v in cache.items() if k[0] > p}
            kv.release(lambda node, p=p: node[0] <= base + p)
    finally:
        kv.release()
        ctx.clear()
    return TreeTrace(tuple(sorted(budgets)), *(tuple(tuple(r[i]) for r in rows) for i in range(3)),
                     tuple(r[3] for r in rows), branch, round_size, max_expansions)


def _expander(p: int, output: Sequence[int], plain: list[Children], cache: dict, kv: PathKV, base: int,
              branch: int):
    """expand() for trees rooted after output[:p]: plain-path nodes from the teacher-forced pass,
    off-path nodes from the cache or decoded in one batch."""
    def expand(paths):
        keys = []
        for path in paths:
            j = 0
            while j < len(path) and p + j < len(output) and path[j] == output[p + j]:
                j += 1
            keys.append(None if j == len(path) else (p + j, tuple(path[j:])))
        todo = list(dict.fromkeys(k for k in keys if k is not None and k not in cache))
        if todo:
            for k, row in zip(todo, kv.decode([(base + q, toks) for q, toks in todo])):
                cache[k] = top_children(row, branch)
        return [plain[p + len(path)] if k is None else cache[k] for path, k in zip(paths, keys)]
    return expand


class TraceTreeDrafter(TraceChainDrafter):
    """The `model` drafter drafting best-first trees, read from a TreeTrace; a chain when asked
    (``tree=False``: `auto` picks per step), read from the DrafterTrace.

    Its tree of the chosen size holds the recorded accepted path (at the nodes' recorded
    places in the largest tree, so the size policy learns what every smaller size would have
    accepted, as ModelDrafter does) and off-path nodes for the rest; the search's recorded
    rounds are booked as drafter batches sharing the recorded expansions.
    """

    def __init__(self, trace: PromptTrace, ledger: Ledger, n_ctx: int, cache: list[int] | None = None,
                 sizes: TreeSizes | None = None, cost: CostModel | None = None):
        if trace.trees is None:
            raise ValueError(f"trace {trace.id} has no tree records")
        super().__init__(trace, ledger, n_ctx, cache)
        self.sizes, self.cost = sizes if sizes is not None else TreeSizes(TREE_SIZES), cost
        self.tree = True
        self._verifying: DraftTree | None = None

    def propose(self, context: Sequence[int], budget: int, stop=None, tree: bool | None = None) -> DraftTree:
        if tree is False:  # `auto` asked for a chain: replayed as far as chains were recorded
            return super().propose(context, min(budget, self.trace.drafter.off_cap + 1), stop)
        t = self.trace.trees
        q = len(context) - len(self.trace.prompt)
        size = budget if tree else self.sizes.size(budget, self.cost)  # tree=True: `auto` sized it
        if size <= 0 or q >= len(t.accepted) or len(context) + size + 1 >= self.n_ctx:
            return DraftTree.empty(self.name)
        self._sync(context)
        k = t.budgets.index(size)
        booked = self.ledger.drafter_s
        for n in t.round_rows(q, k):
            self.ledger.drafter(n, expanded=n)
        self.sizes.searched(size, self.ledger.drafter_s - booked)
        self._verifying = self._tree(q, size, t.accepted[q][k], t.ranks[q])
        return self._verifying

    def observe(self, emitted: Sequence[int]) -> None:
        tree, self._verifying = self._verifying, None
        self.sizes.learn(tree, emitted)

    def _tree(self, q: int, size: int, accepted: int, ranks: Sequence[int]) -> DraftTree:
        places = list(ranks[:accepted])
        if len(places) < accepted or (places and places[-1] >= size):  # not nested here: keep the count
            places = list(range(accepted))
        tokens = [OFF_PATH] * size
        parents = [-1] * size
        for d, node in enumerate(places):
            tokens[node] = self.trace.output[q + d]
            parents[node] = places[d - 1] if d else -1
        return DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), source=self.name)
