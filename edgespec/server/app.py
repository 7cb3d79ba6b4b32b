"""An OpenAI-compatible HTTP server over one Engine (starlette + uvicorn: the `server` extra).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent
events ending with ``data: [DONE]``, or one JSON object), ``GET /v1/models``, ``GET /health``
(503 while the model loads, 200 once it serves) and ``GET /metrics`` (Prometheus text).

How a request flows: the handler validates the JSON body (400 with an OpenAI-style error),
tokenizes the prompt in a worker thread, then takes a place in the engine's FIFO queue at once
(``Engine.submit``; a full queue is a 503). A dedicated thread drives the generation and hands
each event to the event loop through an asyncio queue, so the loop never blocks on llama.cpp.
A running generation is never interrupted by a newer request. When the client goes away (the
ASGI server reports ``http.disconnect``), the request's cancel event is set: a waiting request
leaves the queue, a running one stops after its current step, and the slot is free again.

Guards: the ``Host`` header must name the bound address or a loopback name (DNS rebinding),
``--api-key`` is checked as a Bearer token on ``/v1/*``, bodies over 1 MiB get 413.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from edgespec.engine import Engine
from edgespec.errors import EdgespecError, InvalidRequest, QueueFull
from edgespec.decode.events import DoneEvent, TokenEvent
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
# Sampler defaults when a request leaves a field out: the CLI's (llama.cpp's) defaults.
DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
MAX_STOP_STRINGS = 16
_KNOWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


# -- configuration and state ---------------------------------------------------------------------
@dataclass
class ServerConfig:
    """What the server serves and how it guards itself."""

    model_id: str
    model_aliases: frozenset[str] = frozenset()  # other names accepted in the "model" field
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # extra Host header names (besides the bound host)
    max_body_bytes: int = MAX_BODY_BYTES

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a Host header names this server (protects loopback servers from DNS rebinding)."""
        extra = {h.lower() for h in self.allowed_hosts}
        bound = _normal_host(self.host)
        if bound in WILDCARD_HOSTS and not extra:
            return True  # listening everywhere: any name may reach it (use --api-key)
        if not host_header:
            return False
        name = _host_name(host_header)
        return name in LOOPBACK_NAMES or name == bound or name in extra


def _normal_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _host_name(header: str) -> str:
    """The host part of a Host header, lower-cased: 'LocalHost:8080' -> 'localhost'."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[:end + 1] if end > 0 else header
    return header.split(":", 1)[0].rstrip(".")


class Metrics:
    """Counters behind /metrics; every update takes a lock (worker threads and the loop write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http: dict[tuple[str, str], int] = {}
        self.completions: dict[tuple[str, str], int] = {}
        self.rejected: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.generation_s = 0.0
        self.last_tokens_per_s = 0.0
        self.drafters: dict[str, dict[str, int]] = {}

    def http_response(self, path: str, status: int) -> None:
        key = (path if path in _KNOWN_PATHS else "other", str(status))
        with self._lock:
            self.http[key] = self.http.get(key, 0) + 1

    def rejected_request(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def generation(self, endpoint: str, done: DoneEvent) -> None:
        st = done.stats
        with self._lock:
            key = (endpoint, st.finish_reason or "unknown")
            self.completions[key] = self.completions.get(key, 0) + 1
            self.prompt_tokens += st.prompt_tokens
            self.generated_tokens += st.generated_tokens
            self.generation_s += st.gen_s
            if st.tokens_per_s > 0:
                self.last_tokens_per_s = st.tokens_per_s
            for name, d in (st.spec.by_drafter if st.spec else {}).items():
                tot = self.drafters.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
                for k in tot:
                    tot[k] += getattr(d, k)

    def render(self, engine: Engine | None, model_id: str) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
                out.append(f"{name}{{{lab}}} {_num(value)}" if lab else f"{name} {_num(value)}")

        with self._lock:
            metric("edgespec_model_loaded", "gauge", "1 once the model serves requests.",
                   [({"model": model_id}, 1 if engine is not None else 0)])
            metric("edgespec_http_requests_total", "counter", "HTTP responses by path and status code.",
                   [({"path": p, "code": c}, n) for (p, c), n in sorted(self.http.items())])
            metric("edgespec_requests_total", "counter",
                   "Generations that ended, by endpoint and finish reason.",
                   [({"endpoint": e, "finish_reason": r}, n) for (e, r), n in sorted(self.completions.items())])
            metric("edgespec_requests_rejected_total", "counter", "Requests refused before generating.",
                   [({"reason": r}, n) for r, n in sorted(self.rejected.items())])
            metric("edgespec_prompt_tokens_total", "counter", "Prompt tokens of ended generations.",
                   [({}, self.prompt_tokens)])
            metric("edgespec_generated_tokens_total", "counter", "Tokens generated.",
                   [({}, self.generated_tokens)])
            metric("edgespec_generation_seconds_total", "counter",
                   "Decoding time after each first token (rate of tokens: divide the token counter).",
                   [({}, self.generation_s)])
            avg = self.generated_tokens / self.generation_s if self.generation_s > 0 else 0.0
            metric("edgespec_tokens_per_second", "gauge", "Decoding speed of the last generation.",
                   [({}, self.last_tokens_per_s)])
            metric("edgespec_tokens_per_second_average", "gauge",
                   "Generated tokens over decoding time, since the start.", [({}, avg)])
            for key, help_ in (("drafted", "Draft tokens proposed, per drafter."),
                               ("accepted", "Draft tokens the target accepted, per drafter."),
                               ("steps", "Speculative verification steps, per drafter.")):
                name = "edgespec_speculation_steps_total" if key == "steps" else f"edgespec_{key}_tokens_total"
                metric(name, "counter", help_,
                       [({"drafter": d}, v[key]) for d, v in sorted(self.drafters.items())])
        queue = engine.queue if engine is not None else None
        metric("edgespec_queue_length", "gauge", "Requests waiting behind the running one.",
               [({}, queue.waiting if queue else 0)])
        metric("edgespec_requests_running", "gauge", "Generations running now (0 or 1).",
               [({}, 1 if queue and queue.busy else 0)])
        return "\n".join(out) + "\n"


def _escape_label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value)) if math.isfinite(value) else "NaN"


@dataclass
class ServerState:
    """The engine once loaded, or why it is not there yet."""

    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    load_error: BaseException | None = None
    started: float = field(default_factory=time.time)

    def load(self, factory: Callable[[], Engine]) -> None:
        """Builds the engine (call from a thread); on failure records the error and re-raises."""
        try:
            self.engine = factory()
        except BaseException as exc:
            self.load_error = exc
            raise


# -- errors --------------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered with OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = ApiError(404, f"unknown path {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                       code="method_not_allowed", headers=exc.headers)
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    return err.response()


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s: %r", request.url.path, exc)
    return ApiError(500, f"internal error: {exc}", type_="server_error").response()


# -- guards (plain ASGI middleware, safe for streaming responses) --------------------------------
class _GuardMiddleware:
    """Counts every response for /metrics and refuses Host headers that do not name us."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.state.metrics.http_response(path, message["status"])
            await send(message)

        host = None
        for name, value in scope.get("headers", ()):
            if name == b"host":
                host = value.decode("latin-1")
                break
        if not self.state.config.host_allowed(host):
            err = ApiError(400, f"Host header {host!r} does not name this server; it answers only "
                                f"to its bound address and loopback names (see --allow-host)",
                           code="invalid_host")
            return await err.response()(scope, receive, counting_send)
        return await self.app(scope, receive, counting_send)


def _check_key(request: Request, state: ServerState) -> None:
    key = state.config.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _engine(state: ServerState) -> Engine:
    if state.engine is None:
        message = ("the model failed to load" if state.load_error is not None
                   else "the model is still loading; retry shortly")
        raise ApiError(503, message, type_="server_error", code="model_loading",
                       headers={"Retry-After": "1"})
    return state.engine


async def _read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise _bad("invalid Content-Length header") from None
        if too_big:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", code="invalid_json")
    return body


# -- request fields ------------------------------------------------------------------------------
def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"{name} must be a number", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"{name} must be in {bound}, got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int | None, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer", param=name)
    if value < lo or (hi is not None and value > hi):
        raise _bad(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", param=name)
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false", param=name)
    return value


def _unsupported(body: dict) -> None:
    """Fields we cannot honour: refused rather than silently ignored."""
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v not in (None, 0, 0.0):
            raise _bad(f"{name} is not supported (use repeat_penalty)", param=name)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise _bad("logprobs are not supported", param="logprobs")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools / function calling are not supported", param="tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in (None, "text")):
        raise _bad("only response_format {\"type\": \"text\"} is supported", param="response_format")


@dataclass
class _Parsed:
    request: GenerationRequest
    stream: bool
    include_usage: bool


def _parse_options(body: dict, state: ServerState, n_ctx: int) -> _Parsed:
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _bad("model must be a string", param="model")
        cfg = state.config
        if model != cfg.model_id and model not in cfg.model_aliases:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{cfg.model_id!r}", param="model", code="model_not_found")
    _unsupported(body)
    max_tokens = _integer(body, "max_tokens", 1, None, None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 1, None, None)
    d = DEFAULT_SAMPLING
    seed = _integer(body, "seed", -1, 2**63 - 1, None)
    temperature = _number(body, "temperature", 0.0, 2.0, d.temperature)
    sampling = SamplingParams(
        temperature=temperature,
        top_k=_integer(body, "top_k", 0, None, d.top_k),
        top_p=_number(body, "top_p", 0.0, 1.0, d.top_p, lo_open=True),
        min_p=_number(body, "min_p", 0.0, 0.999999, d.min_p),
        repeat_penalty=_number(body, "repeat_penalty", 0.0, 10.0, d.repeat_penalty, lo_open=True),
        seed=None if seed in (None, -1) else seed)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    try:
        request = GenerationRequest(max_tokens=max_tokens or n_ctx, stop=tuple(stop), sampling=sampling,
                                    ignore_eos=_boolean(body, "ignore_eos"))
    except InvalidRequest as exc:
        raise _bad(str(exc)) from None
    return _Parsed(request, stream, include_usage)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", param="messages")
        role, content = m.get("role"), m.get("content")
        if role == "developer":
            role = "system"
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}]: only text content parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise _bad(f"messages[{i}] needs a string role and string content", param="messages")
        out.append({"role": role, "content": content})
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise _bad("prompt must be a non-empty string or list of token ids (one prompt per request)",
               param="prompt")


# -- the bridge between a generation thread and the event loop -----------------------------------
_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Generation:
    """One queued generation, driven by its own thread; events arrive on an asyncio queue."""

    def __init__(self, state: ServerState, endpoint: str, job: Iterator[TokenEvent | DoneEvent],
                 cancel: threading.Event):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = cancel
        self._state, self._endpoint, self._job = state, endpoint, job
        self._thread = threading.Thread(target=self._work, name="edgespec-generation", daemon=True)

    def start(self) -> None:
        try:
            self._thread.start()
        except BaseException:
            self._job.close()  # gives the queue place back
            raise

    def _work(self) -> None:
        try:
            for ev in self._job:
                if isinstance(ev, DoneEvent):
                    self._state.metrics.generation(self._endpoint, ev)
                self._post(ev)
        except BaseException as exc:  # reported to the handler, which answers with an error
            self._post(_Failure(exc))
        finally:
            self._job.close()
            self._post(_END)

    def _post(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            self.cancel.set()

    async def __aiter__(self) -> AsyncIterator[TokenEvent | DoneEvent]:
        while True:
            item = await self.events.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item


async def _watch_disconnect(receive, cancel: threading.Event) -> None:
    """Sets ``cancel`` when the client goes away (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


class _EventStream(Response):
    """A text/event-stream response that cancels its generation when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], cancel: threading.Event):
        self.chunks, self.cancel = chunks, cancel
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.cancel))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.chunks:  # ends soon after a disconnect cancels the generation
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            pass
        finally:
            self.cancel.set()  # no-op once the generation has ended
            watcher.cancel()
            await self.chunks.aclose()


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _usage(done: DoneEvent) -> dict:
    st = done.stats
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.generated_tokens,
            "total_tokens": st.prompt_tokens + st.generated_tokens}


def _edgespec_stats(done: DoneEvent) -> dict:
    st = done.stats
    spec = st.spec.to_dict() if st.spec is not None else {}
    return {
        "mode": spec.get("mode", "plain"),
        "steps": spec.get("steps", 0),
        "drafted": spec.get("drafted", 0),
        "accepted": spec.get("accepted", 0),
        "acceptance_rate": spec.get("acceptance_rate", 0.0),
        "mean_emitted": spec.get("mean_emitted", 0.0),
        "by_drafter": spec.get("by_drafter", {}),
        "tokens_per_s": st.tokens_per_s,
        "prompt_tokens_per_s": st.prompt_tokens_per_s,
        "reused_prompt_tokens": st.reused_prompt_tokens,
        "ttft_s": st.ttft_s,
        "peak_rss_bytes": st.peak_rss_bytes,
        "peak_anon_bytes": st.peak_anon_bytes,
        "process_peak_rss_bytes": st.process_peak_rss_bytes,
    }


# -- handlers ------------------------------------------------------------------------------------
def create_app(state: ServerState) -> Starlette:
    """The ASGI application over ``state`` (whose engine may still be loading)."""

    async def health(request: Request) -> Response:
        if state.engine is not None:
            return JSONResponse({"status": "ok", "model": state.config.model_id})
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": str(state.load_error)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})

    async def metrics(request: Request) -> Response:
        text = state.metrics.render(state.engine, state.config.model_id)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        _check_key(request, state)
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    async def model(request: Request) -> Response:
        _check_key(request, state)
        name = request.path_params["name"]
        cfg = state.config
        if name != cfg.model_id and name not in cfg.model_aliases:
            raise ApiError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(_model_card(state))

    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def _complete(request: Request, chat: bool) -> Response:
        _check_key(request, state)
        body = await _read_json(request, state.config.max_body_bytes)
        engine = _engine(state)
        parsed = _parse_options(body, state, engine.ctx.n_ctx)
        if chat:
            messages = _messages(body)
            prompt_fn = lambda: engine.chat_tokens(messages)  # noqa: E731
        else:
            prompt = _prompt(body)
            prompt_fn = lambda: engine._prompt_tokens(prompt)  # noqa: E731
        try:
            tokens = await asyncio.to_thread(prompt_fn)
        except InvalidRequest as exc:
            raise _bad(str(exc), param="messages" if chat else "prompt") from None
        if len(tokens) >= engine.ctx.n_ctx:
            raise _bad(f"the prompt has {len(tokens)} tokens; the context holds {engine.ctx.n_ctx}",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
        cancel = threading.Event()
        try:
            job = engine.submit(tokens, parsed.request, cancel)
        except QueueFull as exc:
            state.metrics.rejected_request("queue_full")
            raise ApiError(503, str(exc), type_="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except InvalidRequest as exc:  # the engine is closing
            raise ApiError(503, str(exc), type_="server_error", code="shutting_down") from None
        gen = _Generation(state, "chat" if chat else "completions", job, cancel)
        gen.start()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if parsed.stream:
            chunks = _stream_chunks(gen, chat, ident, created, parsed.include_usage)
            return _EventStream(chunks, cancel)
        return await _whole(request, gen, chat, ident, created)

    async def _whole(request: Request, gen: _Generation, chat: bool, ident: str, created: int) -> Response:
        watcher = asyncio.create_task(_watch_disconnect(request.receive, gen.cancel))
        done = None
        try:
            async for ev in gen:
                if isinstance(ev, DoneEvent):
                    done = ev
        except EdgespecError as exc:
            raise _error_for(exc) from None
        finally:
            watcher.cancel()
            gen.cancel.set()  # no-op once done; stops the generation if this task is cancelled
        assert done is not None
        finish = done.finish_reason
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish}
        return JSONResponse({
            "id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": state.config.model_id, "system_fingerprint": _fingerprint(),
            "choices": [choice], "usage": _usage(done), "edgespec": _edgespec_stats(done)})

    async def _stream_chunks(gen: _Generation, chat: bool, ident: str, created: int,
                             include_usage: bool) -> AsyncIterator[bytes]:
        base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": state.config.model_id, "system_fingerprint": _fingerprint()}

        def chunk(text: str | None, finish: str | None, first: bool = False, **extra) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice], **extra}

        try:
            if chat:
                yield _sse(chunk(None, None, first=True))
            async for ev in gen:
                if isinstance(ev, TokenEvent):
                    if ev.text:
                        yield _sse(chunk(ev.text, None))
                else:
                    yield _sse(chunk(None, ev.finish_reason, usage=_usage(ev),
                                     edgespec=_edgespec_stats(ev)))
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(ev)})
        except Exception as exc:  # the status line is sent already: report in the stream
            err = _error_for(exc) if isinstance(exc, EdgespecError) else ApiError(
                500, f"internal error: {exc}", type_="server_error")
            log.error("generation failed mid-stream: %r", exc)
            yield _sse(err.body())
        finally:
            gen.cancel.set()
        yield _sse("[DONE]")

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={ApiError: _api_error_handler, HTTPException: _http_error_handler,
                            Exception: _internal_error_handler})
    return _GuardMiddleware(app, state)


def _error_for(exc: EdgespecError) -> ApiError:
    if isinstance(exc, InvalidRequest):
        return _bad(str(exc))
    if isinstance(exc, QueueFull):
        return ApiError(503, str(exc), type_="server_error", code="queue_full")
    return ApiError(500, str(exc), type_="server_error")


def _model_card(state: ServerState) -> dict:
    return {"id": state.config.model_id, "object": "model", "created": int(state.started),
            "owned_by": "edgespec"}


def _fingerprint() -> str:
    from edgespec import __version__

    return f"edgespec-{__version__}"


def model_names(model_arg: str, path: str | Path) -> tuple[str, frozenset[str]]:
    """The id a served model goes by, and the other names a request may use for it.

    A store name is its own id; a path is known by its file stem. The name as given on the
    command line, the resolved path and the file name are accepted too.
    """
    path = Path(path)
    arg_is_path = Path(model_arg).suffix == ".gguf" or "/" in model_arg or "\\" in model_arg
    model_id = path.stem if arg_is_path else model_arg
    aliases = {model_arg, str(path), path.name, path.stem, str(path.resolve())} - {model_id}
    return model_id, frozenset(aliases)


# -- running it ----------------------------------------------------------------------------------
def bind_socket(host: str, port: int):
    """A listening TCP socket on host:port (port 0: any free port). Raises OSError."""
    import socket

    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(128)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def serve(state: ServerState, factory: Callable[[], Engine], sock, on_ready: Callable[[], None] | None = None,
          shutdown_grace_s: float = 5.0) -> None:
    """Serves on ``sock`` until SIGINT/SIGTERM, loading the engine in the background.

    /health answers 503 until ``factory`` returns. If loading fails the server stops and the
    error is re-raised here. On shutdown running and queued generations are cancelled and the
    engine is closed.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # noqa: D401 - uvicorn's signal hook
            if state.engine is not None:
                state.engine.cancel_all()
            super().handle_exit(sig, frame)

    level = logging.getLevelName(log.getEffectiveLevel()).lower()
    config = uvicorn.Config(create_app(state), log_level=level if level in _UVICORN_LEVELS else "warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=shutdown_grace_s,
                            server_header=False)
    server = _Server(config)

    def load() -> None:
        try:
            state.load(factory)
        except BaseException:
            server.should_exit = True
            return
        if on_ready is not None:
            on_ready()

    loader = threading.Thread(target=load, name="edgespec-load", daemon=True)
    loader.start()
    # uvicorn re-raises the signal that stopped it once it is down; for SIGTERM that would kill
    # the process before the engine is closed, so SIGTERM's handler is a no-op meanwhile.
    previous = _quiet_sigterm()
    try:
        server.run(sockets=[sock])
    finally:
        _restore_sigterm(previous)
        if state.engine is not None:
            state.engine.cancel_all()
        loader.join(timeout=300)
        if state.engine is not None:
            state.engine.close()
    if state.load_error is not None:
        raise state.load_error


_UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _quiet_sigterm():
    import signal

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda *_: None)


def _restore_sigterm(previous) -> None:
    import signal

    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def engine_memory_bytes(engine: Engine) -> int:
    """Weights plus KV cache of the target and, when it has one, of the drafter model."""
    need = engine.model.weights_bytes + engine.ctx.memory_report()["kv_cache"]
    drafter = engine.drafter
    for part in (drafter, getattr(drafter, "model", None)):  # model, or hybrid's model drafter
        model, ctx = getattr(part, "model", None), getattr(part, "ctx", None)
        if model is not None and model is not engine.model and hasattr(model, "weights_bytes"):
            need += model.weights_bytes
            if ctx is not None and hasattr(ctx, "kv_bytes"):
                need += ctx.kv_bytes()
    return need
