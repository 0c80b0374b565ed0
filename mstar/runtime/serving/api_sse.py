"""Streamed responses: a job's chunks as server-sent events, ending with `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from mstar.runtime.serving.api_jobs import Job
from mstar.runtime.serving.api_protocol import APIError

logger = logging.getLogger("mstar.server")

SSE_DONE = "data: [DONE]\n\n"

# Event data is ASCII-only JSON: a raw U+2028 / U+2029 / U+0085 in a `data:` line ends the line
# for line-based SSE readers (they split on Unicode line breaks), so every non-ASCII character
# travels as a \u escape. NaN and infinities are refused (they are not JSON). One encoder built
# once (json.dumps builds a new one per call with these options).
_ENCODE = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode
_NO_USAGE = object()


def sse_event(obj: Any) -> str:
    return f"data: {_ENCODE(obj)}\n\n"


class ChunkEvents:
    """The SSE events of one streamed response whose chunks are `base` (id, object, created,
    model) plus "choices" (and "usage"): the constant head is encoded once, each chunk encodes
    only its choice. The text is what sse_event(dict(base, choices=[choice], usage=...)) gives."""

    __slots__ = ("head",)

    def __init__(self, base: dict):
        self.head = "data: " + _ENCODE(base)[:-1] + ',"choices":['

    def event(self, choice: dict, usage: Any = _NO_USAGE) -> str:
        if usage is _NO_USAGE:
            return f"{self.head}{_ENCODE(choice)}]}}\n\n"
        if usage is None:
            return f"{self.head}{_ENCODE(choice)}],\"usage\":null}}\n\n"
        return f"{self.head}{_ENCODE(choice)}],\"usage\":{_ENCODE(usage)}}}\n\n"


# The ASGI `send` of the server itself, put in the scope by the app (api_server.build_app): a
# stream's body chunks skip the middleware wrappers around `send` (starlette's error and
# exception layers, which only watch for the response start; the start and the end still go
# through them). Without the key every message takes the ordinary `send`.
RAW_SEND = "mstar.raw_send"


def _body(ev: str) -> dict:
    return {"type": "http.response.body", "body": ev.encode("utf-8"), "more_body": True}


async def pump_until_disconnect(pump, receive, chunks, on_close=None) -> asyncio.Task:
    """Run `pump` (the coroutine that sends a streamed body) until it ends or the client
    disconnects, whichever comes first; then cancel the other, close the `chunks` iterator (its
    `finally` runs: the request is aborted in the engine) and call on_close (the iterator may
    never have started, so no `finally` of its ran). Returns the pump's task, done."""
    async def listen():
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return

    pump_t = asyncio.ensure_future(pump)
    listen_t = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({pump_t, listen_t}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (pump_t, listen_t):
            if not t.done():
                t.cancel()
        await asyncio.gather(pump_t, listen_t, return_exceptions=True)
        with contextlib.suppress(Exception):
            await chunks.aclose()
        if on_close is not None:
            on_close()
    return pump_t


class SSEResponse(StreamingResponse):
    """Server-sent events from an async iterator of strings.

    With a `job` (stream_job) the stream always ends with [DONE], an APIError from the
    iterator becomes an error event, and the job is closed with its outcome (success, error,
    bad_request, aborted) as soon as the iterator ends.

    A client that goes away cancels the iterator at its current await (its `finally`
    aborts the request in the engine), whatever the ASGI server's spec version."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close=None, job: Job | None = None):
        super().__init__(events, status_code=200, headers={"Cache-Control": "no-cache",
                                                           "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        body_send = scope.get(RAW_SEND) or send
        job = self.job

        async def pump():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if job is None:
                async for ev in self.events:
                    await body_send(_body(ev))
            else:
                outcome = "error"
                try:
                    try:
                        async for ev in self.events:
                            await body_send(_body(ev))
                        outcome = "success"
                        tail = SSE_DONE
                    except APIError as e:
                        outcome = "error" if e.status >= 500 else "bad_request"
                        tail = sse_event(e.body()) + SSE_DONE
                    except Exception as e:  # a bug while building a chunk: the client still gets an ending
                        logger.exception("stream failed")
                        tail = sse_event(APIError(500, f"Internal server error: {type(e).__name__}",
                                                  code="internal_error").body()) + SSE_DONE
                    job.close(outcome)
                    await body_send(_body(tail))
                except asyncio.CancelledError:
                    outcome = "aborted"
                    raise
                finally:
                    job.close(outcome)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_t = await pump_until_disconnect(pump(), receive, self.events, self.on_close)
        if pump_t.done() and not pump_t.cancelled() and pump_t.exception() is not None:
            exc = pump_t.exception()
            if not isinstance(exc, OSError):
                logger.error("stream failed", exc_info=exc)


def stream_job(job: Job, chunks: AsyncIterator[str]) -> SSEResponse:
    """SSE response over `chunks` (an async iterator of events): always ends with [DONE],
    an engine error becomes an error event, and the job is closed with its outcome."""
    return SSEResponse(chunks, on_close=lambda: job.close("aborted"), job=job)
