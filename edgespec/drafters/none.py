"""The `none` drafter: never drafts, so the speculative engine does plain decoding."""
from __future__ import annotations

from collections.abc import Sequence

from edgespec.decode.tree import DraftTree

NAME = "none"


class NoDrafter:
    name = NAME

    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        pass

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        return DraftTree.empty(NAME)

    def observe(self, emitted: Sequence[int]) -> None:
        pass

    def end(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0
