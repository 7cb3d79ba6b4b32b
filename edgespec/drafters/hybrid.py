"""The `hybrid` drafter: the suffix draft when its match is strong, else the model draft.

A long suffix match (copying code, repeating the prompt) predicts many tokens for free; free
text rarely matches, and there the small model's guess is worth its cost.
"""
from __future__ import annotations

from collections.abc import Sequence

from edgespec.decode.tree import DraftTree

NAME = "hybrid"


class HybridDrafter:
    name = NAME

    def __init__(self, suffix, model, min_match: int = 4):
        self.suffix = suffix
        self.model = model
        self.min_match = min_match

    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        self.suffix.begin(prompt, sampling=sampling, rng=rng)
        self.model.begin(prompt, sampling=sampling, rng=rng)

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        draft = self.suffix.propose(context, budget)
        if len(draft) and draft.match_len >= self.min_match:
            return draft
        return self.model.propose(context, budget)

    def observe(self, emitted: Sequence[int]) -> None:
        self.suffix.observe(emitted)
        self.model.observe(emitted)

    def end(self) -> None:
        self.suffix.end()
        self.model.end()

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes + self.model.nbytes

    def close(self) -> None:
        self.model.close()
