"""Turns sampled token ids into streamed text under a request's stop conditions.

Plain and speculative generation both push tokens through ``OutputStream``, so EOG handling,
stop strings, max_tokens and multi-byte text behave identically whatever produced the token.
"""
from __future__ import annotations

from edgespec.decode.detok import Detokenizer, StopMatcher
from edgespec.decode.events import TokenEvent


class OutputStream:
    """Accumulates the answer of one request; ``finish_reason`` is set once it must end."""

    def __init__(self, model, max_tokens: int, stop: tuple[str, ...], ignore_eos: bool):
        self._model = model
        self._max_tokens = max_tokens
        self._ignore_eos = ignore_eos
        self._detok = Detokenizer()
        self._stops = StopMatcher(stop)
        self._stop_hit = False
        self.tokens: list[int] = []
        self.parts: list[str] = []
        self.finish_reason = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def remaining(self) -> int:
        """Tokens the answer may still take before ``max_tokens`` ends it."""
        return max(self._max_tokens - len(self.tokens), 0)

    def push(self, token: int, from_draft: bool = False) -> TokenEvent | None:
        """Adds one sampled token; returns the event to yield (None for an EOG token)."""
        if self.done:
            raise RuntimeError("push after the answer ended")
        if self._model.is_eog(token) and not self._ignore_eos:
            self.finish_reason = "stop"
            return None
        self.tokens.append(token)
        text, self._stop_hit = self._stops.feed(self._detok.feed(self._model.token_piece(token)))
        if text:
            self.parts.append(text)
        if self._stop_hit:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self._max_tokens:
            self.finish_reason = "length"
        return TokenEvent(text, (token,), from_draft)

    def push_step(self, tokens: list[int], from_draft: int) -> list[TokenEvent]:
        """A step's tokens, the first ``from_draft`` of them accepted drafts, as ``push`` takes
        them one by one, in at most two events (the drafts', the rest's): a 12-token step pushed
        token by token spent a third of its Python here."""
        if self._stops.active:  # which token completes a stop string decides where the answer ends
            events = []
            for k, token in enumerate(tokens):
                event = self.push(token, from_draft=k < from_draft)
                if event is not None:
                    events.append(event)
                if self.done:
                    break
            return events
        if self.done:
            raise RuntimeError("push after the answer ended")
        tokens = tokens[:self.remaining]
        eog = None if self._ignore_eos else next((k for k, t in enumerate(tokens) if self._model.is_eog(t)), None)
        if eog is not None:
            tokens = tokens[:eog]
        self.tokens.extend(tokens)
        events = [self._event(part, drafted) for part, drafted in ((tokens[:from_draft], True),
                                                                   (tokens[from_draft:], False)) if part]
        if eog is not None:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self._max_tokens:
            self.finish_reason = "length"
        return events

    def _event(self, tokens: list[int], from_draft: bool) -> TokenEvent:
        """The event of tokens already taken, with no stop strings to watch."""
        text = self._detok.feed(b"".join(map(self._model.token_piece, tokens)))
        if text:
            self.parts.append(text)
        return TokenEvent(text, tuple(tokens), from_draft)

    def end(self, reason: str | None = None) -> TokenEvent | None:
        """Ends the answer (if not ended yet, with ``reason``); returns held-back text, if any."""
        if not self.finish_reason:
            self.finish_reason = reason or "length"
        if self._stop_hit:
            return None
        # Held-back text was not the start of a stop string after all.
        tail = self._stops.feed(self._detok.flush())[0] + self._stops.flush()
        if not tail:
            return None
        self.parts.append(tail)
        return TokenEvent(tail, ())

    @property
    def text(self) -> str:
        return "".join(self.parts)
