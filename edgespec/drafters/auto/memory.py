"""What `auto` learned, kept across requests and runs, per placement (the target's calibration
key: its file, GPU layers, threads, kernel): how often the suffix index's drafts are accepted
per match-length class, and how often each drafter model's chains are, per depth and per
confidence of the drafted token.

A request starts from it instead of from priors, so a short answer is drafted as well as the
end of a long one; and `auto` leaves out a drafter model whose learned acceptance, at the
calibrated costs, would never beat plain steps (edgespec.drafters.auto.select). Carried evidence
is scaled down to ``CARRY_WEIGHT`` pseudo-observations per depth, so a request whose text
differs (a copy-heavy edit after chat) overrides it within a few steps.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CARRY_WEIGHT = 6.0


class PolicyMemory:
    """One JSON file per placement: {"suffix": {class: [num, den]}, "drafters": {name: [[num, den]...]},
    "confidence": {name: [nums, dens]}} (ConfidenceCalibration's bins)."""

    def __init__(self, home: Path, placement_key: str):
        self.path = Path(home) / "policy" / f"{placement_key}.json"

    def load(self) -> dict:
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def drafter_alphas(self, drafter: str, max_depth: int) -> list[float]:
        """What `auto` believes of ``drafter``'s chains, per depth: what it learned here, else
        its prior (the belief a new AutoDrafter decides with)."""
        from edgespec.drafters.auto.drafter import MODEL_PRIOR
        from edgespec.drafters.auto.policy import DepthAcceptance

        acceptance = DepthAcceptance(max_depth, prior=MODEL_PRIOR)
        state = self.load().get("drafters", {}).get(drafter)
        if state:
            acceptance.restore(state, CARRY_WEIGHT)
        return acceptance.alphas()

    def learned(self, drafter: str) -> bool:
        return bool(self.load().get("drafters", {}).get(drafter))

    def save(self, suffix: dict, drafter: str | None, drafter_state: list | None,
             confidence_state: list | None = None) -> None:
        state = self.load()
        state["suffix"] = suffix
        if drafter is not None and drafter_state is not None:
            state.setdefault("drafters", {})[drafter] = drafter_state
        if drafter is not None and confidence_state is not None:
            state.setdefault("confidence", {})[drafter] = confidence_state
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only store: the next run starts from priors
            log.warning("auto: could not keep what it learned (%s)", exc)
