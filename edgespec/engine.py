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
from dataclasses import dataclass, replace

from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel, ModelParams
from edgespec.decode.chat_template import ChatTemplate, Message
from edgespec.errors import InvalidRequest, QueueFull
from edgespec.decode.events import DoneEvent, GenerationStats, TokenEvent
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest, make_request
from edgespec.decode.sequence import KVSequence
from edgespec.files.store import ModelStore
from edgespec.llama import invariant
from edgespec.llama.kernels import default_flash_attn
from edgespec.memory import placements

log = logging.getLogger(__name__)

DEFAULT_MODEL = "qwen2.5-coder-1.5b"

# What generate() / chat() return: the final event of a request (text, token ids, stats).
Result = DoneEvent


@dataclass(frozen=True)
class EngineConfig:
    """Where the target comes from and how it is placed."""

    model: str = DEFAULT_MODEL
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    # None: off when the target runs on the CPU with an f16 cache, else llama.cpp's choice
    # (edgespec.llama.kernels.default_flash_attn); planned loads plan the kernel given.
    flash_attn: bool | None = None
    # Speculation: None = the plain baseline generator; otherwise a drafter name from
    # edgespec.drafters (none | suffix | model | hybrid | auto) or a drafter model name/path.
    draft: str | None = None
    draft_model: str | None = None
    # The draft shape (edgespec.memory.placements.DraftShape); None: for `auto` in a planned
    # load the placement's default (63-token drafts and greedy trees where the target verifies
    # through a GPU or the drafter runs on one), else 32-token chains.
    draft_max: int | None = None
    draft_tree: bool | None = None
    # Greedy: verified positions whose top-2 logit gap is below this are re-decoded alone
    # (edgespec.spec.step.SpeculativeStep); 0 decides every position from the batch.
    recheck_gap: float = 0.0
    # Greedy chains: the drafter drafts ahead while the target verifies (SpeculativeStep); on
    # whenever the placement is `overlap`. Pays only with drafter and target on different processors.
    overlap: bool = False
    n_seq_max: int | None = None  # default: enough sequences for draft_max-node trees
    # Budgets in bytes and a placement mode (edgespec.memory.placements: gpu | offload |
    # draft-gpu | overlap | cpu). All None keeps the settings above; any of them set, the planner chooses
    # placement, GPU layers, KV type, batch sizes, drafter and file-backed weights within the
    # budgets (an unset budget: what the machine has free, minus a margin).
    ram_budget: int | None = None
    vram_budget: int | None = None
    placement: str | None = None
    # Requests that may wait behind the running one (None: no limit); one more raises QueueFull.
    max_queue: int | None = None
    # The onnx drafter: onnxruntime execution provider (edgespec.onnx.providers.PROVIDERS; one
    # absent or refusing the graph falls back to the CPU) and which conversion ("exact" | "4").
    onnx_provider: str = "cpu"
    onnx_bits: str = "exact"
    # Batch-invariant kernels for a target on the CPU (edgespec.llama.invariant): every verified
    # row is computed bit for bit as a one-token decode, so greedy speculation returns exactly
    # the answer plain greedy decoding gives under the same kernels (which can differ from the
    # default kernels' at near-ties). Verifies chains only (SpeculativeStep.chains_only). Turns
    # llama.cpp's tiled matmul off for the whole process (native bench peers keep theirs).
    exact: bool = False

    def __post_init__(self) -> None:
        if self.draft_max is not None and (isinstance(self.draft_max, bool) or not isinstance(self.draft_max, int)
                                           or not 1 <= self.draft_max <= placements.MAX_DRAFT):
            raise InvalidRequest(f"draft_max must be in [1, {placements.MAX_DRAFT}], got {self.draft_max}")
        if isinstance(self.n_ctx, bool) or not isinstance(self.n_ctx, int) or self.n_ctx < 16:
            raise InvalidRequest(f"n_ctx must be an integer >= 16, got {self.n_ctx!r}")
        if self.n_threads is not None and (not isinstance(self.n_threads, int) or self.n_threads < 1):
            raise InvalidRequest(f"n_threads must be a positive integer, got {self.n_threads!r}")
        if self.n_gpu_layers < -1:
            raise InvalidRequest(f"n_gpu_layers must be >= -1, got {self.n_gpu_layers}")
        if not self.recheck_gap >= 0:
            raise InvalidRequest(f"recheck_gap must be >= 0, got {self.recheck_gap!r}")
        if self.ram_budget is not None and self.ram_budget <= 0:
            raise InvalidRequest(f"ram_budget must be positive, got {self.ram_budget}")
        if self.vram_budget is not None and self.vram_budget < 0:
            raise InvalidRequest(f"vram_budget must be >= 0, got {self.vram_budget}")
        if self.placement is not None:
            placements.mode(self.placement)
        if self.max_queue is not None and (isinstance(self.max_queue, bool)
                                           or not isinstance(self.max_queue, int) or self.max_queue < 0):
            raise InvalidRequest(f"max_queue must be a non-negative integer, got {self.max_queue!r}")
        if self.exact:
            self._check_exact()
        from edgespec.drafters import check_onnx_options

        check_onnx_options(self.onnx_provider, self.onnx_bits)

    def _check_exact(self) -> None:
        if self.flash_attn is False:
            raise InvalidRequest("exact mode runs flash attention (without it the attention product "
                                 "depends on the batch); drop --no-flash-attn (flash_attn=False)")
        if self.recheck_gap > 0:
            raise InvalidRequest("exact mode computes every verified row as plain decoding does: "
                                 "near-tie re-checks would only cost time; drop --recheck-gap")
        if self.draft_tree:
            raise InvalidRequest("exact mode drafts chains: a tree's accepted path leaves its cache cells "
                                 "out of position order; drop --draft-tree")
        if self.n_gpu_layers != 0 or (self.placement is not None and placements.MODES[self.placement].target != "cpu"):
            raise InvalidRequest("exact mode needs the target on the CPU (GPU kernels depend on the batch "
                                 "size): use --placement cpu or draft-gpu, and no --n-gpu-layers")

    @property
    def planned(self) -> bool:
        """Whether the planner places the load (a budget or a placement is given)."""
        return self.ram_budget is not None or self.vram_budget is not None or self.placement is not None


class Engine:
    """A target model ready to generate. Use as a context manager or call ``close()``."""

    def __init__(self, config: EngineConfig = EngineConfig(), store: ModelStore | None = None):
        self.config = config
        self.store = store or ModelStore()
        path = self.store.resolve(config.model)
        if config.exact:  # before the plan reads calibrations keyed by the kernels, and any decode
            invariant.enable()
        self.placement = None
        self.releaser = None
        if config.planned:
            # Plan before loading anything: an impossible budget is refused here, cheaply.
            from edgespec.memory.budget import placement

            self.placement = placement(str(path), self.store, config.ram_budget, config.n_ctx, config.draft,
                                       config.draft_model, config.draft_max,
                                       False if config.exact else config.draft_tree,
                                       config.n_threads, config.n_seq_max or 1, config.vram_budget,
                                       config.placement, config.onnx_provider, config.onnx_bits, config.exact,
                                       config.flash_attn)
            model_params, ctx_params = self.placement.model_params, self.placement.context_params
            plan = self.placement.plan
            self.draft_shape = placements.DraftShape(plan.draft_max, plan.draft_tree)
        else:
            self.draft_shape = placements.CHAINS.given(config.draft_max, config.draft_tree)
            model_params, op_offload = _unplanned_params(config, path)
            # one sequence per root-to-leaf path of a draft, plus the main one
            n_seq = config.n_seq_max or 1 + (self.draft_shape.draft_max if config.draft is not None else 0)
            ctx_params = ContextParams(n_ctx=config.n_ctx, n_threads=config.n_threads, n_seq_max=n_seq,
                                       n_outputs_max=placements.VERIFY_ROWS,
                                       flash_attn=_flash_attn(config), op_offload=op_offload)
        if config.exact:
            model_params, ctx_params = invariant.model_params(model_params), invariant.context_params(ctx_params)
        self.model = LlamaModel(path, model_params)
        self.ctx = self.drafter = None
        try:
            self._build(config, path, ctx_params)
        except BaseException:
            self._free()
            raise
        self.queue = RequestQueue(config.max_queue)
        self._closed = False

    def _build(self, config: EngineConfig, path, ctx_params: ContextParams) -> None:
        """What serves requests over the loaded model: the releaser of file-backed weights, the
        context (checked in exact mode), the decoder and the drafter. On a raise the caller frees
        what was built (``_free``)."""
        if self.placement is not None and self.placement.file_backed:
            from edgespec.memory.filebacked import WeightReleaser

            self.releaser = WeightReleaser(str(path), self.placement.release_limit)
        if ctx_params.n_ctx > self.model.n_ctx_train:
            raise InvalidRequest(f"context {ctx_params.n_ctx} exceeds the model's trained context "
                                 f"{self.model.n_ctx_train}")
        self.ctx = LlamaContext(self.model, ctx_params)
        if config.exact:
            invariant.check(self.ctx)
        self.seq = KVSequence(self.ctx)
        self.decoder = Decoder(self.model, self.seq)
        if config.draft is not None:
            self._init_speculation(config)
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

    def _init_speculation(self, config: EngineConfig) -> None:
        from edgespec.drafters import DraftConfig, make_drafter

        p = self.placement
        shape = self.draft_shape
        draft_cfg = self.drafter_config(DraftConfig(
            kind=config.draft, draft_model=config.draft_model, tree=shape.tree, n_ctx=self.ctx.n_ctx,
            n_threads=config.n_threads, draft_max=shape.draft_max, onnx_provider=config.onnx_provider,
            onnx_bits=config.onnx_bits))
        if p is not None:
            draft_cfg = replace(draft_cfg, kind=p.draft)
        self.drafter = make_drafter(draft_cfg, self.model, self.store, target_ctx=self.ctx)
        self.decoder = Decoder(self.model, self.seq, self.speculative_step(self.drafter, shape.draft_max,
                                                                          config.recheck_gap))

    def drafter_config(self, cfg):
        """``cfg`` as this engine's drafters must be: placed as its plan placed the drafter, and
        proposing chains in exact mode (verification then takes chains only)."""
        cfg = replace(cfg, chains=self.config.exact)
        p = self.placement
        return p.drafter_config(cfg) if p is not None else cfg

    def speculative_step(self, drafter, draft_max: int, recheck_gap: float = 0.0):
        """A step verifying ``drafter``'s drafts as this engine must: overlapped where its
        placement says so, chains only in exact mode."""
        from edgespec.spec.step import SpeculativeStep

        return SpeculativeStep(drafter, draft_max, recheck_gap, overlap=self.overlap,
                               chains_only=self.config.exact)

    @property
    def overlap(self) -> bool:
        """Whether speculative steps draft ahead during verification: asked for, or the
        placement is `overlap` (edgespec.memory.placements)."""
        p = self.placement
        return self.config.overlap or (p is not None and placements.MODES[p.plan.placement].overlap)

    def _special_text(self, token: int) -> str:
        return self.model.token_text(token) if 0 <= token < self.model.n_vocab else ""

    # -- prompts ------------------------------------------------------------------------------
    def chat_tokens(self, messages: Sequence[Message | dict]) -> list[int]:
        """Renders messages with the model's template and tokenizes the result."""
        text = self.template.render(messages, add_generation_prompt=True)
        bos_text = self._special_text(self.model.bos)
        # Templates that write the BOS themselves must not get a second one from the tokenizer.
        add_special = not (bos_text and text.startswith(bos_text))
        return self.model.tokenize(text, add_special=add_special, parse_special=True)

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


def _unplanned_params(config: EngineConfig, path) -> tuple[ModelParams, bool]:
    """The target as asked (``n_gpu_layers``), with the planner's rules for a GPU build
    (placements.unplanned_target); the model parameters and the context's op offload."""
    from edgespec.files.modelfile import model_file
    from edgespec.memory.machine import machine

    n_layer = model_file(path).info.n_layers or 0
    op_offload, use_mmap = placements.unplanned_target(config.n_gpu_layers, n_layer, machine(), config.use_mmap)
    return ModelParams(n_gpu_layers=config.n_gpu_layers, use_mmap=use_mmap, use_mlock=config.use_mlock), op_offload


def _flash_attn(config: EngineConfig) -> bool | None:
    """Flash attention for an unbudgeted context: the user's choice, else the engine's default
    (edgespec.llama.kernels.default_flash_attn, which the planner asks too)."""
    if config.flash_attn is not None:
        return config.flash_attn
    return default_flash_attn(on_gpu=config.n_gpu_layers != 0)


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
