"""`edgespec chat`: a terminal conversation that keeps the KV cache between turns.

Each turn renders the whole conversation with the model's template; the generator's prefix
reuse means only the new user message (and the template's glue) is evaluated.
Input: a line, a line ending in a backslash to continue, or a block between triple quotes.
Commands: /reset, /stats, /help, /exit. Ctrl-C stops an answer, Ctrl-D leaves.
"""
from __future__ import annotations

import io
import signal
import sys
import threading
from typing import Optional

import typer

from edgespec.cli import app
from edgespec.cli import common as c
from edgespec.engine import Engine
from edgespec.decode.events import DoneEvent, GenerationStats, TokenEvent
from edgespec.decode.request import GenerationRequest
from edgespec.errors import EdgespecError, InvalidRequest

HELP = """commands: /reset (forget the conversation)  /stats (last answer and session totals)
          /help  /exit (or Ctrl-D). Ctrl-C stops an answer. End a line with \\ to continue it,
          or wrap several lines in triple quotes \"\"\"."""


class ChatSession:
    """Conversation state of one chat: messages, last stats and session totals."""

    def __init__(self, engine: Engine, request: GenerationRequest, system: str | None):
        self.engine = engine
        self.request = request
        self.system = system
        self.messages: list[dict] = []
        self.last: GenerationStats | None = None
        self.turns = 0
        self.total_tokens = 0
        self.total_gen_s = 0.0
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.reset()

    def answer(self, user_text: str, write) -> DoneEvent:
        """Adds a user message, streams the answer through ``write(text, from_draft)``."""
        self.messages.append({"role": "user", "content": user_text})
        cancel = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
        done = None
        try:
            for ev in self.engine.stream_chat(self.messages, self.request, cancel):
                if isinstance(ev, TokenEvent) and ev.text:
                    write(ev.text, ev.from_draft)
                elif isinstance(ev, DoneEvent):
                    done = ev
        except EdgespecError:
            self.messages.pop()  # a refused message leaves the conversation as it was
            raise
        finally:
            signal.signal(signal.SIGINT, previous)
        # A stopped answer stays in the history as far as it got, as it was shown.
        self.messages.append({"role": "assistant", "content": done.text})
        self.last = done.stats
        self.turns += 1
        self.total_tokens += done.stats.generated_tokens
        self.total_gen_s += done.stats.gen_s
        return done

    def stats_text(self) -> str:
        if self.last is None:
            return "no answer yet"
        rate = self.total_tokens / self.total_gen_s if self.total_gen_s > 0 else 0.0
        return (f"last: {c.stats_line(self.last)}\n"
                f"session: {self.turns} turns, {self.total_tokens} tokens generated, {rate:.1f} tok/s, "
                f"{len(self.engine.seq)} tokens in the KV cache")


def read_message(prompt: str = ">>> ") -> str | None:
    """Reads one possibly multi-line message (common.utf8_text); None on Ctrl-D. Ctrl-C clears the input."""
    return c.utf8_text(_read_message(prompt))


def _read_message(prompt: str) -> str | None:
    while True:
        try:
            line = input(prompt)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            continue
        except EOFError:
            return None
        if line.strip() == '"""':
            return _read_until('"""')
        if line.startswith('"""'):
            return _read_until('"""', first=line[3:])
        lines = [line]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            try:
                lines.append(input("... "))
            except (EOFError, KeyboardInterrupt):
                break
        return "\n".join(lines)


def _read_until(fence: str, first: str = "") -> str | None:
    lines = [first] if first else []
    while True:
        try:
            line = input("... ")
        except (EOFError, KeyboardInterrupt):
            return "\n".join(lines) or None
        if line.rstrip().endswith(fence):
            lines.append(line.rstrip()[: -len(fence)])
            return "\n".join(lines).strip("\n")
        lines.append(line)


DRAFT_COLOUR = "\x1b[32m"  # accepted-draft text in green
RESET = "\x1b[0m"


def _writer(show_drafts: bool):
    def write(text: str, from_draft: bool = False) -> None:
        sys.stdout.write(f"{DRAFT_COLOUR}{text}{RESET}" if show_drafts and from_draft else text)
        sys.stdout.flush()
    return write


@app.command()
def chat(
    model: str = c.MODEL,
    max_tokens: int = c.MAX_TOKENS,
    temperature: float = c.TEMPERATURE,
    top_k: int = c.TOP_K,
    top_p: float = c.TOP_P,
    min_p: float = c.MIN_P,
    repeat_penalty: float = c.REPEAT_PENALTY,
    seed: Optional[int] = c.SEED,
    system: Optional[str] = c.SYSTEM,
    draft: str = c.DRAFT,
    draft_max: Optional[int] = c.DRAFT_MAX,
    draft_tree: Optional[bool] = c.DRAFT_TREE,
    draft_model: Optional[str] = c.DRAFT_MODEL,
    onnx_provider: str = c.ONNX_PROVIDER,
    onnx_bits: str = c.ONNX_BITS,
    recheck_gap: float = c.RECHECK_GAP,
    exact: bool = c.EXACT,
    flash_attn: Optional[bool] = c.FLASH_ATTN,
    ram_budget: Optional[str] = c.RAM_BUDGET,
    vram_budget: Optional[str] = c.VRAM_BUDGET,
    placement: Optional[str] = c.PLACEMENT,
    show_drafts: bool = typer.Option(False, "--show-drafts", help="Colour text that came from accepted drafts."),
    ctx: int = c.CTX,
    threads: Optional[int] = c.THREADS,
    n_gpu_layers: int = c.GPU_LAYERS,
) -> None:
    """Chat in the terminal with history; the KV cache is reused between turns."""
    request = GenerationRequest(
        max_tokens=max_tokens,
        sampling=c.sampling_from_options(temperature, top_k, top_p, min_p, repeat_penalty, seed))
    with c.engine_from_options(
            model=model, ctx=ctx, threads=threads, n_gpu_layers=n_gpu_layers, draft=draft, draft_max=draft_max,
            draft_tree=draft_tree, draft_model=draft_model, ram_budget=ram_budget, recheck_gap=recheck_gap,
            onnx_provider=onnx_provider, onnx_bits=onnx_bits, vram_budget=vram_budget, placement=placement,
            exact=exact, flash_attn=flash_attn) as engine:
        typer.echo(f"edgespec chat with {model} - /help for commands", err=True)
        if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable bytes reach utf8_text, not a traceback
            sys.stdin.reconfigure(errors="surrogateescape")
        _loop(ChatSession(engine, request, system), _writer(show_drafts))


def _loop(session: ChatSession, write) -> None:
    """Reads messages and commands until /exit or end of input, answering each message."""
    while True:
        message = read_message()
        if message is None or message.strip() in ("/exit", "/quit", "/bye"):
            break
        command = message.strip()
        if not command:
            continue
        if command == "/reset":
            session.reset()
            typer.echo("conversation cleared", err=True)
        elif command == "/stats":
            typer.echo(session.stats_text(), err=True)
        elif command == "/help":
            typer.echo(HELP, err=True)
        elif command.startswith("/") and " " not in command:
            typer.echo(f"unknown command {command}; /help lists them", err=True)
        else:
            try:
                done = session.answer(message, write)
            except InvalidRequest as exc:  # this message's fault: the session goes on
                typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
                continue
            write("\n")
            if done.finish_reason == "cancelled":
                typer.echo("[stopped]", err=True)
            typer.echo(c.stats_line(done.stats), err=True)
