"""The speculative step: draft, verify the whole draft in one target pass, keep what agrees.

Each step (vocabulary in edgespec.decode.tree) asks the drafter for a tree continuing the
context, verifies pending + tree in ONE target batch (KVSequence.verifying), applies the
acceptance rule (edgespec.spec.acceptance: greedy, or exact rejection sampling) with target
distributions computed by the same sampler as plain decoding, commits the accepted path and
emits accepted + bonus tokens. With the `none` drafter every step is one plain decode.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from edgespec.decode.sampling import SamplingParams, argmax_decides, greedy_token, recent_window, row_support, top2_gap
from edgespec.decode.sequence import KVSequence
from edgespec.spec.drafter import Drafter
from edgespec.spec.acceptance import Acceptance, accept_greedy, accept_stochastic
from edgespec.decode.stats import SpecStats
from edgespec.decode.tree import DraftTree
from edgespec.decode.verify import fit_draft, is_chain, main_path
from edgespec.memory.placements import CHAINS

log = logging.getLogger(__name__)


class _PathRows:
    """Target decisions at verification rows, computed lazily along the walked path.

    Row r's distribution depends on the tokens before it (repetition penalty), so it is
    computed with the history = context + the draft path down to that row's node.
    """

    def __init__(self, rows, draft: DraftTree, history: list[int], params: SamplingParams):
        self._rows, self._draft, self._history, self._params = rows, draft, history, params
        self._picks = rows.greedy if argmax_decides(params) else None  # a token id per row

    def _recent(self, r: int) -> np.ndarray:
        if self._params.repeat_penalty == 1.0:
            return recent_window([], self._params)
        path = self._draft.path_to(r - 1) if r > 0 else []
        return recent_window(self._history + [int(self._draft.tokens[i]) for i in path], self._params)

    def __getitem__(self, r: int) -> int:  # greedy: the target's token at row r
        if self._picks is not None:
            return self._picks(r)  # picked on the backend where it can
        return greedy_token(self._rows(r), self._params, self._recent(r))

    def gap(self, r: int) -> float:  # greedy: how far row r's choice leads the runner-up
        return top2_gap(self._rows(r), self._params, self._recent(r))

    def support(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Sampling: the exact target distribution at row r, as (token ids, probabilities): from
        the row's largest logits where the backend returned only those."""
        return row_support(self._rows.row(r), self._params, self._recent(r))


class _Ahead:
    """While the target verifies ``draft``: the drafter's guess of the target's next token after
    all of it, and a chain drafted after that guess."""

    def __init__(self, drafter: Drafter, history: list[int], draft: DraftTree, budget: int):
        self._drafter, self._budget, self._n = drafter, budget, len(draft)
        self.context = history + [int(t) for t in draft.tokens]
        self.guess: int | None = None
        self.chain: DraftTree | None = None

    def __call__(self) -> None:  # runs beside the verification (KVSequence.verifying)
        self.guess = self._drafter.guess(self.context)
        self.chain = self._drafter.propose(self.context + [self.guess], self._budget)

    def next_draft(self, emitted: list[int]) -> tuple[list[int], DraftTree] | None:
        """(next context, its draft) when the target accepted the whole draft and then emitted
        the guessed token; None otherwise."""
        if self.chain is None or len(emitted) != self._n + 1 or emitted[-1] != self.guess:
            return None
        return self.context + [self.guess], self.chain


class SpeculativeStep:
    """Speculative decoding with ``drafter``, drafts of at most ``draft_max`` nodes.

    ``recheck_gap`` (greedy only): a verified row whose top-2 logit gap is below it is a
    near-tie that the batch's numerics may flip (a row computed in a batch of n tokens differs
    from the same row computed alone by up to about a logit on these CPUs), so the step ends
    its accepted path before that row and decides the position the way plain decoding does:
    the row's token is decoded alone. 0 turns re-checks off.

    ``overlap`` (greedy chains of a drafter that ``drafts_ahead``): while the target verifies a
    chain, the drafter drafts on as if the target accepted all of it; its first token is its
    guess of the target's bonus token. When the target does accept everything and its bonus is
    that guess, the rest is the next step's draft, already made (PEARL's post-verify). Worth it
    only where drafter and target run on different processors.

    ``chains_only``: every draft is cut to its main path (``main_path``) before verification.
    Exact mode needs it: after a tree's commit the next tokens fill the freed cells of its other
    branches, before the accepted ones (llama.cpp's find_slot), and flash attention sums over
    cells in cell order, so later rows are no longer plain decoding's bit for bit. Read from the
    code, not measured: runs that verified suffix trees gave plain's answers on 42/42 too.
    """

    def __init__(self, drafter: Drafter, draft_max: int = CHAINS.draft_max, recheck_gap: float = 0.0,
                 overlap: bool = False, chains_only: bool = False):
        self.drafter = drafter
        self.draft_max = draft_max
        self.chains_only = chains_only
        self.recheck_gap = recheck_gap
        self.overlap = overlap and getattr(drafter, "drafts_ahead", False)
        self._params = SamplingParams()
        self._rng = np.random.default_rng()
        self._stats = SpecStats(mode=drafter.name)
        self._ready: tuple[list[int], DraftTree] | None = None  # (context, draft) drafted ahead

    def begin(self, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._params, self._rng = params, rng
        self._stats = SpecStats(mode=self.drafter.name)
        self._ready = None
        self.drafter.begin(list(prompt), sampling=params, rng=rng)

    def prefilled(self, first: int) -> None:
        self.drafter.observe([first])

    def step(self, seq: KVSequence, history: list[int], budget: int) -> tuple[list[int], int]:
        budget = min(self.draft_max, budget)
        draft = self._draft(history, budget)
        if self.chains_only and not is_chain(draft):
            draft = main_path(draft)
        draft = fit_draft(draft, seq.max_paths, max(budget, 0))
        ahead = _Ahead(self.drafter, history, draft, budget) if self._drafts_ahead(draft) else None
        if not len(draft) and ahead is None and self._params.greedy:
            return self._plain(seq, history, draft), 0
        with seq.verifying(history[-1], draft, ahead) as verification:
            # history ends with pending: the context every row's distribution is conditioned on.
            rows = _PathRows(verification.rows, draft, history, self._params)
            if self._params.greedy:
                acc = accept_greedy(draft, rows)
            else:
                acc = accept_stochastic(draft, rows.support, self._rng)
            near_tie = self._near_tie(rows, draft, acc.path) if self._params.greedy else None
            verification.commit(acc.path if near_tie is None else acc.path[:near_tie])
        if near_tie is not None:
            acc = self._recheck(seq, history, draft, acc.path[:near_tie])
        self._stats.add(draft.source, len(draft), acc.n_accepted)
        emitted = acc.emitted_tokens(draft)
        if ahead is not None:
            self._ready = ahead.next_draft(emitted)
        self.drafter.observe(emitted)
        return emitted, acc.n_accepted

    def _plain(self, seq: KVSequence, history: list[int], draft: DraftTree) -> list[int]:
        """A greedy step with nothing drafted, as plain decoding takes it: the same token as
        verifying the pending token alone, without the verification's bookkeeping (where `auto`
        drafts nothing on an H200, that bookkeeping and its choice cost 8-10% of a 1.9 ms step)."""
        row = seq.append(history[-1])
        token = row.greedy() if argmax_decides(self._params) else \
            greedy_token(row.logits(), self._params, recent_window(history, self._params))
        self._stats.add(draft.source, 0, 0)
        self.drafter.observe([token])
        return [token]

    def _draft(self, history: list[int], budget: int) -> DraftTree:
        """The draft drafted ahead for exactly this context, or a new one."""
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == history and budget > 0:
            self._stats.drafted_ahead += 1
            return ready[1].prefix(min(len(ready[1]), budget))
        return self.drafter.propose(history, budget) if budget > 0 else DraftTree.empty()

    def _drafts_ahead(self, draft: DraftTree) -> bool:
        return self.overlap and self._params.greedy and is_chain(draft)

    def _near_tie(self, rows: _PathRows, draft: DraftTree, path: tuple[int, ...]) -> int | None:
        """The first row along the accepted path (0 = after pending) that is a near-tie. With
        nothing drafted the batch is the pending token alone, plain decoding's own row: a
        re-check would decode it again for nothing (it cost 10% of tokens/s on Spec-Bench)."""
        if self.recheck_gap <= 0 or not len(draft):
            return None
        nodes = (-1,) + tuple(path)
        return next((k for k, node in enumerate(nodes) if rows.gap(node + 1) < self.recheck_gap), None)

    def _recheck(self, seq: KVSequence, history: list[int], draft: DraftTree, path: tuple[int, ...]) -> Acceptance:
        """Re-decides the position after ``path`` from its last token decoded alone."""
        last = seq.tokens[-1]
        seq.trim(len(seq) - 1)
        logits = seq.append(last).logits()
        context = history + [int(draft.tokens[i]) for i in path]
        self._stats.rechecks += 1
        return Acceptance(tuple(path), greedy_token(logits, self._params, recent_window(context, self._params)))

    verifies = True

    @property
    def needs_logits(self) -> bool:
        """Greedy verification reads token ids only (picked on the backend where the build can,
        edgespec.llama.rows); a near-tie re-check reads the rows' top-2 gap."""
        return self.recheck_gap > 0

    def end(self) -> SpecStats:
        self.drafter.end()
        return self._stats
