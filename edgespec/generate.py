"""Plain (non-speculative) generation: the baseline every speed-up is measured against.

``Generator`` owns sequence 0 of a context and remembers which tokens its KV cache holds, so a
new prompt that shares a prefix with the previous prompt and answer (the next turn of a chat)
only evaluates what is new.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec.backend import LlamaContext, LlamaModel
from edgespec.detok import Detokenizer, StopMatcher
from edgespec.errors import InvalidRequest
from edgespec.events import DoneEvent, GenerationStats, TokenEvent
from edgespec.memwatch import PeakRSS
from edgespec.sampling import SamplingParams, sample_from, target_probs
from edgespec.tokens import fast_common_prefix

log = logging.getLogger(__name__)

SEQ_MAIN = 0


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate after a prompt: budget, stop conditions and sampler settings."""

    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop strings must be strings")


class Generator:
    """Plain autoregressive decoding over one context, with KV prefix reuse."""

    def __init__(self, model: LlamaModel, ctx: LlamaContext):
        self.model = model
        self.ctx = ctx
        self.cached: list[int] = []  # tokens whose KV entries sit at positions 0..len-1 of seq 0

    def reset(self) -> None:
        """Forgets the cache (e.g. chat /reset)."""
        self.ctx.clear()
        self.cached = []

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, prompt: Sequence[int]) -> tuple[np.ndarray, int]:
        """Brings the cache to exactly ``prompt`` and returns the last position's logits.

        Returns:
            (logits [n_vocab], number of prompt tokens reused from the cache)
        Raises:
            InvalidRequest: empty prompt or a prompt that does not fit the context.
        """
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.ctx.n_ctx:
            raise InvalidRequest(f"prompt of {len(prompt)} tokens does not fit the context of "
                                 f"{self.ctx.n_ctx} tokens (raise --ctx or shorten the prompt)")
        # At least the last prompt token is evaluated again: its logits are not kept.
        keep = min(fast_common_prefix(self.cached, prompt), len(prompt) - 1)
        self.ctx.seq_rm(SEQ_MAIN, keep, -1)
        self.cached = list(prompt[:keep])
        logits = None
        for start in range(keep, len(prompt), self.ctx.n_batch):
            chunk = prompt[start:start + self.ctx.n_batch]
            last = start + len(chunk) == len(prompt)
            out = self.ctx.decode(chunk, range(start, start + len(chunk)), [[SEQ_MAIN]] * len(chunk),
                                  [last and i == len(chunk) - 1 for i in range(len(chunk))])
            self.cached.extend(chunk)
            if last:
                logits = out[0]
        return logits, keep

    def step(self, token: int) -> np.ndarray:
        """Appends one token to the cache and returns the logits after it."""
        pos = len(self.cached)
        logits = self.ctx.decode([token], [pos], [[SEQ_MAIN]], [True])[0]
        self.cached.append(token)
        return logits

    # -- generation ---------------------------------------------------------------------------
    def stream(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
               cancel: threading.Event | None = None) -> Iterator[TokenEvent | DoneEvent]:
        """Generates after ``prompt``, yielding text as it completes and a final DoneEvent."""
        stats = GenerationStats(prompt_tokens=len(prompt))
        params = request.sampling
        rng = np.random.default_rng(params.seed)
        detok, stops = Detokenizer(), StopMatcher(request.stop)
        out_tokens: list[int] = []
        text_parts: list[str] = []
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            logits, stats.reused_prompt_tokens = self.prefill(prompt)
            stats.prompt_eval_s = time.perf_counter() - t0
            t_first = None
            history = list(prompt)
            reason, hit = "", False
            while True:
                token = self._pick(logits, params, history, rng)
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                if self.model.is_eog(token) and not request.ignore_eos:
                    reason = "stop"
                    break
                out_tokens.append(token)
                history.append(token)
                text, hit = stops.feed(detok.feed(self.model.token_piece(token)))
                if text or hit:
                    text_parts.append(text)
                yield TokenEvent(text, (token,))
                if hit:
                    reason = "stop"
                    break
                if len(out_tokens) >= request.max_tokens or len(self.cached) + 1 >= self.ctx.n_ctx:
                    reason = "length"
                    break
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                logits = self.step(token)
            if not hit:
                # Held-back text was not the start of a stop string after all.
                tail = stops.feed(detok.flush())[0] + stops.flush()
                if tail:
                    text_parts.append(tail)
                    yield TokenEvent(tail, ())
            stats.gen_s = time.perf_counter() - (t_first or t0)
        stats.generated_tokens = len(out_tokens)
        stats.peak_rss_bytes = rss.peak
        stats.finish_reason = reason
        yield DoneEvent("".join(text_parts), tuple(out_tokens), stats)

    def generate(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
                 cancel: threading.Event | None = None) -> DoneEvent:
        """Runs ``stream`` to the end and returns its DoneEvent."""
        done = None
        for ev in self.stream(prompt, request, cancel):
            done = ev
        assert isinstance(done, DoneEvent)
        return done

    @staticmethod
    def _pick(logits: np.ndarray, params: SamplingParams, history: list[int],
              rng: np.random.Generator) -> int:
        recent = np.asarray(history[-params.repeat_last_n:] if params.repeat_last_n else [], dtype=np.int64)
        probs = target_probs(logits, params, recent)
        if params.greedy:
            return int(np.argmax(probs))
        return sample_from(probs, rng)

