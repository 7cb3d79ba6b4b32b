"""The words of speculative decoding, defined once, and the flat draft tree.

Vocabulary (used the same way in code, stats and docs):

* **step** - one target forward pass that verifies a draft (plain decoding: one step per token).
* **drafted** tokens - tokens a drafter proposed for a step (the nodes of the draft tree).
* **accepted** tokens - drafted tokens the target agreed with: the longest path from the root
  that the acceptance rule keeps.
* **bonus** token - the target's own token after the last accepted one (sampled from the
  target distribution, or from the residual distribution after a rejection). Every step
  yields exactly one.
* **emitted** tokens = accepted + bonus: what a step adds to the output (>= 1).

A draft is a flat tree in topological order: node ``i`` holds ``tokens[i]`` and its parent
index ``parents[i]`` (``-1`` for children of the root, which is the last token already in the
cache); ``parents[i] < i``. Siblings appear in the order they were drawn. For drafts sampled
from a model, ``q_ids[i]`` / ``q_probs[i]`` give the sparse draft distribution at node ``i``'s
parent from which node ``i`` and its siblings were drawn (identical for all siblings), which
exact rejection sampling needs; deterministic drafts (suffix, greedy trees) leave them None.
``scores[i]`` is the drafter's own estimate of the probability that the target reaches node
``i`` (suffix: product of continuation frequencies; model tree: product of draft
probabilities), and ``match_len`` the length of the suffix match a suffix draft continues.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    tokens: np.ndarray  # [n] int64 token ids
    parents: np.ndarray  # [n] int64, -1 for the root's children, parents[i] < i
    q_ids: tuple[np.ndarray, ...] | None = None  # per node: ids of the draft distribution
    q_probs: tuple[np.ndarray, ...] | None = None  # per node: probabilities over q_ids (sum 1)
    source: str = ""  # drafter name, for stats
    scores: np.ndarray | None = None  # [n] float64 estimated probability of reaching each node
    match_len: int = 0  # suffix drafts: tokens of context matched in the index

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError("tokens and parents differ in length")
        parents = np.asarray(self.parents)
        bad = np.flatnonzero((parents < -1) | (parents >= np.arange(n))) if n else ()  # 63 nodes: 6 µs, not 17
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"node {i}: parent {parents[i]} must be in [-1, {i})")
        if (self.q_ids is None) != (self.q_probs is None):
            raise ValueError("q_ids and q_probs go together")
        if self.q_ids is not None and (len(self.q_ids) != n or len(self.q_probs) != n):
            raise ValueError("one draft distribution per node")
        if self.scores is not None and len(self.scores) != n:
            raise ValueError("one score per node")

    @classmethod
    def empty(cls, source: str = "", match_len: int = 0) -> "DraftTree":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), source=source, match_len=match_len)

    @classmethod
    def chain(cls, tokens, source: str = "", q_ids=None, q_probs=None, scores=None) -> "DraftTree":
        """A linear draft: each node the child of the previous one."""
        n = len(tokens)
        return cls(np.asarray(tokens, np.int64), np.arange(-1, n - 1, dtype=np.int64),
                   None if q_ids is None else tuple(q_ids),
                   None if q_probs is None else tuple(q_probs), source=source,
                   scores=None if scores is None else np.asarray(scores, np.float64))

    def prefix(self, n: int) -> "DraftTree":
        """The first ``n`` nodes: a valid tree, since nodes are in topological order."""
        cut = lambda xs: None if xs is None else xs[:n]  # noqa: E731
        return self._valid(tokens=self.tokens[:n], parents=self.parents[:n], q_ids=cut(self.q_ids),
                           q_probs=cut(self.q_probs), scores=cut(self.scores))

    def relabel(self, source: str) -> "DraftTree":
        """The same draft credited to another drafter in the stats."""
        return self._valid(source=source)

    def _valid(self, **changes) -> "DraftTree":
        """This tree with ``changes`` that keep it valid (a prefix, a label), not checked again:
        the check costs 6 µs for 63 nodes, and a step takes a prefix or two."""
        tree = object.__new__(DraftTree)
        tree.__dict__.update(self.__dict__, **changes)
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def stochastic(self) -> bool:
        """True when nodes were sampled from a draft distribution that is recorded."""
        return self.q_ids is not None

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (-1 for the root), in drawing order."""
        return [i for i in range(len(self.tokens)) if self.parents[i] == node]

    def depth(self) -> np.ndarray:
        """[n] depth of each node (1 for the root's children)."""
        d: list[int] = []
        for p in self.parents.tolist():
            d.append(1 if p < 0 else d[p] + 1)
        return np.array(d, np.int64)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]
