"""The `model` drafter: a small GGUF model of the same tokenizer proposes the continuation.

It keeps its own context and KV cache in step with the target: on each proposal it keeps the
longest common prefix of what it holds and the current context, and decodes only the rest
(the last step's accepted + bonus tokens), never the whole context.

* chain: one token after another; greedy picks the argmax, sampling draws from the drafter's
  distribution under the request's sampler settings and records it (exact rejection sampling
  needs q). Drafting stops when the drafter's top probability falls below ``min_confidence``;
  the test uses the distribution's maximum, never the drawn token, so a continuing draft is
  still an unconditioned sample of q.
* tree (greedy only): SpecExec-style, the exact top-``budget`` nodes by path probability
  (edgespec.spec.tree_search); each round decodes the best unexpanded nodes in one batch, each
  path in its own sequence so a node attends only to its ancestors (edgespec.drafters.tree_kv).
  A tree always fills its budget: what size pays is the caller's choice (the verification
  curve), and one definition of the tree keeps replay exact.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from edgespec.decode.sampling import (
    SamplingParams,
    greedy_logprob,
    greedy_token,
    recent_window,
    sample_support,
    target_support,
)
from edgespec.decode.sequence import KVSequence
from edgespec.drafters.auto.policy import CostModel, TreeSizes
from edgespec.drafters.tree_kv import PathKV
from edgespec.llama.backend import LlamaContext, LlamaModel
from edgespec.memory import placements
from edgespec.decode.tree import DraftTree
from edgespec.spec.tree_search import best_first, top_children

log = logging.getLogger(__name__)

NAME = "model"
Stop = Callable[[Sequence[float]], bool]  # a greedy chain's confidences so far -> end it here
MAX_TREE_NODES = placements.TREES.draft_max  # the largest tree: a 64-row verification
TREE_SIZES = (3, 7, 15, 31, 63)  # the sizes a tree policy chooses from (edgespec.drafters.auto.policy.TreeSizes)
# A search decodes more nodes than its tree holds (the exact 63-node tree took more than 63
# expansions at 76% of the code-edit positions, 106 on average) but holds at most its budget
# of them at once (tree_search's ``forget``): a sequence per held node and one for the context,
# the same context a chain drafter builds. The decodes stay capped where the recorded traces
# were searched (replay_trees.record_trees): with no cap, a search expanded more than 255 when
# every unexpanded top node went each round (tree_search's band).
MAX_EXPANSIONS = 255
SEQUENCES = MAX_TREE_NODES + 1


def drafts_tree(own: bool, asked: bool | None, params: SamplingParams) -> bool:
    """Whether this step drafts a tree: the shape asked for (None: the drafter's own), only from
    a drafter built for trees (``own``), and only greedy."""
    return (own if asked is None else asked and own) and params.greedy


def draft_chain(context: Sequence[int], logits: np.ndarray, budget: int, params: SamplingParams,
                rng: np.random.Generator, min_confidence: float, append, source: str,
                stop: Stop | None = None) -> DraftTree:
    """A chain of at most ``budget`` drafted tokens after ``context`` (shared by the llama.cpp
    and ONNX drafters); ``append(token)`` decodes a token and returns the logits after it.

    Greedy takes the argmax, sampling draws from the drafter's distribution under the request's
    sampler settings and records it (exact rejection sampling needs q). Drafting stops when the
    top probability falls below ``min_confidence``; the test uses the distribution's maximum,
    never the drawn token, so a continuing draft is still an unconditioned sample of q. A greedy
    chain's scores are the products of its tokens' confidences, and ``stop(confidences)``, asked
    after each token, ends it before that token is decoded (a caller's cost rule).
    """
    tokens: list[int] = []
    confidences: list[float] = []
    q_ids: list[np.ndarray] = []
    q_probs: list[np.ndarray] = []
    sampling = not params.greedy
    for k in range(budget):
        if sampling:
            ids, q = target_support(logits, params, recent_window(list(context) + tokens, params))
            if q.max() < min_confidence:
                break
            token = sample_support(ids, q, rng)
            q_ids.append(ids)
            q_probs.append(q)
        else:
            token, logp = greedy_logprob(logits)
            confidence = math.exp(logp)
            if not confidence >= min_confidence:  # NaN too: a row with no finite logit
                break
            confidences.append(confidence)
        tokens.append(token)
        if k + 1 == budget or (stop is not None and not sampling and stop(confidences)):
            break
        logits = append(token)
    if sampling:
        return DraftTree.chain(tokens, source, q_ids, q_probs)
    return DraftTree.chain(tokens, source, scores=np.cumprod(confidences))


class ModelDrafter:
    """Drafts with a small model; see the module docstring for the two shapes."""

    name = NAME
    # propose() and guess() sync to whatever context they are given, so they may draft past an
    # unverified draft (SpeculativeStep's overlap) and be rolled back by the next call.
    drafts_ahead = True

    def __init__(self, model: LlamaModel, n_ctx: int = 4096, n_threads: int | None = None,
                 tree: bool = False, min_confidence: float = 0.4, branch: int = 8, round_size: int | None = None,
                 ctx=None, owns_model: bool = False):
        """``ctx``: a context to draft in instead of a new one over ``model`` (tests pass an
        exact fake with the LlamaContext interface); ``owns_model``: close() frees the model too
        (it was loaded for this drafter alone)."""
        self.model = model
        self.owns_model = owns_model
        self.tree = tree
        self.min_confidence = min_confidence
        self.branch = branch
        self.round_size = round_size
        self.ctx = ctx if ctx is not None else LlamaContext(
            model, self.context_params(n_ctx, n_threads, on_gpu=model.params.n_gpu_layers != 0))
        self.last_search = None  # the last tree's SearchResult (rounds, expansions)
        # Trees take the largest size of the menu within the step's budget, or, with a cost
        # model, the size that pays from what trees accepted so far.
        self.sizes = TreeSizes(TREE_SIZES)
        self.cost: CostModel | None = None
        self.clock = time.perf_counter  # what a search costs is learned in its seconds
        self._verifying: DraftTree | None = None
        self.seq = KVSequence(self.ctx)
        self.params = SamplingParams(temperature=0.0)
        self.rng = np.random.default_rng()

    context_params = staticmethod(placements.drafter_context_params)

    # -- lifecycle ----------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], sampling: SamplingParams | None = None, rng=None) -> None:
        self.params = sampling or SamplingParams(temperature=0.0)
        self.rng = rng if rng is not None else np.random.default_rng()
        self._verifying = None

    def observe(self, emitted: Sequence[int]) -> None:
        """Learns what the last tree accepted (the next propose() syncs the cache itself)."""
        tree, self._verifying = self._verifying, None
        self.sizes.learn(tree, emitted)

    def end(self) -> None:
        self._verifying = None  # the cache stays: the next request (chat turn) reuses its common prefix

    @property
    def nbytes(self) -> int:
        r = self.ctx.memory_report()
        return r["weights"] + r["kv_cache"]

    def close(self) -> None:
        self.ctx.close()
        if self.owns_model:
            self.model.close()

    # -- drafting -----------------------------------------------------------------------------
    def propose(self, context: Sequence[int], budget: int, stop: Stop | None = None,
                tree: bool | None = None) -> DraftTree:
        """A tree or a chain of at most ``budget`` tokens; ``stop`` may end a greedy chain early.
        ``tree``: this step's shape, ``budget`` then the tree's size (`auto` sizes its trees
        itself); None: the drafter's own shape, a tree sized by its TreeSizes."""
        sized = tree is not None
        tree = drafts_tree(self.tree, tree, self.params)
        if tree:  # sized before syncing: a step that drafts nothing decodes nothing
            limit = min(budget, MAX_TREE_NODES, self.ctx.n_seq_max - 1)
            budget = limit if sized else self.sizes.size(limit, self.cost)
        room = budget + 1  # cells: a chain's tokens, a tree's held nodes
        if budget <= 0 or len(context) + room >= self.ctx.n_ctx:
            return DraftTree.empty(NAME)
        logits = self.seq.sync(context)[0].logits()
        if tree:
            return self._tree(context, logits, budget)
        return self._chain(context, logits, budget, stop)

    def guess(self, context: Sequence[int]) -> int:
        """Its greedy choice after ``context`` (overlap: its guess of the target's next token)."""
        logits = self.seq.sync(context)[0].logits()
        return greedy_token(logits, self.params, recent_window(list(context), self.params))

    def _chain(self, context: Sequence[int], logits: np.ndarray, budget: int, stop: Stop | None) -> DraftTree:
        return draft_chain(context, logits, budget, self.params, self.rng, self.min_confidence,
                           lambda token: self.seq.append(token).logits(), NAME, stop)

    def _tree(self, context: Sequence[int], logits: np.ndarray, budget: int) -> DraftTree:
        base = len(context)
        kv = PathKV(self.ctx)

        def expand(paths):
            rows = kv.decode([(base, p) for p in paths])
            return [top_children(row, self.branch) for row in rows]

        def forget(paths):
            kv.forget([(base, p) for p in paths])

        t0 = self.clock()
        try:
            found = best_first(top_children(logits, self.branch), expand, budget, self.round_size,
                               MAX_EXPANSIONS, source=NAME, forget=forget)
        finally:
            kv.release()
        self.last_search, self._verifying = found, found.tree
        self.sizes.searched(budget, self.clock() - t0)
        return found.tree
