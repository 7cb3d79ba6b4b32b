"""The bridge from a generation thread to the event loop, and server-sent events over it.

A dedicated thread drives each generation and hands its events to the loop through an asyncio
queue, so the loop never blocks on llama.cpp; a client that goes away sets the cancel event.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.responses import Response

from edgespec.decode.events import DoneEvent, TokenEvent
from edgespec.errors import EdgespecError
from edgespec.server.api_errors import ApiError, error_for, log_internal
from edgespec.server.config import ServerState
from edgespec.server.shaping import chunk_base, edgespec_stats, stream_chunk, usage

log = logging.getLogger(__name__)

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Generation:
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


async def watch_disconnect(receive, cancel: threading.Event) -> None:
    """Sets ``cancel`` when the client goes away (the request body has been read already); a
    client that leaves before its answer is complete is one INFO line."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not cancel.is_set():  # set already once the answer is complete
                log.info("the client went away before its answer was complete; generation cancelled")
            cancel.set()
            return


class EventStream(Response):
    """A text/event-stream response that cancels its generation when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], cancel: threading.Event):
        self.chunks, self.cancel = chunks, cancel
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(watch_disconnect(receive, self.cancel))
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


async def stream_chunks(gen: Generation, chat: bool, ident: str, created: int, model_id: str,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """The generation as server-sent events: chunks, the final one with stats, then [DONE]."""
    base = chunk_base(chat, ident, created, model_id)
    try:
        if chat:
            yield sse(stream_chunk(base, chat, None, None, first=True))
        async for ev in gen:
            if isinstance(ev, TokenEvent):
                if ev.text:
                    yield sse(stream_chunk(base, chat, ev.text, None))
            else:
                yield sse(stream_chunk(base, chat, None, ev.finish_reason, usage=usage(ev),
                                       edgespec=edgespec_stats(ev)))
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(ev)})
    except Exception as exc:  # the status line is sent already: report in the stream
        if isinstance(exc, EdgespecError):
            err = error_for(exc)
            log.info("generation refused mid-stream: %s", type(exc).__name__)
        else:
            err = ApiError(500, f"internal error ({type(exc).__name__})", type_="server_error")
            log_internal("generation failed mid-stream", exc)
        yield sse(err.body())
    finally:
        gen.cancel.set()
    yield sse("[DONE]")


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <compact JSON or text>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
