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
``--api-key`` is checked as a Bearer token on ``/v1/*``, a POST must be application/json (415),
bodies over 1 MiB get 413 and bodies that do not arrive in time 408. A client's fault is
answered, never logged above INFO, and no log line above DEBUG quotes a request.

Modules: ``config`` (ServerConfig, ServerState), ``guards`` (Host check, API key, body cap),
``parsing`` (request bodies), ``shaping`` (response bodies), ``streaming`` (generation thread
and server-sent events), ``routes`` (handlers), ``metrics`` (/metrics); this one builds the app
and runs it.
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette

from edgespec.engine import Engine
from edgespec.server.api_errors import EXCEPTION_HANDLERS
from edgespec.server.config import ServerConfig, ServerState, model_names
from edgespec.server.guards import GuardMiddleware
from edgespec.server.metrics import Metrics
from edgespec.server.routes import Routes

log = logging.getLogger(__name__)

# What cli/serve.py and the tests import from here.
__all__ = ["Metrics", "ServerConfig", "ServerState", "bind_socket", "create_app",
           "engine_memory_bytes", "model_names", "serve"]

_UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Open connections get this long to finish once generations are cancelled; a stream ends
# within one decode step, so only a client that stopped reading is left to be dropped.
SHUTDOWN_GRACE_S = 2.0
# On shutdown: how long to wait for a model load under way, then for the running step to stop.
LOAD_JOIN_S = 10.0
CLOSE_WAIT_S = 5.0


def create_app(state: ServerState) -> GuardMiddleware:
    """The ASGI application over ``state`` (whose engine may still be loading)."""
    app = Starlette(routes=Routes(state).table(), exception_handlers=EXCEPTION_HANDLERS)
    return GuardMiddleware(app, state)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port). Raises OSError."""
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


class _Server(uvicorn.Server):
    """uvicorn's server, cancelling every generation as soon as a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.edgespec_state = state  # a name of its own: uvicorn.Server keeps its own state attributes

    def handle_exit(self, sig, frame) -> None:  # noqa: D401 - uvicorn's signal hook
        if self.edgespec_state.engine is not None:
            self.edgespec_state.engine.cancel_all()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        """Before uvicorn waits for open connections: bodies still arriving get 503, requests
        tokenized meanwhile are refused, and every queued or running generation is cancelled
        (a stream then ends with finish_reason "cancelled" and [DONE])."""
        state = self.edgespec_state
        state.stopping.set()
        if state.engine is not None:
            state.engine.cancel_all()
        await super().shutdown(sockets)


def serve(state: ServerState, factory: Callable[[], Engine], sock, on_ready: Callable[[], None] | None = None,
          shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serves on ``sock`` until SIGINT/SIGTERM, loading the engine in the background.

    /health answers 503 until ``factory`` returns. If loading fails the server stops and the
    error is re-raised here. On shutdown running and queued generations are cancelled, open
    connections get ``shutdown_grace_s`` to finish (then uvicorn drops them), and the engine is
    closed; each wait is bounded, so a signal ends the server within seconds.
    """
    level = logging.getLevelName(log.getEffectiveLevel()).lower()
    config = uvicorn.Config(create_app(state), log_level=level if level in _UVICORN_LEVELS else "warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=shutdown_grace_s,
                            server_header=False)
    server = _Server(config, state)

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
        loader.join(timeout=LOAD_JOIN_S)
        if loader.is_alive():
            log.warning("the model is still loading; exiting without waiting for it")
        elif state.engine is not None:
            state.engine.close(timeout=CLOSE_WAIT_S)
    if state.load_error is not None:
        raise state.load_error


def _quiet_sigterm():
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda *_: None)


def _restore_sigterm(previous) -> None:
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
