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
    has_child = np.zeros(len(draft), bool)
    for p in draft.parents:
        if p >= 0:
            has_child[p] = True
    return [i for i in range(len(draft)) if not has_child[i]]


def is_chain(draft: DraftTree) -> bool:
    return all(int(p) == i - 1 for i, p in enumerate(draft.parents))


def path_layout(draft: DraftTree) -> tuple[list[int], list[list[int]]]:
    """(leaves, node_paths): node_paths[i] = sorted sequence ids (1-based) of paths through i."""
    leaves = leaves_of(draft)
    node_paths: list[set[int]] = [set() for _ in range(len(draft))]
    for k, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            node_paths[node].add(k + 1)
            node = int(draft.parents[node])
    return leaves, [sorted(s) for s in node_paths]


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
    n = min(len(draft), max_nodes)
    while n > 0 and len(leaves_of(draft.prefix(n))) > max_paths:
        n -= 1
    return draft if n == len(draft) else draft.prefix(n)
