"""The speculative step: draft, verify the whole draft in one target pass, keep what agrees.

Each step (vocabulary in edgespec.spec.tree) asks the drafter for a tree continuing the
context, verifies pending + tree in ONE target batch (KVSequence.verifying), applies the
acceptance rule (edgespec.spec.acceptance: greedy, or exact rejection sampling) with target
distributions computed by the same sampler as plain decoding, commits the accepted path and
emits accepted + bonus tokens. With the `none` drafter every step is one plain decode.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from edgespec.decode.sampling import SamplingParams, greedy_token, recent_window, target_probs
from edgespec.decode.sequence import KVSequence
from edgespec.drafters.base import Drafter
from edgespec.spec.acceptance import accept_greedy, accept_stochastic
from edgespec.spec.stats import SpecStats
from edgespec.spec.tree import DraftTree
from edgespec.spec.verify import fit_draft

log = logging.getLogger(__name__)


class _PathRows:
    """Target decisions at verification rows, computed lazily along the walked path.

    Row r's distribution depends on the tokens before it (repetition penalty), so it is
    computed with the history = context + the draft path down to that row's node.
    """

    def __init__(self, rows, draft: DraftTree, history: list[int], params: SamplingParams):
        self._rows, self._draft, self._history, self._params = rows, draft, history, params

    def _recent(self, r: int) -> np.ndarray:
        if self._params.repeat_penalty == 1.0:
            return recent_window([], self._params)
        path = self._draft.path_to(r - 1) if r > 0 else []
        return recent_window(self._history + [int(self._draft.tokens[i]) for i in path], self._params)

    def __getitem__(self, r: int) -> int:  # greedy: the target's token at row r
        return greedy_token(self._rows(r), self._params, self._recent(r))

    def probs(self, r: int) -> np.ndarray:  # sampling: the exact target distribution at row r
        return target_probs(self._rows(r), self._params, self._recent(r))


class SpeculativeStep:
    """Speculative decoding with ``drafter``, drafts of at most ``draft_max`` nodes."""

    def __init__(self, drafter: Drafter, draft_max: int = 32):
        self.drafter = drafter
        self.draft_max = draft_max
        self._params = SamplingParams()
        self._rng = np.random.default_rng()
        self._stats = SpecStats(mode=drafter.name)

    def begin(self, prompt: Sequence[int], first: int, params: SamplingParams,
              rng: np.random.Generator) -> None:
        self._params, self._rng = params, rng
        self._stats = SpecStats(mode=self.drafter.name)
        self.drafter.begin(list(prompt), sampling=params, rng=rng)
        self.drafter.observe([first])

    def step(self, seq: KVSequence, history: list[int], budget: int) -> tuple[list[int], int]:
        budget = min(self.draft_max, budget)
        draft = self.drafter.propose(history, budget) if budget > 0 else DraftTree.empty()
        draft = fit_draft(draft, seq.max_paths, max(budget, 0))
        with seq.verifying(history[-1], draft) as verification:
            # history ends with pending: the context every row's distribution is conditioned on.
            rows = _PathRows(verification.rows, draft, history, self._params)
            if self._params.greedy:
                acc = accept_greedy(draft, rows)
            else:
                acc = accept_stochastic(draft, rows.probs, self._rng)
            verification.commit(acc.path)
        self._stats.add(draft.source, len(draft), acc.n_accepted)
        emitted = acc.emitted_tokens(draft)
        self.drafter.observe(emitted)
        return emitted, acc.n_accepted

    def end(self) -> SpecStats:
        self.drafter.end()
        return self._stats
