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
from edgespec.errors import InvalidRequest
from edgespec.events import DoneEvent, GenerationStats, TokenEvent
from edgespec.memwatch import PeakRSS
from edgespec.output import OutputStream
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
        out = OutputStream(self.model, request.max_tokens, request.stop, request.ignore_eos)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            logits, stats.reused_prompt_tokens = self.prefill(prompt)
            stats.prompt_eval_s = time.perf_counter() - t0
            history = list(prompt)
            while True:
                token = pick_token(logits, params, history, rng)
                if not out.tokens:
                    stats.ttft_s = time.perf_counter() - t0
                    t_first = time.perf_counter()
                history.append(token)
                event = out.push(token)
                if event is not None:
                    yield event
                if out.done:
                    break
                if len(self.cached) + 1 >= self.ctx.n_ctx:
                    out.end("length")
                    break
                if cancel is not None and cancel.is_set():
                    out.end("cancelled")
                    break
                logits = self.step(token)
            tail = out.end()
            if tail is not None:
                yield tail
            stats.gen_s = time.perf_counter() - t_first
        stats.generated_tokens = len(out.tokens)
        stats.peak_rss_bytes = rss.peak
        stats.finish_reason = out.finish_reason
        yield DoneEvent(out.text, tuple(out.tokens), stats)

    def generate(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
                 cancel: threading.Event | None = None) -> DoneEvent:
        """Runs ``stream`` to the end and returns its DoneEvent."""
        done = None
        for ev in self.stream(prompt, request, cancel):
            done = ev
        assert isinstance(done, DoneEvent)
        return done


def pick_token(logits: np.ndarray, params: SamplingParams, history: list[int],
               rng: np.random.Generator) -> int:
    """The next token of plain decoding: argmax or a draw from the exact target distribution."""
    probs = target_probs(logits, params, recent_window(history, params))
    if params.greedy:
        return int(np.argmax(probs))
    return sample_from(probs, rng)


def recent_window(history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """Token ids in the repetition-penalty window (prompt included, as llama.cpp does)."""
    n = params.repeat_last_n if params.repeat_penalty != 1.0 else 0
    return np.asarray(history[-n:] if n else [], dtype=np.int64)
