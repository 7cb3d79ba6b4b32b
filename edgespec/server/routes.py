"""The request handlers: health, metrics, models, and the two completion endpoints."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from edgespec.decode.events import DoneEvent
from edgespec.engine import Engine
from edgespec.errors import EdgespecError, InvalidRequest, QueueFull
from edgespec.server.api_errors import ApiError, bad_request, error_for
from edgespec.server.config import ServerState
from edgespec.server.guards import check_json_type, check_key, read_json
from edgespec.server.parsing import parse_messages, parse_options, parse_prompt
from edgespec.server.shaping import completion_body, model_card
from edgespec.server.streaming import EventStream, Generation, stream_chunks, watch_disconnect


class Routes:
    """The handlers over one ServerState, whose engine may still be loading."""

    def __init__(self, state: ServerState):
        self.state = state

    def table(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    async def health(self, request: Request) -> Response:
        state = self.state
        if state.engine is not None:
            return JSONResponse({"status": "ok", "model": state.config.model_id})
        if state.load_error is not None:
            return JSONResponse({"status": "error", "error": str(state.load_error)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})

    async def metrics(self, request: Request) -> Response:
        text = self.state.metrics.render(self.state.engine, self.state.config.model_id)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        check_key(request, self.state)
        return JSONResponse({"object": "list", "data": [model_card(self.state)]})

    async def model(self, request: Request) -> Response:
        check_key(request, self.state)
        name = request.path_params["name"]
        if not self.state.config.serves(name):
            raise ApiError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card(self.state))

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        """Validates, tokenizes in a worker thread, queues, then streams or answers whole."""
        state = self.state
        check_key(request, state)
        check_json_type(request)
        body = await read_json(request, state)
        engine = _engine(state)
        parsed = parse_options(body, state.config, engine.ctx.n_ctx)
        tokens = await _prompt_tokens(engine, body, chat)
        if state.stopping.is_set():  # tokenized while shutdown cancelled the queue
            raise _shutting_down()
        cancel = threading.Event()
        try:
            job = engine.submit(tokens, parsed.request, cancel)
        except QueueFull as exc:
            state.metrics.rejected_request("queue_full")
            raise ApiError(503, str(exc), type_="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except InvalidRequest:  # the engine is closing
            raise _shutting_down() from None
        gen = Generation(state, "chat" if chat else "completions", job, cancel)
        gen.start()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if parsed.stream:
            chunks = stream_chunks(gen, chat, ident, created, state.config.model_id, parsed.include_usage)
            return EventStream(chunks, cancel)
        return await self._whole(request, gen, chat, ident, created)

    async def _whole(self, request: Request, gen: Generation, chat: bool, ident: str, created: int) -> Response:
        """Waits for the whole answer; a client that goes away meanwhile cancels the generation."""
        watcher = asyncio.create_task(watch_disconnect(request.receive, gen.cancel))
        done = None
        try:
            async for ev in gen:
                if isinstance(ev, DoneEvent):
                    done = ev
        except EdgespecError as exc:
            raise error_for(exc) from None
        finally:
            watcher.cancel()
            gen.cancel.set()  # no-op once done; stops the generation if this task is cancelled
        assert done is not None
        return JSONResponse(completion_body(done, chat, ident, created, self.state.config.model_id))


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type_="server_error", code="shutting_down",
                    headers={"Connection": "close"})


def _engine(state: ServerState) -> Engine:
    """The loaded engine, or a 503 (with Retry-After) while it loads or after it failed to."""
    if state.engine is None:
        message = ("the model failed to load" if state.load_error is not None
                   else "the model is still loading; retry shortly")
        raise ApiError(503, message, type_="server_error", code="model_loading",
                       headers={"Retry-After": "1"})
    return state.engine


async def _prompt_tokens(engine: Engine, body: dict, chat: bool) -> list[int]:
    """The prompt's tokens (tokenized in a worker thread); 400 if it does not fit the context."""
    if chat:
        messages = parse_messages(body)
        prompt_fn = lambda: engine.chat_tokens(messages)  # noqa: E731
    else:
        prompt = parse_prompt(body)
        prompt_fn = lambda: engine._prompt_tokens(prompt)  # noqa: E731
    try:
        tokens = await asyncio.to_thread(prompt_fn)
    except InvalidRequest as exc:
        raise bad_request(str(exc), param="messages" if chat else "prompt") from None
    if len(tokens) >= engine.ctx.n_ctx:
        raise bad_request(f"the prompt has {len(tokens)} tokens; the context holds {engine.ctx.n_ctx}",
                          param="messages" if chat else "prompt", code="context_length_exceeded")
    return tokens
