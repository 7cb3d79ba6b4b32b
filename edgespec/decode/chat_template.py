"""Chat templates from GGUF metadata, rendered in a bounded, sandboxed Jinja2 environment.

Templates come from model files, which may come from anywhere. The sandbox forbids attribute
access to Python internals, and every render is bounded: a deadline enforced on the rendering
thread, a size limit on every string or list the template builds and on its output, a cap on
``range`` and on integer arguments, and a limit on the memory the process gains while it runs.
Whatever goes wrong (a rejection, a crash of the template or of a helper, recursion, a bound)
is one ``InvalidRequest`` line, and the thread that rendered is free again when it is raised.

Message contents are user data: ``ChatTemplate.tokens`` parses control tokens only in the
template's own text, so "<|im_start|>" typed in a message stays text.
"""
from __future__ import annotations

import datetime
import functools
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import jinja2
import psutil
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgespec.errors import InvalidRequest

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")

# The bounds of one render. The real Qwen2.5 and SmolLM2 templates render a conversation in
# about 0.1 ms and build nothing near these sizes, so only a hostile template meets them.
RENDER_SECONDS = 2.0
MAX_RANGE = 10_000
MAX_INT_ARGUMENT = 100_000  # widths, counts and indents passed to methods and filters
BASE_CHARS = 1 << 20  # any string, list or output: this plus 4 x the messages' contents
MEMORY_BYTES = 256 << 20  # resident memory the process may gain during one render
_MEMORY_EVERY = 64  # line events between two memory checks (one costs about 7 us)
_TEMPLATE_FILE = "<template>"  # the file name jinja gives code compiled by from_string
# Nested calls of the template's own code (macros) a render may hold at once. Python's own limit
# came first otherwise, at a depth that depends on the caller's stack, and a RecursionError raised
# inside the trace hook surfaced as an unrelated TypeError.
MAX_TEMPLATE_DEPTH = 100
# A width or precision of a million or more in a %-format or a str.format field.
_WIDE_FORMAT = re.compile(r"%[-#0 +]*(\d*\.)?\d{7,}|\{[^{}]*:[^{}]*\d{7,}")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class Vocab(Protocol):
    """What ``ChatTemplate.tokens`` needs of a model (``LlamaModel`` has it)."""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def token_piece(self, token: int) -> bytes: ...
    def token_text(self, token: int) -> str: ...


class _Bound(Exception):
    """A render went past one of its bounds."""


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_STATM: int | None = None  # an fd of /proc/self/statm, opened on first use; -1 without one
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    """Resident bytes of this process: a pread of /proc/self/statm (7 us; psutil takes 80 us)."""
    global _STATM
    if _STATM is None:
        try:
            _STATM = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            _STATM = -1
    if _STATM < 0:
        return psutil.Process().memory_info().rss
    return int(os.pread(_STATM, 64, 0).split()[1]) * _PAGE


class _Render:
    """The bounds of one render on one thread: its size limit, deadline and memory baseline."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.deadline = time.monotonic() + RENDER_SECONDS
        self._rss0 = _rss()
        self._events = 0
        self._depth = 0  # template frames entered and not yet left

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise _Bound(f"it builds a {what} of {n} items (the bound is {self.max_chars})")

    def trace(self, frame, event, arg):
        """sys.settrace hook: the deadline is checked at every call, and at every line of the
        template's own code, where jinja compiles its loops (line events for every frame made
        rendering the real templates 13x slower; for the template's only, 5x: +0.5 ms)."""
        self._check_deadline()
        if frame.f_code.co_filename != _TEMPLATE_FILE:
            return None
        self._depth += 1
        if self._depth > MAX_TEMPLATE_DEPTH:
            raise _Bound(f"it recursed too deeply ({MAX_TEMPLATE_DEPTH} nested calls)")
        return self._line

    def _check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Bound(f"it ran past the {RENDER_SECONDS:g} s render bound")

    def _line(self, frame, event, arg):
        if event == "return":  # a frame left, or a generator paused (its resumption is a call)
            self._depth -= 1
        self._check_deadline()
        self._events += 1
        if self._events % _MEMORY_EVERY == 0:
            grown = _rss() - self._rss0
            if grown > MEMORY_BYTES:
                raise _Bound(f"it took {grown >> 20} MiB (the bound is {MEMORY_BYTES >> 20} MiB)")
        return self._line


_current = threading.local()  # .max_chars of the render running on this thread


def _check_len(n: int, what: str) -> None:
    # Outside a render (jinja folding constants while compiling) the bound is BASE_CHARS.
    if n > (limit := getattr(_current, "max_chars", BASE_CHARS)):
        raise _Bound(f"it builds a {what} of {n} items (the bound is {limit})")


def _check_size(value, what: str) -> None:
    if isinstance(value, (str, bytes, list, tuple)):
        _check_len(len(value), what)


def _check_arguments(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARGUMENT:
            raise _Bound(f"it passes {a} to a function (the bound is {MAX_INT_ARGUMENT})")


def _check_format(fmt) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise _Bound("it formats with a width or precision of a million or more")


def _predicted_size(obj, args) -> int:
    """The length a str method is about to build, for the methods that multiply their input."""
    name, s = getattr(obj, "__name__", ""), getattr(obj, "__self__", None)
    if not isinstance(s, str):
        return 0
    if name in ("format", "format_map"):
        _check_format(s)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = len(s) + 1 if args[0] == "" else s.count(args[0])
        return len(s) + count * max(0, len(args[1]) - len(args[0]))
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        return sum(len(x) for x in args[0] if isinstance(x, str)) + len(s) * len(args[0])
    if name == "expandtabs":
        return len(s) + s.count("\t") * (args[0] if args and isinstance(args[0], int) else 8)
    return 0


def _bounded_filter(name: str, f):
    """A filter that refuses the arguments that would make it build a value past the bounds."""
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def wrapper(*args, **kwargs):
        _check_arguments(args[1:], kwargs)
        if name == "format" and args:
            _check_format(args[0])
        if name == "indent" and args and isinstance(args[0], str):
            width = kwargs.get("width", args[1] if len(args) > 1 else 4)
            prefix = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            _check_len(len(args[0]) + (args[0].count("\n") + 1) * prefix, "string")
        out = f(*args, **kwargs)
        _check_size(out, "string")
        return out
    return wrapper


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a size-checked join (jinja otherwise joins in C, unchecked)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every operation that can build a large value checked before it runs."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **kwargs):
        # optimized=False: the optimizer folds constants at compile time, outside every bound
        # ('x' * 10**9 or center(10**9) would be built while the model loads).
        super().__init__(optimized=False, **kwargs)
        self.globals["range"] = self._range
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    @staticmethod
    def _range(*args):
        rng = range(*args)
        if len(rng) > MAX_RANGE:
            raise _Bound(f"it asks for a range of {len(rng)} (the bound is {MAX_RANGE})")
        return rng

    def bounded_concat(self, parts) -> str:
        texts = [str(p) for p in parts]
        _check_len(sum(map(len, texts)), "string")
        return "".join(texts)

    def call_binop(self, context, operator, left, right):
        sequences = (str, list, tuple)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, sequences) and isinstance(n, int):
                    _check_len(len(seq) * max(n, 0), "repetition")
        elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
            _check_len(len(left) + len(right), "concatenation")
        elif operator == "%":
            _check_format(left)
        elif (operator == "**" and isinstance(right, int) and abs(right) > 64
              and not (isinstance(left, int) and abs(left) <= 1)):
            raise _Bound(f"it raises to the power {right}")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        _check_arguments(args, kwargs)
        _check_len(_predicted_size(obj, args), "string")
        out = super().call(context, obj, *args, **kwargs)
        _check_size(out, "result")
        return out


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks / lstrip_blocks match how Hugging Face renders these templates, which is
    # what their authors test against.
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Sequence[Message | dict]) -> list[dict]:
    """Checks roles and contents; returns plain dicts for the template.

    Raises:
        InvalidRequest: empty list, unknown role, or non-string content.
    """
    if not messages:
        raise InvalidRequest("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        role, content = (m.role, m.content) if isinstance(m, Message) else (m.get("role"), m.get("content"))
        if role not in ROLES:
            raise InvalidRequest(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise InvalidRequest(f"message {i}: content must be a string")
        out.append({"role": role, "content": content})
    return out


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


class ChatTemplate:
    """A compiled chat template plus the special-token texts it refers to."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self._bos, self._eos = bos_token, eos_token
        self._template = None
        if source:
            try:
                self._template = _environment().from_string(source)
            except Exception as exc:  # noqa: BLE001 - any failure of foreign code: plain prompts
                log.warning("chat template does not compile (%s); using plain prompts", _one_line(exc))

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[Message | dict], add_generation_prompt: bool = True) -> str:
        """Renders a conversation to the prompt text the model was trained on.

        Without a usable template, falls back to the messages' contents joined by blank lines,
        which is what a base model expects.

        Raises:
            InvalidRequest: bad messages, the template rejects them, fails, or passes a bound.
        """
        msgs = validate_messages(messages)
        if self._template is None:
            return "\n\n".join(m["content"] for m in msgs)
        return self._render(msgs, add_generation_prompt)

    def _render(self, msgs: list[dict], add_generation_prompt: bool) -> str:
        """Renders under the bounds; the deadline is enforced on this thread, so it always ends."""
        r = _Render(BASE_CHARS + 4 * sum(len(m["content"]) for m in msgs))
        previous = sys.gettrace()
        _current.max_chars = r.max_chars
        sys.settrace(r.trace)
        try:
            out, size = [], 0
            for chunk in self._template.generate(messages=msgs, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self._bos, eos_token=self._eos):
                size += len(chunk)
                r.size(size, "prompt")
                out.append(chunk)
            return "".join(out)
        except _Bound as exc:
            raise InvalidRequest(f"chat template refused: {exc}") from None
        except RecursionError:
            raise InvalidRequest("chat template refused: it recursed too deeply") from None
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template rejected the messages: {_one_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - a template or helper error of any kind
            raise InvalidRequest(f"chat template failed: {type(exc).__name__}: {_one_line(exc)}") from None
        finally:
            sys.settrace(previous)
            del _current.max_chars

    def tokens(self, messages: Sequence[Message | dict], vocab: Vocab, bos_text: str = "") -> list[int]:
        """Renders and tokenizes a conversation, parsing control tokens only in the template's text.

        Ordinary contents give exactly the ids of tokenizing the whole prompt with control tokens
        parsed; a content holding control-token text ("<|im_start|>") is tokenized as text. A BOS
        is added unless the rendered prompt starts with ``bos_text``.

        Raises:
            InvalidRequest: as ``render``; or a content holds control-token text and the template
                rewrites contents, so where that content lies in the prompt cannot be known.
        """
        msgs = validate_messages(messages)
        if self._template is None:
            text = "\n\n".join(m["content"] for m in msgs)
            return vocab.tokenize(text, add_special=not (bos_text and text.startswith(bos_text)))
        text = self._render(msgs, True)
        add_special = not (bos_text and text.startswith(bos_text))
        nonce = secrets.token_hex(8)
        sentinels = [f"\ue000{nonce}:{i}\ue001" for i in range(len(msgs))]
        shape = self._render([{**m, "content": s} for m, s in zip(msgs, sentinels)], True)
        pieces = _split(shape, sentinels)  # template text at even indices, content numbers at odd
        exact = "".join(p if k % 2 == 0 else msgs[p]["content"] for k, p in enumerate(pieces)) == text

        def control(ids: list[int]) -> list[int]:
            return [t for t in ids if vocab.token_piece(t) == b""]

        # One check over all contents (a tokenizer call costs ~0.3 ms on Qwen2.5 here).
        if not _control_text(vocab, "\n".join(m["content"] for m in msgs)):
            ids = vocab.tokenize(text, add_special=add_special, parse_special=True)
            # Every control token must be the template's own: none formed across a content's edge.
            if control(ids) == control(vocab.tokenize(shape, add_special=False, parse_special=True)):
                return ids
        if not exact:
            found = next(((i, t) for i, m in enumerate(msgs) if (t := _control_text(vocab, m["content"]))), None)
            what = (f"message {found[0]}: its content holds control-token text ({found[1]})" if found
                    else "the prompt's control tokens are not all the template's own")
            raise InvalidRequest(f"{what}, and this model's chat template rewrites contents, "
                                 "so contents cannot be kept apart as text")
        ids = []
        for k, p in enumerate(pieces):
            if k % 2 == 0:
                ids += vocab.tokenize(p, add_special=add_special and k == 0, parse_special=True)
            else:
                ids += vocab.tokenize(msgs[p]["content"], add_special=False, parse_special=False)
        return ids


def _split(shape: str, sentinels: list[str]) -> list:
    """Rendered text -> [text, content index, text, ..., text] at the sentinels."""
    index = {s: i for i, s in enumerate(sentinels)}
    parts = re.split("(" + "|".join(map(re.escape, sentinels)) + ")", shape)
    return [p if k % 2 == 0 else index[p] for k, p in enumerate(parts)]


def _control_text(vocab: Vocab, content: str) -> str:
    """The first control token's text that parsing special tokens would find in content, or ""."""
    parsed = vocab.tokenize(content, add_special=False, parse_special=True)
    if parsed == vocab.tokenize(content, add_special=False, parse_special=False):
        return ""
    return next((vocab.token_text(t) for t in parsed if vocab.token_piece(t) == b""), "?")
