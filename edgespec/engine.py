"""Engine: a loaded target model with its context, chat template and generator.

The one object the CLI, the server and embedding apps hold: it resolves a model name or path
through the store, validates and loads it once, and turns prompts or chat messages into streams
of typed events.

Thread safety: any thread may call ``generate`` / ``stream`` / ``chat`` (and
``stream_tokens`` / ``stream_chat``). Requests go through a FIFO ``RequestQueue``: one
generation runs at a time, the others wait their turn in arrival order (at most
``EngineConfig.max_queue`` of them; one more raises ``QueueFull``). A request is cancelled
from any thread by setting the ``threading.Event`` passed as ``cancel`` (a waiting request then
leaves the queue, a running one stops after its current step); either way its stream ends with
a DoneEvent whose finish_reason is "cancelled". ``cancel_all()`` does that for every request.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace

from edgespec.config import DEFAULT_MODEL, EngineConfig
from edgespec.decode.chat_template import ChatTemplate, Message
from edgespec.decode.events import DoneEvent, GenerationStats, TokenEvent
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest, make_request
from edgespec.decode.sequence import KVSequence
from edgespec.drafters.factory import make_drafter
from edgespec.errors import InvalidRequest, QueueFull
from edgespec.files.store import ModelStore
from edgespec.llama import invariant
from edgespec.llama.backend import LlamaContext, LlamaModel
from edgespec.load import LoadPlan, resolve
from edgespec.memory.filebacked import WeightReleaser
from edgespec.memory.machine import machine
from edgespec.spec.step import SpeculativeStep

__all__ = ["DEFAULT_MODEL", "Engine", "EngineConfig", "RequestQueue", "Result"]

log = logging.getLogger(__name__)

# What generate() / chat() return: the final event of a request (text, token ids, stats).
Result = DoneEvent


class Engine:
    """A target model ready to generate. Use as a context manager or call ``close()``.

    ``plan``: what to load, when the caller resolved it already (edgespec.load.resolve);
    by default the engine resolves ``config`` itself.
    """

    def __init__(self, config: EngineConfig = EngineConfig(), store: ModelStore | None = None,
                 plan: LoadPlan | None = None):
        self.config = config
        self.store = store or ModelStore()
        # Plan before loading anything: an impossible budget is refused here, cheaply.
        self.load_plan = plan or resolve(config, machine(), self.store)
        for note in self.load_plan.notes if self.load_plan.plan is not None else ():
            log.warning("%s", note)  # what the planner changed; a load as asked changes nothing
        if self.load_plan.left_out is not None:
            self.load_plan.left_out.record(self.store.home)
        self.releaser = None
        self.model = LlamaModel(self.load_plan.target_path, self.load_plan.model)
        self.ctx = self.drafter = None
        try:
            self._build(self.load_plan)
        except BaseException:
            self._free()
            raise
        self.queue = RequestQueue(config.max_queue)
        self._closed = False

    def _build(self, plan: LoadPlan) -> None:
        """What serves requests over the loaded model: the releaser of file-backed weights, the
        context (checked in exact mode), the decoder and the drafter. On a raise the caller frees
        what was built (``_free``)."""
        if plan.release_limit is not None:
            self.releaser = WeightReleaser(str(plan.target_path), plan.release_limit)
        self.ctx = LlamaContext(self.model, plan.context)
        if self.config.exact:
            invariant.check(self.ctx)
        self.seq = KVSequence(self.ctx)
        self.decoder = Decoder(self.model, self.seq)
        if plan.draft is not None:
            cfg = replace(plan.draft_config(), n_ctx=self.ctx.n_ctx)
            self.drafter = make_drafter(cfg, self.model, self.store, target_ctx=self.ctx)
            self.decoder = Decoder(self.model, self.seq, self.speculative_step(self.drafter, cfg.draft_max,
                                                                              self.config.recheck_gap))
        self.template = ChatTemplate(self.model.chat_template, self._special_text(self.model.bos),
                                     self._special_text(self.model.eos))

    def _free(self) -> None:
        """Frees the drafter, the context, the releaser and the model, whichever exist. A part
        that fails to close is logged and the rest are still freed; the first failure is raised."""
        first: BaseException | None = None
        for part in (self.drafter, self.ctx, self.releaser, self.model):
            if part is None or not hasattr(part, "close"):
                continue
            try:
                part.close()
            except Exception as e:  # noqa: BLE001 - the rest must still be freed; re-raised below
                log.error("freeing %s failed: %s", type(part).__name__, e)
                first = first or e
        if first is not None:
            raise first

    def speculative_step(self, drafter, draft_max: int, recheck_gap: float = 0.0) -> SpeculativeStep:
        """A step verifying ``drafter``'s drafts as this engine must: overlapped where its
        placement says so, chains only in exact mode."""
        return SpeculativeStep(drafter, draft_max, recheck_gap, overlap=self.load_plan.overlap,
                               chains_only=self.config.exact)

    def _special_text(self, token: int) -> str:
        return self.model.token_text(token) if 0 <= token < self.model.n_vocab else ""

    # -- prompts ------------------------------------------------------------------------------
    def chat_tokens(self, messages: Sequence[Message | dict]) -> list[int]:
        """Renders messages with the model's template and tokenizes the result: control tokens
        are parsed in the template's text only, never in a message's content.

        Raises:
            InvalidRequest: see ``ChatTemplate.tokens``.
        """
        # Templates that write the BOS themselves must not get a second one from the tokenizer.
        return self.template.tokens(messages, self.model, bos_text=self._special_text(self.model.bos))

    def text_tokens(self, prompt: str) -> list[int]:
        """Tokenizes a raw prompt (no template), with the model's BOS if it wants one."""
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        return self.model.tokenize(prompt, add_special=True, parse_special=False)

    # -- generation ---------------------------------------------------------------------------
    def stream_tokens(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
                      cancel: threading.Event | None = None) -> Iterator[TokenEvent | DoneEvent]:
        """Streams events for a tokenized prompt, after the requests queued before it.

        Joins the queue when iteration starts (``QueueFull`` is raised by the first ``next``);
        see ``submit`` to join it at once.
        """
        ticket = self.queue.enter()
        yield from self._run(ticket, prompt, request, cancel)

    def submit(self, prompt: Sequence[int], request: GenerationRequest = GenerationRequest(),
               cancel: threading.Event | None = None) -> Iterator[TokenEvent | DoneEvent]:
        """Like ``stream_tokens`` but takes a place in the queue now.

        Raises:
            QueueFull: ``max_queue`` requests are already waiting.
            InvalidRequest: the engine is closed.
        Returns an iterator that waits for its turn on the first ``next``; closing it (or
        dropping it) before or during the generation gives the place back.
        """
        self._check_open()
        ticket = self.queue.enter()
        return _QueuedStream(self._run(ticket, prompt, request, cancel), self.queue, ticket)

    def _run(self, ticket: "_Ticket", prompt: Sequence[int], request: GenerationRequest,
             cancel: threading.Event | None) -> Iterator[TokenEvent | DoneEvent]:
        released = False
        try:
            if not self.queue.wait(ticket, cancel):
                stats = GenerationStats(prompt_tokens=len(prompt), finish_reason="cancelled")
                self.queue.leave(ticket)
                released = True
                yield DoneEvent("", (), stats)
                return
            inner = self.decoder.stream(prompt, request, _AnyEvent(cancel, ticket.cancel))
            try:
                for ev in inner:
                    if isinstance(ev, DoneEvent):
                        # The answer is complete: free the slot before the caller sees the end,
                        # so the next request starts even if this stream is never closed.
                        inner.close()
                        self.queue.leave(ticket)
                        released = True
                    yield ev
            finally:
                inner.close()
        finally:
            if not released:
                self.queue.leave(ticket)

    def stream(self, prompt: str | Sequence[int], request: GenerationRequest | None = None,
               cancel: threading.Event | None = None, **options) -> Iterator[TokenEvent | DoneEvent]:
        """Streams the continuation of a raw prompt (text without the chat template, or ids).

        ``options`` are those of ``make_request`` (max_tokens, stop, temperature, top_k,
        top_p, min_p, repeat_penalty, seed, ignore_eos); bad ones raise InvalidRequest here.
        """
        self._check_open()
        request = make_request(request, **options)
        return self.stream_tokens(self._prompt_tokens(prompt), request, cancel)

    def generate(self, prompt: str | Sequence[int], request: GenerationRequest | None = None,
                 cancel: threading.Event | None = None, **options) -> Result:
        """Generates the continuation of a raw prompt and returns the final event."""
        return _last(self.stream(prompt, request, cancel, **options))

    def stream_chat(self, messages: Sequence[Message | dict],
                    request: GenerationRequest | None = None,
                    cancel: threading.Event | None = None, **options) -> Iterator[TokenEvent | DoneEvent]:
        """Streams the assistant's answer to ``messages`` rendered with the model's template."""
        self._check_open()
        request = make_request(request, **options)
        return self.stream_tokens(self.chat_tokens(messages), request, cancel)

    def chat(self, messages: Sequence[Message | dict], request: GenerationRequest | None = None,
             cancel: threading.Event | None = None, **options) -> Result:
        """The assistant's whole answer to ``messages`` (final event: text, ids, stats)."""
        return _last(self.stream_chat(messages, request, cancel, **options))

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest("the engine is closed")

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.text_tokens(prompt)
        tokens = list(prompt)
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.model.n_vocab:
                raise InvalidRequest(f"prompt token {t!r} is not a token id in [0, {self.model.n_vocab})")
        return tokens

    def cancel_all(self) -> None:
        """Cancels the running request and every waiting one (later requests are unaffected)."""
        self.queue.cancel_all()

    def reset(self) -> None:
        """Forgets the KV cache; waits for a running request of another thread to finish."""
        if self.queue.held_by_current_thread():
            self.seq.clear()
            return
        ticket = self.queue.enter(force=True)
        try:
            if self.queue.wait(ticket):  # False: the engine is closing
                self.seq.clear()
        finally:
            self.queue.leave(ticket)

    def memory_report(self) -> dict:
        return self.ctx.memory_report()

    def close(self, timeout: float = 60.0) -> None:
        """Cancels queued and running requests, waits for the running one to stop, frees memory.

        Idempotent. Safe to call from any thread; from the thread that is itself in the middle
        of a stream it frees at once.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.queue.close()
        if not self.queue.wait_idle(timeout):
            log.warning("a generation did not stop within %.0f s; its memory is not freed", timeout)
            return
        self._free()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _last(events: Iterator[TokenEvent | DoneEvent]) -> DoneEvent:
    done = None
    for ev in events:
        done = ev
    if not isinstance(done, DoneEvent):  # pragma: no cover - every stream ends with one
        raise RuntimeError("generation ended without a DoneEvent")
    return done


class _AnyEvent:
    """Looks like a threading.Event that is set when any of its parts is (read-only)."""

    def __init__(self, *events: threading.Event | None):
        self._events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


class _Ticket:
    """One request's place in a RequestQueue."""

    __slots__ = ("cancel", "thread")

    def __init__(self) -> None:
        self.cancel = threading.Event()  # set by cancel_all / close
        self.thread: int | None = None  # the thread that runs it, once it runs


class RequestQueue:
    """FIFO admission to one engine: one request runs, the others wait in arrival order.

    ``enter`` takes a ticket at once (or raises QueueFull when ``max_waiting`` tickets already
    wait); ``wait`` blocks until the ticket is first and nothing runs, or until it is
    cancelled; ``leave`` gives the place or the slot back (idempotent).
    """

    POLL_S = 0.05  # how often a waiting request looks at its caller's cancel event

    def __init__(self, max_waiting: int | None = None):
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: deque[_Ticket] = deque()
        self._running: _Ticket | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """Requests waiting behind the running one."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether a request is running."""
        return self._running is not None

    def held_by_current_thread(self) -> bool:
        running = self._running
        return running is not None and running.thread == threading.get_ident()

    def enter(self, force: bool = False) -> _Ticket:
        with self._cond:
            if self._closed:
                raise InvalidRequest("the engine is closed")
            if (not force and self.max_waiting is not None
                    and len(self._waiting) + (self._running is not None) > self.max_waiting):
                raise QueueFull(f"the request queue is full ({self.max_waiting} waiting); retry later")
            ticket = _Ticket()
            self._waiting.append(ticket)
            return ticket

    def wait(self, ticket: _Ticket, cancel: threading.Event | None = None) -> bool:
        """Blocks until ``ticket`` may run (True) or is cancelled (False, place given back)."""
        with self._cond:
            if self.held_by_current_thread():
                self._remove(ticket)
                raise InvalidRequest("this thread is already in the middle of a generation on "
                                     "this engine; finish or close that stream first")
            while True:
                if ticket.cancel.is_set() or (cancel is not None and cancel.is_set()):
                    self._remove(ticket)
                    return False
                if self._running is None and self._waiting and self._waiting[0] is ticket:
                    self._waiting.popleft()
                    self._running = ticket
                    ticket.thread = threading.get_ident()
                    return True
                if ticket not in self._waiting:  # left (closed stream) or never entered
                    return False
                self._cond.wait(self.POLL_S if cancel is not None else None)

    def leave(self, ticket: _Ticket) -> None:
        with self._cond:
            self._remove(ticket)

    def _remove(self, ticket: _Ticket) -> None:
        if self._running is ticket:
            self._running = None
        else:
            try:
                self._waiting.remove(ticket)
            except ValueError:
                return
        self._cond.notify_all()

    def cancel_all(self) -> None:
        with self._cond:
            for ticket in ([self._running] if self._running else []) + list(self._waiting):
                ticket.cancel.set()
            self._cond.notify_all()

    def close(self) -> None:
        """Refuses new tickets and cancels the current ones."""
        with self._cond:
            self._closed = True
        self.cancel_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until nothing runs or waits (a stream of the calling thread counts as idle)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._waiting or (self._running is not None and not self.held_by_current_thread()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True


class _QueuedStream:
    """An iterator over a generation that already holds a place in the queue."""

    def __init__(self, events: Iterator[TokenEvent | DoneEvent], queue: RequestQueue, ticket: _Ticket):
        self._events, self._queue, self._ticket = events, queue, ticket

    def __iter__(self) -> "_QueuedStream":
        return self

    def __next__(self) -> TokenEvent | DoneEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()
        self._queue.leave(self._ticket)  # a generator never started has no finally to run

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
