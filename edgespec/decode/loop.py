"""The request loop: prefill, then steps until the output is done, as a stream of typed events.

There is one loop for every kind of decoding. A *step* (``Step``) turns the pending token —
emitted but not yet in the KV cache — into the next emitted tokens: ``PlainStep`` appends it
and picks one token; ``edgespec.spec.step.SpeculativeStep`` verifies a draft after it and emits
accepted + bonus. The loop owns everything else once: stats, the request's RNG, the output
stream (stop strings, EOG, max tokens), the context-length and cancel checks, RSS and timing.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from edgespec.decode.events import DoneEvent, GenerationStats, TokenEvent
from edgespec.decode.output import OutputStream
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams, argmax_decides, backend_top_k, pick_from_row
from edgespec.decode.sequence import KVSequence, start_beside
from edgespec.errors import InvalidRequest
from edgespec.memory.rss import PeakRSS
from edgespec.decode.stats import SpecStats


class Step(Protocol):
    """One target pass per call; see the module docstring. ``needs_logits``: greedy steps read
    logits rows, so the backend must not pick the target's tokens (edgespec.llama.rows);
    ``verifies``: a pass decodes many rows of several sequences."""

    needs_logits: bool
    verifies: bool

    def begin(self, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        """Starts a request. Runs beside the prompt's prefill, in another thread than the
        prefill's decodes: it must not touch the target's context."""

    def prefilled(self, first: int) -> None:
        """The prefill picked ``first``, the pending token of the first step."""

    def step(self, seq: KVSequence, history: list[int], budget: int) -> tuple[list[int], int]:
        """Emitted tokens (>= 1) and how many of them came from an accepted draft.

        ``history`` = prompt + everything emitted; its last token is pending. ``budget``: the
        most tokens the step may draft (context room and max_tokens already applied).
        """

    def end(self) -> SpecStats | None: ...


class PlainStep:
    """Plain decoding: one token per target pass."""

    needs_logits = False
    verifies = False

    def begin(self, prompt, params, rng) -> None:
        self._params, self._rng = params, rng

    def prefilled(self, first: int) -> None:
        pass

    def step(self, seq: KVSequence, history: list[int], budget: int) -> tuple[list[int], int]:
        row = seq.append(history[-1])
        return [pick_from_row(row, self._params, history, self._rng)], 0

    def end(self) -> None:
        return None


class Decoder:
    """Runs requests on ``seq`` (the target's KV sequence) with one kind of step."""

    def __init__(self, model, seq: KVSequence, step: Step | None = None):
        self.model, self.seq = model, seq
        self.step = step if step is not None else PlainStep()

    def stream(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
               cancel: threading.Event | None = None) -> Iterator[TokenEvent | DoneEvent]:
        """Generates after ``prompt``, yielding text as it completes and a final DoneEvent."""
        self._check_prompt(prompt)
        seq, params = self.seq, request.sampling
        stats = GenerationStats(prompt_tokens=len(prompt))
        rng = np.random.default_rng(params.seed)
        out = OutputStream(self.model, request.max_tokens, request.stop, request.ignore_eos)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            seq.ctx.pick_on_backend(argmax_decides(params) and not self.step.needs_logits, self.step.verifies)
            seq.ctx.top_on_backend(0 if self.step.needs_logits else backend_top_k(params))
            try:
                # The step starts beside the prefill: indexing a prompt for the suffix drafter
                # takes about 10 µs a token on the host, while the prefill waits on its kernels.
                started = start_beside(lambda: self.step.begin(prompt, params, rng))
                try:
                    row, stats.reused_prompt_tokens = seq.sync(prompt)
                except BaseException:
                    started.exception()  # waits for it; the prefill's error is the one to report
                    raise
                started.result()
                stats.prompt_eval_s = time.perf_counter() - t0
                history = list(prompt) + [pick_from_row(row, params, prompt, rng)]
                stats.ttft_s = time.perf_counter() - t0
                t_first = time.perf_counter()
                self.step.prefilled(history[-1])
                yield from out.push_step(history[-1:], 0)
                while not out.done:
                    if cancel is not None and cancel.is_set():
                        out.end("cancelled")
                        break
                    if len(seq) + 1 >= seq.ctx.n_ctx:
                        out.end("length")
                        break
                    # A step emits accepted drafts + one bonus token: drafting past max_tokens
                    # would only make the last verification dearer.
                    budget = min(seq.ctx.n_ctx - len(seq) - 2, out.remaining - 1)
                    emitted, from_draft = self.step.step(seq, history, budget)
                    history.extend(emitted)
                    yield from out.push_step(emitted, from_draft)
            finally:
                stats.spec = self.step.end()
            tail = out.end()
            if tail is not None:
                yield tail
            stats.gen_s = time.perf_counter() - t_first
        stats.generated_tokens = len(out.tokens)
        stats.peak_rss_bytes, stats.peak_anon_bytes = rss.peak, rss.peak_anon
        stats.process_peak_rss_bytes = rss.process_peak
        stats.finish_reason = out.finish_reason
        yield DoneEvent(out.text, tuple(out.tokens), stats)

    def generate(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
                 cancel: threading.Event | None = None) -> DoneEvent:
        """Runs ``stream`` to the end and returns its DoneEvent."""
        for event in self.stream(prompt, request, cancel):
            pass
        return event

    def _check_prompt(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.seq.ctx.n_ctx:
            raise InvalidRequest(f"prompt of {len(prompt)} tokens does not fit the context of "
                                 f"{self.seq.ctx.n_ctx} tokens (raise --ctx or shorten the prompt)")
