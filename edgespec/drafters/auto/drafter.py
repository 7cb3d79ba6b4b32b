"""The `auto` drafter: per step, the draft (or none) with the best expected tokens per second.

Each step it asks the suffix drafter for its tree (microseconds), prices every prefix of it
and a model-drafted chain of every length with the calibrated cost model and the running
acceptance estimates (edgespec.drafters.auto.policy), and hands the verifier the winner: a suffix prefix,
a model chain, or nothing (a plain step). The draft's ``source`` records the decision, so the
per-drafter split of the stats counts the steps of each mode.

A greedy model chain is sized by the drafter's own confidence in each token, calibrated
against what the target accepted (ConfidenceCalibration): drafting stops once the chain's
estimated survival is worth less than one more drafter pass (priced at the seconds per token
of the best step on offer: a prefix so far, the suffix draft, a plain step; on a fast GPU a
token is worth less), and the verified prefix is the one with the best expected tokens per
second on the placement's verification curve, if it beats the suffix draft. Where
verification is expensive and steep (a target on the CPU or partly offloaded), how long a
chain pays depends on where the drafter turns unsure, not on the average depth it reached.

With ``--draft-tree`` (greedy), the drafter model may instead draft a best-first tree of one of
TreeSizes' sizes (edgespec.drafters.auto.policy), priced from what each size accepted here:
the tree or the chain, whichever prices higher, competes with the suffix draft. Replayed on a
7B offloaded to a third of its weights (benchmarks/RESULTS-gpu.md section 11), trees win on
code edits (a flat verification curve pays for 63 nodes) and chains on Spec-Bench. A chain's
price before it is drafted is its average over every step, so where a tree below the menu's
largest size (63 nodes) prices higher (trees are then accepting little), the chain is drafted
first and its own confidences price it: a sure chain is verified, an unsure one gives way to
the tree. Replayed over ten 7B offload curves on the tuning and validation sets this gained 3%
on code edits and 1% on Spec-Bench; 63-node trees pay on their own there, and a chain drafted
before each of them too cost code edits 7% against that (RESULTS-gpu section 14). A budget
below 63 (an answer's last tokens, a smaller --draft-max) sends every tree through a chain.

Estimates keep learning while a mode is not chosen: after every step the suffix draft that
was offered is checked against the token the target actually produced (free), and the model
drafter is re-probed with a short chain once ``probe_every`` steps passed without one; a
tree's level reverts toward its prior while no tree is drafted (TreeSizes), so trees that
stopped paying are priced again.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from edgespec.drafters.auto.policy import (ChainStop, ConfidenceCalibration, CostModel, DepthAcceptance,
                                           RatioEstimate, TreeDepthCalibration, best_chain_length, best_tree_prefix,
                                           drafter_gain)
from edgespec.spec.tree import DraftTree

NAME = "auto"
MATCH_CLASSES = (1, 4, 12)  # lower bounds of the match-length classes
MODEL_PRIOR = 0.6  # acceptance per depth assumed of a drafter model before any evidence
# The drafter's measured gain (tokens over the tokens expected without it): its prior counts as
# this many tokens; each model step's evidence fades by this factor a step. At 4 tokens, three
# 63-node trees that missed in a first Spec-Bench answer beside the 9-layer offload (replayed)
# measured 0.92 and left the drafter out for good (1.45x -> 1.09x); chains replay the same at 4-32.
GAIN_WEIGHT, GAIN_DECAY = 16.0, 0.99


def match_class(match_len: int) -> int:
    """The class of a suffix match: the largest lower bound not above its length."""
    return max((c for c in MATCH_CLASSES if c <= match_len), default=MATCH_CLASSES[0])


class AutoDrafter:
    name = NAME

    def __init__(self, suffix, cost: CostModel, model=None, probe_every: int = 32, memory=None,
                 model_name: str | None = None, clock: Callable[[], float] = time.perf_counter,
                 shape: Callable[[], tuple[str, bool, str | None]] | None = None):
        """``memory`` (edgespec.drafters.auto.memory.PolicyMemory): what earlier requests on this
        placement learned, restored here and kept after each request; ``model_name`` names the
        drafter model's acceptance in it (the first request's name; ``shape`` may change it);
        ``clock`` times the drafter model's drafting (its sync with the emitted tokens included),
        seconds; ``shape``: asked at every request, the name the drafter model learns under,
        whether it may draft trees and the name that sits the request out
        (memory.draft_shape_name: chains where trees measured a loss)."""
        self.clock = clock
        self.suffix = suffix
        self.model = model
        self.cost = cost
        self.probe_every = probe_every
        self.memory, self.model_name, self.shape = memory, model_name, shape
        self.trees, self.sits_out = True, None
        # One calibration per match-length class: a continuation seen after a 1-token match is
        # a guess, after a 20-token match it is usually a copy, whatever the index's counts say.
        self.suffix_calibration = {c: TreeDepthCalibration(max_depth=64, prior=0.5) for c in MATCH_CLASSES}
        self._fresh_model_state()
        self._greedy = True
        self._drafted: DraftTree | None = None  # the whole model chain of the current step
        self._chain_stop: ChainStop | None = None  # the stop rule of the chain being drafted
        self._floor = 0.0  # tokens/s of the best draft on offer besides the model's chain
        self._counterfactual = 0.0  # tokens/s expected of the current step without the model
        self._model_s: float | None = None  # seconds the model drafted this step (None: it did not)
        if memory is not None:
            self._restore(memory.load())
        self._offered: DraftTree | None = None  # the suffix draft of the current step
        self._chosen: DraftTree | None = None
        self._steps_since_chain = 0  # steps since the model last drafted a chain (its re-probe)
        self._tree_size = 0  # the size of this step's model tree (0: a chain or no model draft)
        self._tree_rate = 0.0  # its expected tokens/s

    # -- lifecycle ----------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        # A step of an earlier request that raised before observe() was never verified.
        self._offered = self._chosen = self._drafted = None
        self._model_s = None
        self._greedy = sampling is None or sampling.greedy
        self.suffix.begin(prompt, sampling=sampling, rng=rng)
        if self.model is not None:
            self.model.begin(prompt, sampling=sampling, rng=rng)
        self._take_shape()  # without the model too: the trees' sit-out still counts

    def _take_shape(self) -> None:
        """Trees or chains this request (``shape``); what the drafter learned under another name
        is restored when the name changes."""
        if self.shape is None:
            return
        name, self.trees, self.sits_out = self.shape()
        if name != self.model_name and self.memory is not None:
            self.model_name = name
            self._fresh_model_state()
            self._steps_since_chain = 0
            self._restore_model(self.memory.load())

    def _fresh_model_state(self) -> None:
        """What the drafter model's steps teach, before any (restored per name: _restore_model)."""
        self.model_acceptance = DepthAcceptance(prior=MODEL_PRIOR)
        self.confidence = ConfidenceCalibration()
        # What the drafter model's steps emitted over what the suffix draft (or a plain step) was
        # expected to emit in the same seconds: whether loading it pays here (select.pays).
        self.model_gain: RatioEstimate | None = None  # from its prior at the first step's budget

    def end(self) -> None:
        self.suffix.end()
        if self.model is not None:
            self.model.end()
        if self.memory is not None:
            suffix = {str(c): cal.state() for c, cal in self.suffix_calibration.items()}
            model = self.model_acceptance.state() if self.model is not None else None
            confidence = self.confidence.state() if self.model is not None else None
            gain = self.model_gain.state() if self.model is not None and self.model_gain is not None else None
            self.memory.save(suffix, self.model_name, model, confidence, gain, sits_out=self.sits_out)

    def _restore(self, state: dict) -> None:
        from edgespec.drafters.auto.memory import CARRY_WEIGHT

        for c, saved in state.get("suffix", {}).items():
            if c.isdigit() and int(c) in self.suffix_calibration:
                self.suffix_calibration[int(c)].restore(saved, CARRY_WEIGHT)
        self._restore_model(state)

    def _restore_model(self, state: dict) -> None:
        from edgespec.drafters.auto.memory import CARRY_WEIGHT, saved_gain

        saved = state.get("drafters", {}).get(self.model_name)
        if self.model is not None and saved:
            self.model_acceptance.restore(saved, CARRY_WEIGHT)
        saved = state.get("confidence", {}).get(self.model_name)
        if self.model is not None and saved:
            self.confidence.restore(saved, CARRY_WEIGHT)
        saved = saved_gain(state, self.model_name)
        if self.model is not None and saved:
            self.model_gain = RatioEstimate(1.0, decay=GAIN_DECAY)
            self.model_gain.restore(saved, CARRY_WEIGHT)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes + (self.model.nbytes if self.model is not None else 0)

    # -- decisions ----------------------------------------------------------------------------
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        if self.model_gain is None and self.model is not None:  # only a loaded drafter is measured
            self.model_gain = RatioEstimate(drafter_gain(self.cost, budget), GAIN_WEIGHT, GAIN_DECAY)
        offered = self.suffix.propose(context, budget)
        self._offered = offered
        probs = self._suffix_path_probs(offered)
        m, suffix_rate = best_tree_prefix(probs, self.cost, budget)
        k, model_rate = self._model_choice(budget)
        self._floor = suffix_rate  # what the model's chain must beat
        self._counterfactual = suffix_rate if m else 1.0 / self.cost.verify(1)
        draft = self._timed_model_draft(context, k, budget) if k and model_rate > suffix_rate else DraftTree.empty()
        if not len(draft):  # no model chain, or none of it paid
            draft = offered.prefix(m) if m else DraftTree.empty("none")
        self._chosen = draft
        chain = draft.source == "model" and not self._tree_size
        self._steps_since_chain = 0 if chain else self._steps_since_chain + 1
        return draft

    def _suffix_path_probs(self, offered: DraftTree) -> list[float]:
        scores = offered.scores
        if scores is None or len(offered) == 0:
            return []
        return self._calibration(offered).path_probs(offered.parents.tolist(), scores.tolist())

    def _calibration(self, offered: DraftTree):
        return self.suffix_calibration[match_class(offered.match_len)]

    def _model_choice(self, budget: int) -> tuple[int, float]:
        """What the drafter model drafts this step: a chain's length or a tree's size (sets
        ``_tree_size``; 0 = nothing) and its expected tokens/s."""
        self._tree_size = 0
        if self.model is None:
            return 0, 0.0
        # If even a drafter that is always right cannot beat a plain step at these costs
        # (a CPU whose drafter costs half a target pass), never spend a probe on it: each probe
        # first syncs the drafter's cache with everything emitted since its last use.
        if best_chain_length([1.0] * budget, self.cost, budget)[0] == 0:
            return 0, 0.0
        k, rate = best_chain_length(self.model_acceptance.alphas(), self.cost, budget)
        if k == 0 and self._steps_since_chain >= self.probe_every:
            return 2, float("inf")  # re-probe: text changes, and so does the drafter's luck
        size, tree_rate = self._tree_choice(budget)
        if tree_rate > rate:
            self._tree_size, self._tree_rate = size, tree_rate
            return size, tree_rate
        return k, rate

    def _tree_choice(self, budget: int) -> tuple[int, float]:
        """The best-first tree size this step (0: none) and its expected tokens/s, where the
        drafter model can draft trees (``--draft-tree``; TreeSizes learns what each size accepts)."""
        sizes = getattr(self.model, "sizes", None)
        if not (self.trees and self._greedy and getattr(self.model, "tree", False)) or sizes is None:
            return 0, 0.0
        size = sizes.choose(self.cost, budget)
        if not size:
            return 0, 0.0
        # A probe of the largest size is priced too: drafted at any price, the probes cut replayed
        # Spec-Bench beside the 4-layer offload from 1.72x to 1.27x (and code edits 4.61x to 4.54x).
        return size, sizes.rate(self.cost, size)

    def _timed_model_draft(self, context: Sequence[int], k: int, budget: int) -> DraftTree:
        start = self.clock()
        draft = self._model_draft(context, k, budget)
        self._model_s = self.clock() - start
        return draft

    def _model_draft(self, context: Sequence[int], k: int, budget: int) -> DraftTree:
        """A best-first tree of ``k`` nodes (``_tree_choice``), a greedy chain sized by its
        confidences (module docstring), or, sampling, ``k`` tokens."""
        if self._tree_size and self._tree_size < self.model.sizes.sizes[-1]:
            chain, rate = self._chain(context, budget)  # tree or chain, decided by its confidences
            if rate >= self._tree_rate:
                self._tree_size = 0
                return chain
        if self._tree_size:
            return self.model.propose(context, k, tree=True).relabel("model")
        if not self._greedy:
            return self.model.propose(context, k).relabel("model")
        return self._chain(context, budget)[0]

    def _chain(self, context: Sequence[int], budget: int) -> tuple[DraftTree, float]:
        """A greedy chain stopped by ChainStop, its prefix with the best expected tokens/s if that
        beats the suffix draft (else empty), and that rate."""
        shape = {"tree": False} if getattr(self.model, "tree", False) else {}  # a tree drafter's chain
        chain = self.model.propose(context, budget, stop=self._stop, **shape)
        self._drafted = chain
        if chain.scores is None or not len(chain):
            return chain.relabel("model"), 0.0
        n, rate = best_tree_prefix(self.confidence.path_probs(_confidences(chain)), self.cost, len(chain))
        return chain.prefix(n if rate > self._floor else 0).relabel("model"), rate

    def _stop(self, confidences: Sequence[float]) -> bool:
        """ChainStop's rule against the best step on offer besides the chain; asked after every
        drafted token."""
        if len(confidences) == 1:  # a new chain
            self._chain_stop = ChainStop(self.confidence, self.cost, self._floor)
        return self._chain_stop(confidences[-1])

    # -- learning -----------------------------------------------------------------------------
    def observe(self, emitted: Sequence[int]) -> None:
        chosen, offered = self._chosen, self._offered
        if chosen is not None and chosen.source == "model" and not self._tree_size:  # chains' depths
            accepted = len(emitted) - 1
            self.model_acceptance.update(len(chosen), accepted)
        drafted, self._drafted = self._drafted, None
        if drafted is not None and drafted.scores is not None and len(emitted):
            # the target's continuation grades the whole chain as deep as it reaches
            hits = [int(t) == int(e) for t, e in zip(drafted.tokens, emitted)]
            self.confidence.update(_confidences(drafted)[:len(hits)], hits)
        if self._model_s is not None and chosen is not None:
            # the step's seconds (drafting measured) against what it would have emitted without the model
            seconds = self._model_s + self.cost.verify(1 + len(chosen))
            self.model_gain.update(len(emitted), self._counterfactual * seconds)
        self._model_s = None
        scores = offered.scores if offered is not None else None
        if scores is not None and len(offered) and len(emitted):
            # The emitted tokens are the target's own continuation, whichever draft was
            # verified: they grade the offered suffix tree as deep as they reach, for free.
            self._calibration(offered).update(offered.tokens.tolist(), offered.parents.tolist(),
                                              scores.tolist(), list(emitted))
        self._offered = self._chosen = None
        self.suffix.observe(emitted)
        if self.model is not None:
            self.model.observe(emitted)


def _confidences(chain: DraftTree) -> list[float]:
    """A greedy chain's per-token confidences, from its scores (their running products)."""
    scores = np.asarray(chain.scores, np.float64)
    before = np.concatenate(([1.0], scores[:-1]))
    return np.divide(scores, before, out=np.zeros_like(scores), where=before > 0).tolist()  # underflow: 0
