"""One-batch verification of a draft tree on the target, and the KV rollback after it.

Layout of a step: the cache holds the context (positions 0..L-1) in sequence 0; the last
emitted token (*pending*, not yet in the cache) sits at position L, and draft node i at
position L + depth(i). Every root-to-leaf path of the tree gets its own sequence id, and each
token carries the ids of all paths through it, so it attends to exactly its ancestors (the
context is shared into every path sequence first). A chain needs no extra sequences at all.

After acceptance, ``commit`` keeps pending + the accepted path in sequence 0 and drops
everything else, so the next step continues from a cache equal to a fresh prefill.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edgespec.backend import LlamaContext
from edgespec.draft import DraftTree

SEQ_MAIN = 0


def leaves_of(draft: DraftTree) -> list[int]:
    """Nodes without children, in index order."""
    has_child = np.zeros(len(draft), bool)
    for p in draft.parents:
        if p >= 0:
            has_child[p] = True
    return [i for i in range(len(draft)) if not has_child[i]]


def is_chain(draft: DraftTree) -> bool:
    return all(int(p) == i - 1 for i, p in enumerate(draft.parents))


def fit_draft(draft: DraftTree, max_paths: int, max_nodes: int) -> DraftTree:
    """The largest prefix of the draft (in index order) with few enough leaves and nodes.

    Nodes are topologically ordered, so any prefix is itself a valid tree.
    """
    n = min(len(draft), max_nodes)
    while n > 0 and len(leaves_of(_prefix(draft, n))) > max_paths:
        n -= 1
    return draft if n == len(draft) else _prefix(draft, n)


def _prefix(draft: DraftTree, n: int) -> DraftTree:
    return DraftTree(draft.tokens[:n], draft.parents[:n],
                     None if draft.q_ids is None else draft.q_ids[:n],
                     None if draft.q_probs is None else draft.q_probs[:n],
                     source=draft.source, meta=draft.meta)


class TreeVerifier:
    """Owns the target context's KV layout during speculative steps."""

    def __init__(self, ctx: LlamaContext):
        self.ctx = ctx

    @property
    def max_paths(self) -> int:
        return self.ctx.n_seq_max - 1

    def verify(self, n_cached: int, pending: int, draft: DraftTree) -> Callable[[int], np.ndarray]:
        """Decodes pending + the whole draft in ONE batch.

        Args:
            n_cached: L, tokens of sequence 0 already in the cache.
            pending: the last emitted token, placed at position L.
            draft: nodes placed at L + depth; must fit ``max_paths`` leaves.
        Returns:
            row(r) -> [n_vocab] logits: r = 0 after pending, r = i + 1 after node i.
        """
        n = len(draft)
        depth = draft.depth()
        positions = [n_cached] + [n_cached + int(d) for d in depth]
        tokens = [pending] + [int(t) for t in draft.tokens]
        if n == 0 or is_chain(draft):
            seqs = [[SEQ_MAIN]] * (n + 1)
        else:
            seqs = self._path_sequences(draft, n_cached)
        rows = self.ctx.decode_rows(tokens, positions, seqs, [True] * (n + 1))
        return rows

    def _path_sequences(self, draft: DraftTree, n_cached: int) -> list[list[int]]:
        leaves = leaves_of(draft)
        if len(leaves) > self.max_paths:
            raise ValueError(f"draft has {len(leaves)} paths; the context allows {self.max_paths}")
        node_seqs: list[set[int]] = [set() for _ in range(len(draft))]
        for k, leaf in enumerate(leaves):
            seq = k + 1
            # The context must be visible from every path.
            self.ctx.seq_cp(SEQ_MAIN, seq, 0, n_cached)
            node = leaf
            while node >= 0:
                node_seqs[node].add(seq)
                node = int(draft.parents[node])
        all_paths = list(range(1, len(leaves) + 1))
        return [all_paths] + [sorted(s) for s in node_seqs]

    def commit(self, n_cached: int, draft: DraftTree, path: list[int] | tuple[int, ...]) -> None:
        """Leaves sequence 0 = context + pending + accepted path; frees every other entry."""
        keep_until = n_cached + 1 + len(path)  # exclusive end position
        if len(draft) == 0 or is_chain(draft):
            self.ctx.seq_rm(SEQ_MAIN, keep_until, -1)
            return
        leaves = leaves_of(draft)
        seq = self._path_through(draft, leaves, path[-1] if path else None)
        self.ctx.seq_cp(seq, SEQ_MAIN, n_cached, keep_until)
        for k in range(len(leaves)):
            self.ctx.seq_rm(k + 1, -1, -1)

    @staticmethod
    def _path_through(draft: DraftTree, leaves: list[int], node: int | None) -> int:
        """A path sequence id containing ``node`` (any path when node is None)."""
        if node is None:
            return 1
        for k, leaf in enumerate(leaves):
            if node in draft.path_to(leaf):
                return k + 1
        raise AssertionError(f"node {node} is on no path")
