"""Best-first draft trees (SpecExec): the ``budget`` most probable nodes of a drafter's tree.

The drafter's tree gives every node its ``branch`` most probable next tokens; a node's score is
the cumulative log-probability of its path from the root. The draft is the exact top-``budget``
nodes by score (ties: the earlier discovered first). A child never outscores its parent, so the
top nodes form a tree, and once every node in the current top-``budget`` of the discovered
nodes has been expanded no undiscovered node can enter it. The search expands in rounds: the
unexpanded nodes of the current top-``budget`` whose score is within ``band`` of the best of
them (at most ``round_size`` when given), decoded by the caller in one batch. A round reaches
one level deeper, so a tree of depth d takes at least d rounds, as a chain of d tokens takes d
decodes. The band keeps unlikely shallow nodes waiting while a confident chain grows, so most
of them leave the top before anyone decodes them: with the real 0.5B drafter on code edits a
63-node tree took ~115 expansions, and more than 255 when every unexpanded top node was
expanded each round. ``max_expansions`` bounds the decodes; when it binds, the draft is the
top-``budget`` of what was discovered. A node that leaves the top-``budget`` never returns
(discoveries only push it down) and takes its subtree with it, so no later round extends it:
``forget`` hears of each expanded node as it leaves, and a drafter that frees their cells holds
at most ``budget`` expanded nodes at any time, however many the search decodes.

Trees are nested: the first ``b`` nodes of an exact top-``budget`` tree are the exact top-``b``
tree, so one drafted tree tells what every smaller budget would have accepted (``accepted_by``).
Pure: ``expand(paths)`` does the decoding; the runtime drafter and the replay recorder share it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edgespec.decode.sampling import logsumexp, top_ids
from edgespec.decode.tree import DraftTree

Path = tuple[int, ...]  # tokens from the root's child down to a node
BAND = float(np.log(0.01))  # a round expands nodes at most 100x less likely than its best one


@dataclass(frozen=True)
class Children:
    """A node's ``branch`` most probable next tokens and their log-probabilities, best first."""

    ids: tuple[int, ...]
    logps: tuple[float, ...]


def top_children(logits: np.ndarray, branch: int) -> Children:
    """The ``branch`` best tokens of a logits row and their log-probabilities, best first, ties
    by id (within the chosen set). Only the chosen entries are normalised, but the normaliser
    (sampling.logsumexp) reads the whole row: a node costs 0.32-0.34 ms of Python on the dev VM,
    0.7 ms in float64 throughout (benchmarks/results/logits-rows.json), beside the 0.5B's
    1.26 ms decode on an H100 or H200."""
    row = np.asarray(logits)
    ids = top_ids(row, branch)
    lp = row[ids].astype(np.float64) - logsumexp(row)
    order = np.lexsort((ids, -lp))
    return Children(tuple(int(i) for i in ids[order]), tuple(float(v) for v in lp[order]))


@dataclass(frozen=True)
class SearchResult:
    tree: DraftTree  # nodes best first (a topological order); scores = path probabilities
    rounds: int  # expand() calls
    expansions: int  # paths expanded in all


def best_first(root: Children, expand: Callable[[list[Path]], Sequence[Children]], budget: int,
               round_size: int | None = None, max_expansions: int = 255, min_logp: float = -np.inf,
               band: float = BAND, source: str = "model",
               forget: Callable[[list[Path]], None] | None = None) -> SearchResult:
    """The top-``budget`` tree under ``root``'s children (see the module docstring); nodes whose
    path log-probability is below ``min_logp`` are never drafted (the tree may be smaller);
    ``forget(paths)``: expanded nodes that left the top, before each round."""
    paths: list[Path] = []
    scores: list[float] = []
    parents: list[int] = []
    expanded: list[bool] = []

    def discover(parent: int, children: Children) -> None:
        base = () if parent < 0 else paths[parent]
        base_score = 0.0 if parent < 0 else scores[parent]
        for t, lp in zip(children.ids, children.logps):
            if base_score + lp < min_logp:
                break  # children come best first
            paths.append(base + (t,))
            scores.append(base_score + lp)
            parents.append(parent)
            expanded.append(False)

    discover(-1, root)
    rounds = expansions = 0
    held: set[int] = set()  # expanded nodes not yet forgotten
    while True:
        top = np.lexsort((np.arange(len(scores)), -np.asarray(scores)))[:budget].tolist()
        gone = held.difference(top)
        if gone and forget is not None:
            forget([paths[i] for i in sorted(gone)])
        held -= gone
        todo = [i for i in top if not expanded[i]]
        if todo:  # the best unexpanded node comes first in ``top``
            todo = [i for i in todo if scores[i] >= scores[todo[0]] + band]
        todo = todo[:min(round_size or budget, max_expansions - expansions)]
        if not todo:
            break
        for i, children in zip(todo, expand([paths[i] for i in todo])):
            expanded[i] = True
            held.add(i)
            discover(i, children)
        rounds += 1
        expansions += len(todo)
    index = {node: k for k, node in enumerate(top)}
    tree = DraftTree(np.asarray([paths[i][-1] for i in top], np.int64),
                     np.asarray([index[parents[i]] if parents[i] >= 0 else -1 for i in top], np.int64),
                     source=source, scores=np.exp(np.asarray([scores[i] for i in top], np.float64)))
    return SearchResult(tree, rounds, expansions)


def accepted_path(tree: DraftTree, emitted: Sequence[int]) -> list[int]:
    """Node indices of the longest path from the root that spells a prefix of ``emitted``."""
    path: list[int] = []
    parent = -1
    for token in emitted:
        nxt = next((i for i in tree.children(parent) if tree.tokens[i] == token), None)
        if nxt is None:
            break
        path.append(nxt)
        parent = nxt
    return path


def accepted_by(path: Sequence[int], budgets: Sequence[int]) -> dict[int, int]:
    """What each budget's tree (its first b nodes) would have accepted, for a tree whose
    accepted path is ``path`` (node indices; they increase with depth, as parents precede
    children, so the path's nodes below b are the accepted path of the first b nodes)."""
    return {b: sum(1 for node in path if node < b) for b in budgets}
