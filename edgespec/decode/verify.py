"""Pure layout of a draft tree for one-batch verification, and draft trimming.

Every root-to-leaf path of a tree gets its own sequence id (1..k, in leaf order), and each node
carries the ids of all paths through it, so it attends to exactly its ancestors. A chain needs
no extra sequences. The KV edits themselves belong to edgespec.decode.sequence.KVSequence.
"""
from __future__ import annotations

import numpy as np

from edgespec.decode.tree import DraftTree


def leaves_of(draft: DraftTree) -> list[int]:
    """Nodes without children, in index order."""
    has_child = np.zeros(len(draft) + 1, bool)  # the last slot takes the root's children (-1)
    has_child[draft.parents] = True
    return np.flatnonzero(~has_child[:-1]).tolist()


def is_chain(draft: DraftTree) -> bool:
    return draft.parents.tolist() == list(range(-1, len(draft) - 1))  # lists: a third of numpy's µs


def path_layout(draft: DraftTree) -> tuple[list[int], list[list[int]]]:
    """(leaves, node_paths): node_paths[i] = sorted sequence ids (1-based) of paths through i."""
    leaves, parents = leaves_of(draft), draft.parents.tolist()
    node_paths: list[list[int]] = [[] for _ in parents]
    for k, leaf in enumerate(leaves, 1):  # leaves in increasing order: each list comes out sorted
        node = leaf
        while node >= 0:
            node_paths[node].append(k)
            node = parents[node]
    return leaves, node_paths


def main_path(draft: DraftTree) -> DraftTree:
    """The chain from the root through each node's first child: the likeliest path of a
    best-first tree, the first sample drawn of a sampled one."""
    first: dict[int, int] = {}
    for i, p in enumerate(draft.parents):
        first.setdefault(int(p), i)
    nodes, node = [], -1
    while node in first:
        node = first[node]
        nodes.append(node)
    pick = np.array(nodes, dtype=np.int64)
    return DraftTree(draft.tokens[pick], np.arange(-1, len(nodes) - 1, dtype=np.int64),
                     tuple(draft.q_ids[i] for i in nodes) if draft.q_ids is not None else None,
                     tuple(draft.q_probs[i] for i in nodes) if draft.q_probs is not None else None,
                     draft.source, draft.scores[pick] if draft.scores is not None else None, draft.match_len)


def fit_draft(draft: DraftTree, max_paths: int, max_nodes: int) -> DraftTree:
    """The largest prefix of the draft (in index order) with few enough leaves and nodes.

    Nodes are topologically ordered, so any prefix is itself a valid tree.
    """
    best, leaves, parents_seen = 0, 0, set()
    for k, p in enumerate(draft.parents[:max(min(len(draft), max_nodes), 0)].tolist(), 1):
        leaves += 1  # node k-1 is a leaf of the prefix of k nodes ...
        if p >= 0 and p not in parents_seen:  # ... and its parent no longer is
            parents_seen.add(p)
            leaves -= 1
        if leaves <= max_paths:
            best = k
    return draft if best == len(draft) else draft.prefix(best)
