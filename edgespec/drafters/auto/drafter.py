"""The `auto` drafter: per step, the draft (or none) with the best expected tokens per second.

Each step it asks the suffix drafter for its tree (microseconds), prices every prefix of it
and a model-drafted chain of every length with the calibrated cost model and the running
acceptance estimates (edgespec.drafters.auto.policy), and hands the verifier the winner: a suffix
prefix, a model draft, or nothing (a plain step). The decision is one value, StepChoice, that
``propose`` makes and ``observe`` learns from; the draft's ``source`` records it, so the
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
the tree or the chain, whichever prices higher, competes with the suffix draft (replayed on a
partly offloaded 7B, trees win on code edits and chains on Spec-Bench). A chain's price before
it is drafted is its average over every step, so where a tree below the largest size prices
higher, the chain is drafted first and its own confidences price it: a sure chain is verified,
an unsure one gives way to the tree (replayed: +3% on code edits, +1% on Spec-Bench). The
largest size is drafted without a chain first: that chain cost replayed code edits 7%. A budget
below the largest size (an answer's last tokens, a smaller --draft-max) sends every tree
through a chain.

Estimates keep learning while a mode is not chosen: after every step the suffix draft that
was offered is checked against the token the target actually produced (free), and the model
drafter is re-probed with a short chain once ``probe_every`` steps passed without one; a
tree's level reverts toward its prior while no tree is drafted (TreeSizes), so trees that
stopped paying are priced again.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from edgespec.drafters.auto.policy import (ChainStop, ConfidenceCalibration, CostModel, DepthAcceptance,
                                           RatioEstimate, TreeDepthCalibration, best_chain_length, best_tree_prefix,
                                           drafter_gain)
from edgespec.decode.tree import DraftTree
from edgespec.drafters.auto.memory import CARRY_WEIGHT, saved_gain, settle

NAME = "auto"
MATCH_CLASSES = (1, 4, 12)  # lower bounds of the match-length classes
MODEL_PRIOR = 0.6  # acceptance per depth assumed of a drafter model before any evidence
# The drafter's measured gain (tokens over the tokens expected without it): its prior counts as
# this many tokens; each model step's evidence fades by this factor a step. At 4 tokens, three
# missed 63-node trees at a first Spec-Bench answer left the drafter out for good (replayed: 1.45x -> 1.09x).
GAIN_WEIGHT, GAIN_DECAY = 16.0, 0.99


def match_class(match_len: int) -> int:
    """The class of a suffix match: the largest lower bound not above its length."""
    return max((c for c in MATCH_CLASSES if c <= match_len), default=MATCH_CLASSES[0])


@dataclass(frozen=True)
class ModelPlan:
    """What the drafter model is priced to draft this step, before it drafts: ``nodes`` tokens
    (0: nothing), a best-first tree of them if ``tree`` else a chain, at ``rate`` expected tokens/s."""

    nodes: int = 0
    rate: float = 0.0
    tree: bool = False


NO_PLAN = ModelPlan()
# A short chain at any price once the drafter went ``probe_every`` steps without one: text
# changes, and so does the drafter's luck.
REPROBE = ModelPlan(2, float("inf"))


@dataclass(frozen=True)
class ModelDraft:
    """What the drafter model drafted this step."""

    verified: DraftTree  # the part handed to the verifier (empty: none of it paid)
    chain: DraftTree | None = None  # the whole greedy chain drafted: the target's tokens grade it
    tree_size: int = 0  # nodes of the best-first tree in ``verified`` (0: it is a chain)
    seconds: float = 0.0  # drafting time, clocked (the drafter's sync with the emitted tokens included)


@dataclass(frozen=True)
class StepChoice:
    """One step's decision: made by ``AutoDrafter.propose``, learned from by ``observe``."""

    offered: DraftTree  # the suffix draft on offer
    chosen: DraftTree  # what the verifier got: a suffix prefix, a model draft or nothing ("none")
    floor: float  # tokens/s of the suffix draft's best prefix (or a plain step, MARGIN added): the model's bar
    counterfactual: float  # tokens/s expected of this step without the model
    plan: ModelPlan  # what the model was priced at
    model: ModelDraft | None = None  # what it drafted (None: it was not asked)

    @property
    def model_chain(self) -> bool:
        """Whether the verifier got a model chain (whose depths DepthAcceptance learns)."""
        return self.chosen.source == "model" and not (self.model is not None and self.model.tree_size)


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
        if memory is not None:
            self._restore(memory.load())
        self._greedy = True  # whether this request decodes greedily (trees and sized chains need it)
        self._steps_since_chain = 0  # steps since the model last drafted a chain (its re-probe)
        self._pending: StepChoice | None = None  # the step proposed and not yet observed

    # -- lifecycle ----------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        self._pending = None  # a step of an earlier request that raised before observe() was never verified
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
            self.memory.save_after(suffix, self.model_name, model, confidence, gain, sits_out=self.sits_out)

    def _restore(self, state: dict) -> None:
        for c, saved in state.get("suffix", {}).items():
            if c.isdigit() and int(c) in self.suffix_calibration:
                self.suffix_calibration[int(c)].restore(saved, CARRY_WEIGHT)
        self._restore_model(state)

    def _restore_model(self, state: dict) -> None:
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
        settle()  # what it learned is on disk once it is closed
        if self.model is not None:
            self.model.close()

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes + (self.model.nbytes if self.model is not None else 0)

    # -- decisions ----------------------------------------------------------------------------
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        if self.model_gain is None and self.model is not None:  # only a loaded drafter is measured
            self.model_gain = RatioEstimate(drafter_gain(self.cost, budget), GAIN_WEIGHT, GAIN_DECAY)
        choice = self._choose(context, budget)
        self._steps_since_chain = 0 if choice.model_chain else self._steps_since_chain + 1
        self._pending = choice
        return choice.chosen

    def _choose(self, context: Sequence[int], budget: int) -> StepChoice:
        """The suffix draft's best prefix (or a plain step), unless the model's draft prices higher."""
        offered = self.suffix.propose(context, budget)
        m, floor = best_tree_prefix(self._suffix_path_probs(offered), self.cost, budget)
        plan = self._model_plan(budget)
        counterfactual = floor if m else 1.0 / self.cost.verify(1)
        drafted = self._timed_model_draft(context, plan, budget, floor) if plan.nodes and plan.rate > floor else None
        if drafted is not None and len(drafted.verified):
            chosen = drafted.verified
        else:  # no model draft, or none of it paid
            chosen = offered.prefix(m) if m else DraftTree.empty("none")
        return StepChoice(offered, chosen, floor, counterfactual, plan, drafted)

    def _suffix_path_probs(self, offered: DraftTree) -> list[float]:
        scores = offered.scores
        if scores is None or len(offered) == 0:
            return []
        return self._calibration(offered).path_probs(offered.parents.tolist(), scores.tolist())

    def _calibration(self, offered: DraftTree):
        return self.suffix_calibration[match_class(offered.match_len)]

    def _model_plan(self, budget: int) -> ModelPlan:
        """What the drafter model would draft this step: the chain or the tree that prices
        higher, a re-probe, or nothing."""
        if self.model is None:
            return NO_PLAN
        # If even a drafter that is always right cannot beat a plain step at these costs
        # (a CPU whose drafter costs half a target pass), never spend a probe on it: each probe
        # first syncs the drafter's cache with everything emitted since its last use.
        if best_chain_length([1.0] * budget, self.cost, budget)[0] == 0:
            return NO_PLAN
        k, rate = best_chain_length(self.model_acceptance.alphas(), self.cost, budget)
        if k == 0 and self._steps_since_chain >= self.probe_every:
            return REPROBE
        size, tree_rate = self._tree_choice(budget)
        if tree_rate > rate:
            return ModelPlan(size, tree_rate, tree=True)
        return ModelPlan(k, rate)

    def _tree_choice(self, budget: int) -> tuple[int, float]:
        """The best-first tree size this step (0: none) and its expected tokens/s, where the
        drafter model can draft trees (``--draft-tree``; TreeSizes learns what each size accepts)."""
        sizes = getattr(self.model, "sizes", None)
        if not (self.trees and self._greedy and getattr(self.model, "tree", False)) or sizes is None:
            return 0, 0.0
        size = sizes.choose(self.cost, budget)
        if not size:
            return 0, 0.0
        # Probes of the largest size are priced too: drafted at any price, they cut replayed
        # Spec-Bench beside a partly offloaded 7B from 1.72x to 1.27x.
        return size, sizes.rate(self.cost, size)

    def _timed_model_draft(self, context: Sequence[int], plan: ModelPlan, budget: int, floor: float) -> ModelDraft:
        start = self.clock()
        drafted = self._model_draft(context, plan, budget, floor)
        return replace(drafted, seconds=self.clock() - start)

    def _model_draft(self, context: Sequence[int], plan: ModelPlan, budget: int, floor: float) -> ModelDraft:
        """A best-first tree of ``plan.nodes`` nodes, a greedy chain sized by its confidences
        (module docstring), or, sampling, ``plan.nodes`` tokens."""
        chain = None
        if plan.tree and plan.nodes < self.model.sizes.sizes[-1]:
            verified, chain, rate = self._chain(context, budget, floor)  # tree or chain: its confidences decide
            if rate >= plan.rate:
                return ModelDraft(verified, chain)
        if plan.tree:
            return ModelDraft(self.model.propose(context, plan.nodes, tree=True).relabel("model"), chain, plan.nodes)
        if not self._greedy:
            return ModelDraft(self.model.propose(context, plan.nodes).relabel("model"))
        verified, chain, _ = self._chain(context, budget, floor)
        return ModelDraft(verified, chain)

    def _chain(self, context: Sequence[int], budget: int, floor: float) -> tuple[DraftTree, DraftTree, float]:
        """A greedy chain stopped by ChainStop against ``floor``: (its prefix with the best expected
        tokens/s if that beats ``floor``, else empty; the whole chain; that rate)."""
        shape = {"tree": False} if getattr(self.model, "tree", False) else {}  # a tree drafter's chain
        chain = self.model.propose(context, budget, stop=self._stop_rule(floor), **shape)
        if chain.scores is None or not len(chain):
            return chain.relabel("model"), chain, 0.0
        n, rate = best_tree_prefix(self.confidence.path_probs(_confidences(chain)), self.cost, len(chain))
        return chain.prefix(n if rate > floor else 0).relabel("model"), chain, rate

    def _stop_rule(self, floor: float) -> Callable[[Sequence[float]], bool]:
        """ChainStop's rule against ``floor`` (the best step on offer besides the chain), asked
        with the chain's confidences after every drafted token."""
        rule = None

        def stop(confidences: Sequence[float]) -> bool:
            nonlocal rule
            if len(confidences) == 1:  # a new chain
                rule = ChainStop(self.confidence, self.cost, floor)
            return rule(confidences[-1])

        return stop

    # -- learning -----------------------------------------------------------------------------
    def observe(self, emitted: Sequence[int]) -> None:
        choice, self._pending = self._pending, None
        if choice is not None:
            self._learn(choice, emitted)
        self.suffix.observe(emitted)
        if self.model is not None:
            self.model.observe(emitted)

    def _learn(self, choice: StepChoice, emitted: Sequence[int]) -> None:
        """What a verified step teaches the estimates; ``emitted``: the target's tokens of it."""
        if choice.model_chain:  # chains' depths
            self.model_acceptance.update(len(choice.chosen), len(emitted) - 1)
        drafted = choice.model.chain if choice.model is not None else None
        if drafted is not None and drafted.scores is not None and len(emitted):
            # the target's continuation grades the whole chain as deep as it reaches
            hits = [int(t) == int(e) for t, e in zip(drafted.tokens, emitted)]
            self.confidence.update(_confidences(drafted)[:len(hits)], hits)
        if choice.model is not None:
            # the step's seconds (drafting measured) against what it would have emitted without the model
            seconds = choice.model.seconds + self.cost.verify(1 + len(choice.chosen))
            self.model_gain.update(len(emitted), choice.counterfactual * seconds)
        offered = choice.offered
        if offered.scores is not None and len(offered) and len(emitted):
            # The emitted tokens are the target's own continuation, whichever draft was
            # verified: they grade the offered suffix tree as deep as they reach, for free.
            self._calibration(offered).update(offered.tokens.tolist(), offered.parents.tolist(),
                                              offered.scores.tolist(), list(emitted))


def _confidences(chain: DraftTree) -> list[float]:
    """A greedy chain's per-token confidences, from its scores (their running products)."""
    scores = np.asarray(chain.scores, np.float64)
    before = np.concatenate(([1.0], scores[:-1]))
    return np.divide(scores, before, out=np.zeros_like(scores), where=before > 0).tolist()  # underflow: 0
