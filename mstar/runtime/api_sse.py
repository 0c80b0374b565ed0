"""Streamed responses: a job's chunks as server-sent events, ending with `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from mstar.runtime.api_jobs import Job
from mstar.runtime.api_protocol import APIError

logger = logging.getLogger("mstar.server")

SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events from an async iterator of strings.

    A client that goes away cancels the iterator at its current await (its `finally`
    aborts the request in the engine), whatever the ASGI server's spec version."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close=None):
        super().__init__(events, status_code=200, headers={"Cache-Control": "no-cache",
                                                           "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for ev in self.events:
                await send({"type": "http.response.body", "body": ev.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        pump_t = asyncio.ensure_future(pump())
        listen_t = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({pump_t, listen_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_t, listen_t):
                if not t.done():
                    t.cancel()
            await asyncio.gather(pump_t, listen_t, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.events.aclose()
            if self.on_close is not None:  # the iterator may never have started (no finally ran)
                self.on_close()
        if pump_t.done() and not pump_t.cancelled() and pump_t.exception() is not None:
            exc = pump_t.exception()
            if not isinstance(exc, OSError):
                logger.error("stream failed", exc_info=exc)


def stream_job(job: Job, chunks: AsyncIterator[str]) -> SSEResponse:
    """SSE response over `chunks` (an async iterator of events): always ends with [DONE],
    an engine error becomes an error event, and the job is closed with its outcome."""
    async def events():
        outcome = "error"
        try:
            async for ev in chunks:
                yield ev
            outcome = "success"
            yield SSE_DONE
        except APIError as e:
            outcome = "error" if e.status >= 500 else "bad_request"
            yield sse_event(e.body())
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"
            raise
        finally:
            job.close(outcome)

    return SSEResponse(events(), on_close=lambda: job.close("aborted"))
