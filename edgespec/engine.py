"""Engine: a loaded target model with its context, chat template and generator.

The one object the CLI (and later the server and embedding apps) holds: it resolves a model
name or path through the store, validates and loads it once, and turns prompts or chat
messages into streams of typed events.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from edgespec.backend import ContextParams, LlamaContext, LlamaModel, ModelParams
from edgespec.chat_template import ChatTemplate, Message
from edgespec.errors import InvalidRequest
from edgespec.events import DoneEvent, TokenEvent
from edgespec.generate import GenerationRequest, Generator
from edgespec.store import ModelStore

log = logging.getLogger(__name__)

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class EngineConfig:
    """Where the target comes from and how it is placed."""

    model: str = DEFAULT_MODEL
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    # Speculation: None = the plain baseline generator; otherwise a drafter name from
    # edgespec.drafters (none | suffix | model | hybrid | auto) or a drafter model name/path.
    draft: str | None = None
    draft_model: str | None = None
    draft_max: int = 16
    draft_tree: bool = False


class Engine:
    """A target model ready to generate. Use as a context manager or call ``close()``."""

    def __init__(self, config: EngineConfig = EngineConfig(), store: ModelStore | None = None):
        self.config = config
        self.store = store or ModelStore()
        path = self.store.resolve(config.model)
        self.model = LlamaModel(path, ModelParams(n_gpu_layers=config.n_gpu_layers,
                                                  use_mmap=config.use_mmap, use_mlock=config.use_mlock))
        n_ctx = config.n_ctx
        if n_ctx > self.model.n_ctx_train:
            raise InvalidRequest(f"context {n_ctx} exceeds the model's trained context "
                                 f"{self.model.n_ctx_train}")
        if not 1 <= config.draft_max <= 64:
            raise InvalidRequest(f"draft_max must be in [1, 64], got {config.draft_max}")
        # One sequence per root-to-leaf path of a draft tree, plus the main sequence.
        n_seq = 1 + (config.draft_max if config.draft is not None else 0)
        self.ctx = LlamaContext(self.model, ContextParams(n_ctx=n_ctx, n_threads=config.n_threads,
                                                          n_seq_max=n_seq))
        self.generator = Generator(self.model, self.ctx)
        self.drafter = None
        self.speculative = None
        if config.draft is not None:
            self._init_speculation(config)
        self.template = ChatTemplate(self.model.chat_template, self._special_text(self.model.bos),
                                     self._special_text(self.model.eos))
        self._lock = threading.Lock()

    def _init_speculation(self, config: EngineConfig) -> None:
        from edgespec.drafters import DraftConfig, make_drafter
        from edgespec.speculative import SpeculativeGenerator

        self.drafter = make_drafter(
            DraftConfig(kind=config.draft, draft_model=config.draft_model, tree=config.draft_tree,
                        n_ctx=config.n_ctx, n_threads=config.n_threads), self.model, self.store)
        self.speculative = SpeculativeGenerator(self.generator, self.drafter, config.draft_max)

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
        """Streams events for a tokenized prompt; one request at a time per engine."""
        runner = self.speculative or self.generator
        with self._lock:
            yield from runner.stream(prompt, request, cancel)

    def stream_chat(self, messages: Sequence[Message | dict],
                    request: GenerationRequest = GenerationRequest(),
                    cancel: threading.Event | None = None) -> Iterator[TokenEvent | DoneEvent]:
        return self.stream_tokens(self.chat_tokens(messages), request, cancel)

    def generate_chat(self, messages: Sequence[Message | dict],
                      request: GenerationRequest = GenerationRequest()) -> DoneEvent:
        done = None
        for ev in self.stream_chat(messages, request):
            done = ev
        return done

    def reset(self) -> None:
        self.generator.reset()

    def memory_report(self) -> dict:
        return self.ctx.memory_report()

    def close(self) -> None:
        if self.drafter is not None and hasattr(self.drafter, "close"):
            self.drafter.close()
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
