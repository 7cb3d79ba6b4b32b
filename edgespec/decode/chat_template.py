"""Chat templates from GGUF metadata, rendered in a sandboxed Jinja2 environment.

Templates come from model files, which may come from anywhere: the sandbox forbids attribute
access to Python internals, and rendering errors become typed exceptions.
"""
from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgespec.errors import InvalidRequest

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks / lstrip_blocks match how Hugging Face renders these templates, which is
    # what their authors test against.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.Undefined)
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


class ChatTemplate:
    """A compiled chat template plus the special-token texts it refers to."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self._bos, self._eos = bos_token, eos_token
        self._template = None
        if source:
            try:
                self._template = _environment().from_string(source)
            except jinja2.exceptions.TemplateError as exc:
                log.warning("chat template does not compile (%s); using plain prompts", exc)

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[Message | dict], add_generation_prompt: bool = True) -> str:
        """Renders a conversation to the prompt text the model was trained on.

        Without a usable template, falls back to the messages' contents joined by blank lines,
        which is what a base model expects.

        Raises:
            InvalidRequest: bad messages, or the template itself rejects them.
        """
        msgs = validate_messages(messages)
        if self._template is None:
            return "\n\n".join(m["content"] for m in msgs)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos, eos_token=self._eos)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc
