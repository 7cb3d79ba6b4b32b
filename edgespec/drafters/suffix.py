"""The `suffix` drafter: model-free drafts from a suffix index (SuffixDecoding-style).

The index (edgespec/drafters/suffix_index.py; C when built) holds the current request's prompt and
output, growing with every step, plus a bounded history of earlier requests in this process.
Each step proposes a tree of the most frequent continuations of the longest suffix of the
context seen before; the tree grows with the match length (``alpha`` tokens per matched
token, at most ``max_spec``) and keeps only nodes whose estimated probability (product of
continuation frequencies along the path) is at least ``min_prob``. Drafts are deterministic,
so they carry no draft distribution.

The index only knows continuations within ``max_depth`` tokens of a match's start, so a
match of length L leaves room for ``max_depth - L`` drafted tokens. Matching the longest
possible suffix would starve exactly the copy-heavy text that pays most (a verbatim copy
matches 31 of 32 tokens and could draft one), so the match is capped at ``max_match``
tokens, leaving ``max_depth - max_match`` (>= ``max_spec``) of room.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgespec.decode.tree import DraftTree
from edgespec.decode.verify import main_path
from edgespec.drafters.suffix_index import SuffixIndex
from edgespec.memory.footprint import SUFFIX_BYTES_PER_TOKEN, SUFFIX_HISTORY_TOKENS
from edgespec.memory.placements import CHAINS

NAME = "suffix"
BYTES_PER_TOKEN = SUFFIX_BYTES_PER_TOKEN
DEFAULT_HISTORY_TOKENS = SUFFIX_HISTORY_TOKENS


class SuffixDrafter:
    """Drafts from a suffix index over this request and earlier ones."""

    name = NAME

    def __init__(self, max_depth: int = 64, max_history_tokens: int = DEFAULT_HISTORY_TOKENS,
                 max_spec: int = CHAINS.draft_max,
                 alpha: float = 1.0, min_prob: float = 0.1, max_match: int | None = None,
                 index=None, chains: bool = False) -> None:
        """``index``: an existing index to share (e.g. across drafter instances), else a new one.

        ``max_match``: longest suffix matched (default ``max_depth - max_spec``, at least 1).
        ``chains``: propose each tree's main path (its likeliest continuation) only.
        """
        self.chains = chains
        self.index = index if index is not None else SuffixIndex(
            max_depth=max_depth, max_history_tokens=max_history_tokens, max_spec=max_spec,
            alpha=alpha, min_prob=min_prob)
        depth, spec = self.index.max_depth, self.index.max_spec
        if max_match is None:
            max_match = max(1, depth - spec)
        self._tail = max(1, min(max_match, depth - 1))

    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        self.index.add_document(prompt)

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        tail = context[len(context) - self._tail:] if len(context) > self._tail else context
        tokens, parents, scores, match_len = self.index.propose(tail, budget)
        if not tokens:
            return DraftTree.empty(NAME, match_len)
        tree = DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), source=NAME,
                         scores=np.asarray(scores, np.float64), match_len=match_len)
        return main_path(tree) if self.chains else tree

    def observe(self, emitted: Sequence[int]) -> None:
        self.index.extend(emitted)

    def end(self) -> None:
        self.index.end_document()  # the request stays in the history for later ones

    def close(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return self.index.nbytes
