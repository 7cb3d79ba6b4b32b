"""Incremental detokenization: token byte pieces in, complete UTF-8 text out.

A multi-byte character is often split across tokens (byte-fallback and byte-level BPE); the
standard library's incremental decoder holds the incomplete tail back until the next piece
completes it, so streamed text never shows a broken character.
"""
from __future__ import annotations

import codecs


class Detokenizer:
    """Feeds token pieces (bytes) and returns the text that is now complete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        """Returns the newly completed text (possibly empty) after adding ``piece``."""
        return self._decoder.decode(piece, final=False)

    def flush(self) -> str:
        """Ends the stream; an incomplete trailing sequence becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of a stop string.

    Text that could still turn out to be the start of a stop string is held back until the
    next token decides it.
    """

    def __init__(self, stops: list[str] | tuple[str, ...]):
        self._stops = [s for s in stops if s]
        self._pending = ""

    @property
    def active(self) -> bool:
        """Whether there is any stop string to watch for."""
        return bool(self._stops)

    def feed(self, text: str) -> tuple[str, bool]:
        """Adds text; returns (text safe to emit, whether a stop string was hit)."""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, False
        hit = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if hit >= 0:
            out, self._pending = self._pending[:hit], ""
            return out, True
        keep = self._held_back_length()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """Releases held-back text at the end of generation (no stop was completed)."""
        out, self._pending = self._pending, ""
        return out

    def _held_back_length(self) -> int:
        # The longest suffix of the pending text that is a proper prefix of some stop string.
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best
