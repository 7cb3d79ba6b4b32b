"""The drafter protocol: a request lifecycle and a memory report.

A drafter proposes a DraftTree for the next step, is told what the target accepted, and keeps
whatever state it needs (a suffix index, its own KV cache) in step with the output. A drafter
whose ``propose`` depends on nothing but the context it is given declares ``drafts_ahead =
True`` and offers ``guess(context) -> token`` (its greedy choice): the step may then call both on
a context the target has not verified yet (overlap).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from edgespec.decode.tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    name: str

    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        """Starts a request whose context is ``prompt``. It runs in another thread, beside the
        target's prefill of the prompt.

        ``sampling`` (SamplingParams) and ``rng`` (numpy Generator) are the request's: a
        drafter that samples must draw with ``rng`` and record its distributions.
        """

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        """A draft of at most ``budget`` nodes continuing ``context`` (prompt + emitted so far)."""

    def observe(self, emitted: Sequence[int]) -> None:
        """The tokens the last step emitted (accepted + bonus), appended to the context."""

    def end(self) -> None:
        """Ends the request; long-lived state (history) may be kept for later requests."""

    @property
    def nbytes(self) -> int:
        """Bytes of memory this drafter holds."""
