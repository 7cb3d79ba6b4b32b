"""Speculative generation: draft, verify the whole draft in one target pass, keep what agrees.

Each step (see edgespec.draft for the vocabulary) asks the drafter for a tree continuing the
context, verifies pending + tree in ONE target batch (edgespec.verify), applies the acceptance
rule (edgespec.acceptance: greedy, or exact rejection sampling) with target distributions
computed by the same sampler as plain decoding, commits the accepted path to the KV cache and
emits accepted + bonus tokens. With the `none` drafter every step is one plain decode.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from edgespec.acceptance import accept_greedy, accept_stochastic
from edgespec.draft import DraftTree
from edgespec.drafters.base import Drafter
from edgespec.events import DoneEvent, GenerationStats, TokenEvent
from edgespec.generate import GenerationRequest, Generator, pick_token, recent_window
from edgespec.memwatch import PeakRSS
from edgespec.output import OutputStream
from edgespec.sampling import SamplingParams, greedy_token, target_probs
from edgespec.verify import TreeVerifier, fit_draft

log = logging.getLogger(__name__)


class SpecCounters:
    """Steps, drafted and accepted tokens, in total and per drafter."""

    def __init__(self) -> None:
        self.steps = self.drafted = self.accepted = 0
        self.by_drafter: dict[str, dict[str, int]] = {}

    def add(self, source: str, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        d = self.by_drafter.setdefault(source or "none", {"steps": 0, "drafted": 0, "accepted": 0})
        d["steps"] += 1
        d["drafted"] += drafted
        d["accepted"] += accepted

    def to_dict(self, mode: str) -> dict:
        emitted = self.accepted + self.steps
        return {
            "mode": mode, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_emitted": emitted / self.steps if self.steps else 0.0,
            "by_drafter": self.by_drafter,
        }


class _PathRows:
    """Target decisions at verification rows, computed lazily along the walked path.

    Row r's distribution depends on the tokens before it (repetition penalty), so it is
    computed with the history = context + the draft path down to that row's node.
    """

    def __init__(self, rows, draft: DraftTree, history: list[int], params: SamplingParams):
        self._rows, self._draft, self._history, self._params = rows, draft, history, params

    def _recent(self, r: int) -> np.ndarray:
        if self._params.repeat_penalty == 1.0:
            return recent_window([], self._params)
        path = self._draft.path_to(r - 1) if r > 0 else []
        return recent_window(self._history + [int(self._draft.tokens[i]) for i in path], self._params)

    def __getitem__(self, r: int) -> int:  # greedy: the target's token at row r
        return greedy_token(self._rows(r), self._params, self._recent(r))

    def probs(self, r: int) -> np.ndarray:  # sampling: the exact target distribution at row r
        return target_probs(self._rows(r), self._params, self._recent(r))


class SpeculativeGenerator:
    """Runs speculative decoding over a plain Generator's context (sharing its prefix reuse)."""

    def __init__(self, generator: Generator, drafter: Drafter, draft_max: int = 32):
        if generator.ctx.n_batch < draft_max + 1:
            raise ValueError("draft_max + 1 must fit in one batch")
        self.gen = generator
        self.drafter = drafter
        self.draft_max = draft_max
        self.verifier = TreeVerifier(generator.ctx)

    def stream(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
               cancel: threading.Event | None = None) -> Iterator[TokenEvent | DoneEvent]:
        gen, params = self.gen, request.sampling
        stats = GenerationStats(prompt_tokens=len(prompt))
        counters = SpecCounters()
        rng = np.random.default_rng(params.seed)
        out = OutputStream(gen.model, request.max_tokens, request.stop, request.ignore_eos)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            logits, stats.reused_prompt_tokens = gen.prefill(prompt)
            stats.prompt_eval_s = time.perf_counter() - t0
            history = list(prompt)
            pending = pick_token(logits, params, history, rng)
            stats.ttft_s = time.perf_counter() - t0
            t_first = time.perf_counter()
            history.append(pending)
            self.drafter.begin(list(prompt), sampling=params, rng=rng)
            self.drafter.observe([pending])
            event = out.push(pending)
            if event is not None:
                yield event
            while not out.done:
                if cancel is not None and cancel.is_set():
                    out.end("cancelled")
                    break
                room = gen.ctx.n_ctx - len(gen.cached) - 2
                if room < 0:
                    out.end("length")
                    break
                # A step emits accepted drafts + one bonus token: drafting past max_tokens
                # would only make the last verification dearer.
                budget = min(self.draft_max, room, out.remaining - 1)
                emitted, path_len = self._step(history, pending, budget, params, rng, counters)
                self.drafter.observe(emitted)
                for k, token in enumerate(emitted):
                    history.append(token)
                    event = out.push(token, from_draft=k < path_len)
                    if event is not None:
                        yield event
                    if out.done:
                        break
                pending = emitted[-1]
            self.drafter.end()
            tail = out.end()
            if tail is not None:
                yield tail
            stats.gen_s = time.perf_counter() - t_first
        stats.generated_tokens = len(out.tokens)
        stats.peak_rss_bytes = rss.peak
        stats.finish_reason = out.finish_reason
        stats.extra.update(counters.to_dict(self.drafter.name))
        yield DoneEvent(out.text, tuple(out.tokens), stats)

    def _step(self, history: list[int], pending: int, budget: int, params: SamplingParams,
              rng: np.random.Generator, counters: SpecCounters) -> tuple[list[int], int]:
        """One target pass; returns (emitted tokens, how many of them were accepted drafts)."""
        gen = self.gen
        n_cached = len(gen.cached)
        draft = self.drafter.propose(history, budget) if budget > 0 else DraftTree.empty()
        draft = fit_draft(draft, self.verifier.max_paths, budget)
        # history ends with pending: the context every row's distribution is conditioned on.
        rows = _PathRows(self.verifier.verify(n_cached, pending, draft), draft, history, params)
        if params.greedy:
            acc = accept_greedy(draft, rows)
        else:
            acc = accept_stochastic(draft, rows.probs, rng)
        self.verifier.commit(n_cached, draft, acc.path)
        accepted = [int(draft.tokens[i]) for i in acc.path]
        gen.cached.extend([pending] + accepted)
        counters.add(draft.source, len(draft), len(accepted))
        return accepted + [int(acc.bonus)], len(accepted)
