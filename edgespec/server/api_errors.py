"""Errors answered in OpenAI's shape, and the handlers that turn exceptions into them."""
from __future__ import annotations

import json
import logging
import traceback

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgespec.errors import EdgespecError, InvalidRequest, QueueFull

log = logging.getLogger(__name__)

# What the metrics and the log call a request whose client hung up before it could be
# answered (nginx's code); the client never sees it.
CLIENT_GONE = 499


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
        return _AsciiJSON(self.body(), status_code=self.status, headers=self.headers)


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: a message quoting client text cannot fail to encode
    (a lone surrogate has no UTF-8 form)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


def error_for(exc: EdgespecError) -> ApiError:
    """The answer to a library error raised while generating."""
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc))
    if isinstance(exc, QueueFull):
        return ApiError(503, str(exc), type_="server_error", code="queue_full")
    return ApiError(500, str(exc), type_="server_error")


def where(exc: BaseException) -> str:
    """``TypeName at file.py:line`` of the innermost frame: locates a bug without quoting the
    exception's message, which may hold prompt text."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    return f"{type(exc).__name__} at {last.filename.rsplit('/', 1)[-1]}:{last.lineno}"


def log_internal(what: str, exc: BaseException) -> None:
    """One ERROR line without request content; the traceback (which may quote it) at DEBUG."""
    log.error("%s: %s", what, where(exc))
    log.debug("%s", what, exc_info=exc)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 (and any other HTTPException), in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = ApiError(404, f"unknown path {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                       code="method_not_allowed", headers=exc.headers)
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    return err.response()


async def invalid_request_handler(request: Request, exc: Exception) -> Response:
    """The library's verdict on a request's input (a lone surrogate, a template it cannot
    render), wherever a handler did not map it itself: 400, not 500."""
    return bad_request(str(exc)).response()


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """A 500 for a bug of ours. Starlette re-raises the exception afterwards; GuardMiddleware
    drops it so that uvicorn does not log a second, full traceback."""
    log_internal(f"internal error on {request.method} {request.url.path}", exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); the server's log has its place",
                    type_="server_error").response()


# Passed to Starlette as its exception_handlers.
EXCEPTION_HANDLERS = {ApiError: api_error_handler, HTTPException: http_error_handler,
                      InvalidRequest: invalid_request_handler, Exception: internal_error_handler}
