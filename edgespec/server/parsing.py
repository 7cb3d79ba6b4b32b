"""OpenAI request bodies read into a GenerationRequest, each bad field a 400 naming it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.errors import InvalidRequest
from edgespec.server.api_errors import ApiError, bad_request
from edgespec.server.config import ServerConfig

# Sampler defaults when a request leaves a field out: the CLI's (llama.cpp's) defaults.
DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
MAX_STOP_STRINGS = 16


@dataclass
class Parsed:
    """A request's generation settings and how to answer it."""

    request: GenerationRequest
    stream: bool
    include_usage: bool


def parse_options(body: dict, config: ServerConfig, n_ctx: int) -> Parsed:
    """Everything of a completion body but its prompt or messages (checked in this order)."""
    _check_model(body, config)
    _unsupported(body)
    max_tokens = _integer(body, "max_tokens", 1, None, None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 1, None, None)
    sampling = _sampling(body)
    stop = _stop_strings(body)
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    try:
        request = GenerationRequest(max_tokens=max_tokens or n_ctx, stop=tuple(stop), sampling=sampling,
                                    ignore_eos=_boolean(body, "ignore_eos"))
    except InvalidRequest as exc:
        raise bad_request(str(exc)) from None
    return Parsed(request, stream, include_usage)


def _check_model(body: dict, config: ServerConfig) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request("model must be a string", param="model")
    if not config.serves(model):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{config.model_id!r}", param="model", code="model_not_found")


def _unsupported(body: dict) -> None:
    """Fields we cannot honour: refused rather than silently ignored."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported (use repeat_penalty)", param=name)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported", param="logprobs")
    if body.get("tools") or body.get("functions"):
        raise bad_request("tools / function calling are not supported", param="tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in (None, "text")):
        raise bad_request("only response_format {\"type\": \"text\"} is supported", param="response_format")


def _sampling(body: dict) -> SamplingParams:
    d = DEFAULT_SAMPLING
    seed = _integer(body, "seed", -1, 2**63 - 1, None)
    temperature = _number(body, "temperature", 0.0, 2.0, d.temperature)
    return SamplingParams(
        temperature=temperature,
        top_k=_integer(body, "top_k", 0, None, d.top_k),
        top_p=_number(body, "top_p", 0.0, 1.0, d.top_p, lo_open=True),
        min_p=_number(body, "min_p", 0.0, 0.999999, d.min_p),
        repeat_penalty=_number(body, "repeat_penalty", 0.0, 10.0, d.repeat_penalty, lo_open=True),
        seed=None if seed in (None, -1) else seed)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return stop


def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request(f"{name} must be in {bound}, got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int | None, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", param=name)
    if value < lo or (hi is not None and value > hi):
        raise bad_request(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}",
                          param=name)
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false", param=name)
    return value


def parse_messages(body: dict) -> list[dict]:
    """A chat body's messages as {role, content} strings; "developer" is read as "system"."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param="messages")
        role, content = m.get("role"), m.get("content")
        if role == "developer":
            role = "system"
        if isinstance(content, list):  # content parts: only text is understood
            content = _text_parts(content, i)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise bad_request(f"messages[{i}] needs a string role and string content", param="messages")
        out.append({"role": role, "content": content})
    return out


def _text_parts(content: list, i: int) -> str:
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{i}]: only text content parts are supported", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def parse_prompt(body: dict) -> str | list[int]:
    """A completion body's one prompt: a string or a list of token ids (a batch of one is unwrapped)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad_request("prompt must be a non-empty string or list of token ids (one prompt per request)",
                      param="prompt")
