"""The `auto` drafter: per step, the draft (or none) with the best expected tokens per second.

Each step it asks the suffix drafter for its tree (microseconds), prices every prefix of it
and a model-drafted chain of every length with the calibrated cost model and the running
acceptance estimates (edgespec.drafters.auto.policy), and hands the verifier the winner: a suffix prefix,
a model chain, or nothing (a plain step). The draft's ``source`` records the decision, so the
per-drafter split of the stats counts the steps of each mode.

Estimates keep learning while a mode is not chosen: after every step the suffix draft that
was offered is checked against the token the target actually produced (free), and the model
drafter is re-probed with a short chain every ``probe_every`` steps.
"""
from __future__ import annotations

from collections.abc import Sequence

from edgespec.spec.tree import DraftTree
from edgespec.drafters.auto.policy import CostModel, DepthAcceptance, TreeDepthCalibration, best_chain_length, best_tree_prefix

NAME = "auto"
MATCH_CLASSES = (1, 4, 12)  # lower bounds of the match-length classes
MODEL_PRIOR = 0.6  # acceptance per depth assumed of a drafter model before any evidence


def match_class(match_len: int) -> int:
    """The class of a suffix match: the largest lower bound not above its length."""
    return max((c for c in MATCH_CLASSES if c <= match_len), default=MATCH_CLASSES[0])


class AutoDrafter:
    name = NAME

    def __init__(self, suffix, cost: CostModel, model=None, probe_every: int = 32, memory=None,
                 model_name: str | None = None):
        """``memory`` (edgespec.drafters.auto.memory.PolicyMemory): what earlier requests on this
        placement learned, restored here and kept after each request; ``model_name`` names the
        drafter model's acceptance in it."""
        self.suffix = suffix
        self.model = model
        self.cost = cost
        self.probe_every = probe_every
        self.memory, self.model_name = memory, model_name
        # One calibration per match-length class: a continuation seen after a 1-token match is
        # a guess, after a 20-token match it is usually a copy, whatever the index's counts say.
        self.suffix_calibration = {c: TreeDepthCalibration(max_depth=64, prior=0.5) for c in MATCH_CLASSES}
        self.model_acceptance = DepthAcceptance(prior=MODEL_PRIOR)
        if memory is not None:
            self._restore(memory.load())
        self._offered: DraftTree | None = None  # the suffix draft of the current step
        self._chosen: DraftTree | None = None
        self._steps_since_model = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        # A step of an earlier request that raised before observe() was never verified.
        self._offered = self._chosen = None
        self.suffix.begin(prompt, sampling=sampling, rng=rng)
        if self.model is not None:
            self.model.begin(prompt, sampling=sampling, rng=rng)

    def end(self) -> None:
        self.suffix.end()
        if self.model is not None:
            self.model.end()
        if self.memory is not None:
            suffix = {str(c): cal.state() for c, cal in self.suffix_calibration.items()}
            model = self.model_acceptance.state() if self.model is not None else None
            self.memory.save(suffix, self.model_name, model)

    def _restore(self, state: dict) -> None:
        from edgespec.drafters.auto.memory import CARRY_WEIGHT

        for c, saved in state.get("suffix", {}).items():
            if c.isdigit() and int(c) in self.suffix_calibration:
                self.suffix_calibration[int(c)].restore(saved, CARRY_WEIGHT)
        saved = state.get("drafters", {}).get(self.model_name)
        if self.model is not None and saved:
            self.model_acceptance.restore(saved, CARRY_WEIGHT)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes + (self.model.nbytes if self.model is not None else 0)

    # -- decisions ----------------------------------------------------------------------------
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        offered = self.suffix.propose(context, budget)
        self._offered = offered
        probs = self._suffix_path_probs(offered)
        m, suffix_rate = best_tree_prefix(probs, self.cost, budget)
        k, model_rate = self._model_choice(budget)
        if k and model_rate > suffix_rate:
            draft = self._model_draft(context, k)
        elif m:
            draft = offered.prefix(m)
        else:
            draft = DraftTree.empty("none")
        self._chosen = draft
        self._steps_since_model = 0 if draft.source == "model" else self._steps_since_model + 1
        return draft

    def _suffix_path_probs(self, offered: DraftTree) -> list[float]:
        scores = offered.scores
        if scores is None or len(offered) == 0:
            return []
        return self._calibration(offered).path_probs(offered.parents.tolist(), scores.tolist())

    def _calibration(self, offered: DraftTree):
        return self.suffix_calibration[match_class(offered.match_len)]

    def _model_choice(self, budget: int) -> tuple[int, float]:
        if self.model is None:
            return 0, 0.0
        # If even a drafter that is always right cannot beat a plain step at these costs
        # (a CPU whose drafter costs half a target pass), never spend a probe on it: each probe
        # first syncs the drafter's cache with everything emitted since its last use.
        if best_chain_length([1.0] * budget, self.cost, budget)[0] == 0:
            return 0, 0.0
        k, rate = best_chain_length(self.model_acceptance.alphas(), self.cost, budget)
        if k == 0 and self._steps_since_model >= self.probe_every:
            return 2, float("inf")  # re-probe: text changes, and so does the drafter's luck
        return k, rate

    def _model_draft(self, context: Sequence[int], k: int) -> DraftTree:
        return self.model.propose(context, k).relabel("model")

    # -- learning -----------------------------------------------------------------------------
    def observe(self, emitted: Sequence[int]) -> None:
        chosen, offered = self._chosen, self._offered
        if chosen is not None and chosen.source == "model":
            accepted = len(emitted) - 1
            self.model_acceptance.update(len(chosen), accepted)
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
