"""Errors answered in OpenAI's shape, and the handlers that turn exceptions into them."""
from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgespec.errors import EdgespecError, InvalidRequest, QueueFull

log = logging.getLogger(__name__)


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


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s: %r", request.url.path, exc)
    return ApiError(500, f"internal error: {exc}", type_="server_error").response()


# Passed to Starlette as its exception_handlers.
EXCEPTION_HANDLERS = {ApiError: api_error_handler, HTTPException: http_error_handler,
                      Exception: internal_error_handler}
