"""The server's guards: the Host check (DNS rebinding), the API key and the body size cap."""
from __future__ import annotations

import hmac
import json

from starlette.requests import Request

from edgespec.server.api_errors import ApiError, bad_request
from edgespec.server.config import ServerState


class GuardMiddleware:
    """Counts every response for /metrics and refuses Host headers that do not name us.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, so streaming responses pass untouched.
    """

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

        host = _host_header(scope)
        if not self.state.config.host_allowed(host):
            err = ApiError(400, f"Host header {host!r} does not name this server; it answers only "
                                f"to its bound address and loopback names (see --allow-host)",
                           code="invalid_host")
            return await err.response()(scope, receive, counting_send)
        return await self.app(scope, receive, counting_send)


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


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 over ``limit`` bytes (declared or streamed), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
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
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return body
