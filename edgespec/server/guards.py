"""The server's guards: the Host check (DNS rebinding), the API key, the JSON content type, and
the request body's size, time and well-formedness."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from starlette.requests import Request

from edgespec.server.api_errors import CLIENT_GONE, ApiError, bad_request
from edgespec.server.config import ServerState

log = logging.getLogger(__name__)


class GuardMiddleware:
    """Counts every response for /metrics, refuses Host headers that do not name us, and keeps
    failures to one log line each.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, so streaming responses pass untouched.
    """

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        started = complete = False

        async def counting_send(message):
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
                self.state.metrics.http_response(path, message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        host = _host_header(scope)
        if not self.state.config.host_allowed(host):
            err = ApiError(400, f"Host header {host!r} does not name this server; it answers only "
                                f"to its bound address and loopback names (see --allow-host)",
                           code="invalid_host")
            return await err.response()(scope, receive, counting_send)
        try:
            await self.app(scope, receive, counting_send)
        except Exception:  # noqa: BLE001 - logged in one line and answered 500 by internal_error_handler
            if started and not complete:  # a stream broke: end it rather than leave it open
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.state.stopping.is_set():
                raise
            # uvicorn cancels what is still open when its shutdown grace ends (a client that
            # stopped reading); re-raised, that would log a traceback per connection.
            log.info("%s %s: cancelled at shutdown", scope.get("method"), path)


def _host_header(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"host":
            return value.decode("latin-1")
    return None


def check_key(request: Request, state: ServerState) -> None:
    """Raises a 401 unless the request carries the server's API key as a Bearer token."""
    key = state.config.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def check_json_type(request: Request) -> None:
    """Raises a 415 unless the body is declared application/json. A browser sends text/plain,
    form and multipart bodies cross-origin without asking first (CORS "simple requests");
    application/json needs a preflight, which this server never grants."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {media or 'none'!r}",
                       code="unsupported_media_type")


async def read_json(request: Request, state: ServerState) -> dict:
    """The body as a JSON object.

    Raises ApiError: 413 over the size limit (declared or streamed), 408 when the body does not
    arrive in time, 499 when the client hangs up first, 503 when the server starts shutting down
    meanwhile, 400 when it is not JSON, nests too deeply or holds a lone surrogate.
    """
    raw = await _read_body(request, state)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request("the body is nested too deeply", code="invalid_json") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    try:  # lone surrogates ("\udcff") are valid JSON escapes but not text: nothing can tokenize them
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the body holds a lone UTF-16 surrogate (such as \\udcff); strings must be "
                          "valid Unicode", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the body is nested too deeply", code="invalid_json") from None
    return body


async def _read_body(request: Request, state: ServerState) -> bytes:
    limit, timeout = state.config.max_body_bytes, state.config.body_timeout_s
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if too_big:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
    deadline = asyncio.get_running_loop().time() + timeout
    chunks, size = [], 0
    while True:
        message = await _receive(request, state, deadline)
        if message["type"] == "http.disconnect":
            log.info("%s %s: the client went away after %d bytes of its body", request.method,
                     request.url.path, size)
            raise ApiError(CLIENT_GONE, "the client went away", code="client_closed_request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _receive(request: Request, state: ServerState, deadline: float) -> dict:
    """The next ASGI message of the body, unless the deadline passes or the server stops first."""
    loop = asyncio.get_running_loop()
    message = asyncio.ensure_future(request.receive())
    stop = asyncio.ensure_future(state.stopping.wait())
    try:
        await asyncio.wait({message, stop}, timeout=max(0.0, deadline - loop.time()),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not message.done():
            message.cancel()  # uvicorn keeps the bytes it has; nothing is lost
    if message.done() and not message.cancelled():
        return message.result()
    if state.stopping.is_set():
        raise ApiError(503, "the server is shutting down", type_="server_error", code="shutting_down",
                       headers={"Connection": "close"})
    log.info("%s %s: the body did not arrive within %g s", request.method, request.url.path,
             state.config.body_timeout_s)
    raise ApiError(408, f"the request body did not arrive within {state.config.body_timeout_s:g} s",
                   code="request_timeout", headers={"Connection": "close"})
