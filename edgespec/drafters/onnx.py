"""The `onnx` drafter: the drafter model converted to ONNX, run by onnxruntime.

Same life cycle and drafts as the `model` drafter (edgespec.drafters.model), on any execution
provider onnxruntime has. Its KV buffer (edgespec.onnx.session.OnnxLM) holds ``cached``: the
longest common prefix with each new context is kept and only the rest is decoded; rolling back
rejected tokens is forgetting them (a shorter length), nothing is copied.

* chain: greedy argmax, or a draw from the drafter's distribution under the request's sampler
  settings with that distribution recorded (q_ids / q_probs) for exact rejection sampling;
  stops when the top probability falls below ``min_confidence``.
* tree (greedy): best-first expansion by cumulative probability; each round decodes its
  frontier in ONE pass, tree node ``i`` in KV slot ``len(context) + i`` at rotary position
  ``len(context) + depth(i) - 1``, an attention bias hiding every slot but its ancestors.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from edgespec.decode.sampling import (
    SamplingParams,
    greedy_logprob,
    greedy_token,
    recent_window,
)
from edgespec.decode.tokens import fast_common_prefix
from edgespec.drafters import default_draft_model
from edgespec.files.gguf import read_gguf
from edgespec.memory import placements
from edgespec.files.vocab import check_compatible
from edgespec.onnx.convert import convert
from edgespec.drafters.model import MAX_EXPANSIONS, Stop, draft_chain, drafts_tree
from edgespec.onnx.session import MASKED, OnnxLM
from edgespec.decode.tree import DraftTree
from edgespec.spec.tree_search import SearchResult, best_first, top_children

log = logging.getLogger(__name__)

NAME = "onnx"
MAX_TREE_NODES = placements.TREES.draft_max
PREFILL_CHUNK = 256  # rows per pass while catching up: bounds the attention bias (S x T floats)


def tree_bias(parents: Sequence[int], base: int, nodes: Sequence[int]) -> np.ndarray:
    """[len(nodes), base + max(nodes) + 1] bias: node rows see the context and their ancestors."""
    bias = np.full((len(nodes), base + max(nodes) + 1), MASKED, np.float32)
    bias[:, :base] = 0.0
    for r, node in enumerate(nodes):
        while node >= 0:
            bias[r, base + node] = 0.0
            node = parents[node]
    return bias


class OnnxDrafter:
    """Drafts with a converted model on onnxruntime; see the module docstring."""

    name = NAME
    # propose() and guess() sync to whatever context they are given, so they may draft past an
    # unverified draft (SpeculativeStep's overlap) and be rolled back by the next call.
    drafts_ahead = True

    def __init__(self, lm: OnnxLM, tree: bool = False, min_confidence: float = 0.4, branch: int = 8,
                 round_size: int | None = 4):
        """``round_size``: tree nodes scored per pass; the planner counts the arena for that many
        rows (edgespec.memory.footprint.ONNX_TREE_ROWS). The tree is the same for any round size
        (edgespec.spec.tree_search); only the number of passes changes."""
        self.lm = lm
        self.tree = tree
        self.min_confidence = min_confidence
        self.branch = branch
        self.round_size = round_size
        self.cached: list[int] = []  # tokens in KV slots 0..len-1
        self.params = SamplingParams(temperature=0.0)
        self.rng = np.random.default_rng()

    # -- lifecycle ----------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], sampling: SamplingParams | None = None, rng=None) -> None:
        self.params = sampling or SamplingParams(temperature=0.0)
        self.rng = rng if rng is not None else np.random.default_rng()

    def observe(self, emitted: Sequence[int]) -> None:
        pass  # the next propose() syncs the KV buffer from the context it is given

    def end(self) -> None:
        pass  # the buffer stays: the next request (chat turn) reuses its common prefix

    @property
    def nbytes(self) -> int:
        return self.lm.nbytes

    def close(self) -> None:
        self.lm.close()

    # -- decoding -----------------------------------------------------------------------------
    def sync(self, context: Sequence[int]) -> np.ndarray:
        """Makes the buffer hold exactly ``context``; returns the logits after its last token."""
        keep = min(fast_common_prefix(self.cached, context), len(context) - 1)
        del self.cached[keep:]
        logits = None
        for start in range(keep, len(context), PREFILL_CHUNK):
            chunk = [int(t) for t in context[start:start + PREFILL_CHUNK]]
            logits = self.lm.forward(chunk, range(start, start + len(chunk)), start)[0]
            self.cached.extend(chunk)
        return logits

    def append(self, token: int) -> np.ndarray:
        """Decodes one token after ``cached``; returns the logits after it."""
        n = len(self.cached)
        logits = self.lm.forward([token], [n], n)[0]
        self.cached.append(int(token))
        return logits

    def score_tree(self, context: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                   nodes: Sequence[int] | None = None) -> np.ndarray:
        """Logits after each of ``nodes`` (default: all) of a tree continuing ``context``, in one pass.

        ``nodes`` must be consecutive and every node before them already decoded by an earlier
        call for the same tree. The buffer keeps ``context``; tree slots are never kept.
        """
        nodes = list(range(len(tokens))) if nodes is None else list(nodes)
        base = len(context)
        if len(self.cached) != base or fast_common_prefix(self.cached, context) != base:
            self.sync(context)
        depth = np.zeros(len(tokens), np.int64)
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return self.lm.forward([int(tokens[n]) for n in nodes], [base + depth[n] - 1 for n in nodes],
                               base + nodes[0], tree_bias(parents, base, nodes),
                               rows=range(len(nodes)))

    # -- drafting -----------------------------------------------------------------------------
    def propose(self, context: Sequence[int], budget: int, stop: Stop | None = None,
                tree: bool | None = None) -> DraftTree:
        """A tree or a chain of at most ``budget`` tokens; ``stop`` may end a greedy chain early.
        ``tree``: this step's shape; None: the drafter's own."""
        tree = drafts_tree(self.tree, tree, self.params)
        room = MAX_EXPANSIONS + 1 if tree else budget + 1  # a tree's slots: one per expanded node
        if budget <= 0 or len(context) + room >= self.lm.n_ctx:
            return DraftTree.empty(NAME)
        logits = self.sync(context)
        if tree:
            return self.search(context, logits, min(budget, MAX_TREE_NODES)).tree
        return self._chain(context, logits, budget, stop)

    def guess(self, context: Sequence[int]) -> int:
        """Its greedy choice after ``context`` (overlap: its guess of the target's next token)."""
        return greedy_token(self.sync(context), self.params, recent_window(list(context), self.params))

    def _chain(self, context: Sequence[int], logits: np.ndarray, budget: int, stop: Stop | None) -> DraftTree:
        return draft_chain(context, logits, budget, self.params, self.rng, self.min_confidence,
                           self.append, NAME, stop)

    def search(self, context: Sequence[int], logits: np.ndarray, budget: int,
               max_expansions: int = MAX_EXPANSIONS) -> SearchResult:
        """The best-first search for a ``budget``-node tree after ``context`` (``logits``: the
        row after its last token), each round scored in one pass (score_tree)."""
        tokens: list[int] = []  # the decoded nodes, in decoding order (score_tree's layout)
        parents: list[int] = []
        index: dict[tuple[int, ...], int] = {}

        def expand(paths):
            first = len(tokens)
            for path in paths:
                index[path] = len(tokens)
                tokens.append(path[-1])
                parents.append(index[path[:-1]] if len(path) > 1 else -1)
            rows = self.score_tree(context, tokens, parents, range(first, len(tokens)))
            return [top_children(row, self.branch) for row in rows]

        # The llama.cpp drafter's cap (edgespec.drafters.model): the exact top tree takes more
        # expansions than it keeps nodes (a 95-expansion search in tests/test_onnx_drafter.py).
        return best_first(top_children(logits, self.branch), expand, budget, self.round_size,
                          max_expansions, source=NAME)


def measure_onnx_token(drafter: OnnxDrafter, repeats: int = 3) -> float:
    """Seconds per drafted token (a one-token pass after a short context and the greedy pick of
    its row, as a chain pays them), the fastest of a few: other load on a shared machine only
    ever adds time."""
    drafter.sync([0] * 8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        greedy_logprob(drafter.append(0))
        times.append(time.perf_counter() - t0)
    drafter.cached.clear()  # forgetting is rollback: the next propose decodes its own context
    return min(times)


def make_onnx_drafter(target_model, store, draft_model: str | None = None, provider: str = "cpu",
                      bits: str = "exact", tree: bool = False, n_threads: int | None = None,
                      n_ctx: int = 4096) -> OnnxDrafter:
    """The ONNX drafter for ``target_model`` (a LlamaModel), converting its drafter if needed.

    Args:
        draft_model: the drafter GGUF (name or path); default: the target's default drafter.
        provider: an onnxruntime execution provider (edgespec.onnx.session.PROVIDERS).
        bits: "exact" or "4" (see edgespec.onnx.convert).
    Raises:
        ModelNotFound / InvalidGGUF: the drafter GGUF cannot be found or read.
        IncompatibleModels: its vocabulary does not match the target's.
        UnsupportedModel / StoreError: it cannot be converted.
    """

    source = store.resolve(draft_model or default_draft_model(target_model, store))
    check_compatible(target_model.gguf, read_gguf(source))
    directory = convert(store, source, bits)  # returns at once when already converted
    return OnnxDrafter(OnnxLM(directory, provider, n_ctx=n_ctx, n_threads=n_threads), tree=tree)
