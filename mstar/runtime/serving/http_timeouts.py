"""A bound on how long a client may take to send a request head, for uvicorn's h11 server.

uvicorn's h11 protocol closes a keep-alive connection that stays silent between requests
(`timeout_keep_alive`), but nothing bounds a connection that never sends a request, or that
sends its request line and headers a few bytes at a time (slowloris): each such connection
holds a socket open for as long as the client likes. `TimedH11Protocol` closes it once
`header_timeout_s` passes without a complete head.

    uvicorn.Config(app, http=timed_protocol(10.0), timeout_keep_alive=5, ...)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = json.dumps({"error": {
    "message": "the request head (request line and headers) was not received in time",
    "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()


class TimedH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete in time.

    The clock starts when the server begins to wait for a head: when the connection opens, and,
    on a keep-alive connection, when the first byte of the next request arrives (the silent
    gap before it is uvicorn's `timeout_keep_alive`, left as it is). It stops at the parsed
    head (h11's Request event), so a slow body or a long response is not limited here.
    """

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        # Runs after every read and after each response (for pipelined requests): the one place
        # that sees both a head completing and a new head starting.
        super().handle_events()
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        # While uvicorn's keep-alive timer runs (response sent, nothing read since) it bounds the
        # wait; uvicorn cancels it at the next byte, and from there this timer does.
        if waiting and self.timeout_keep_alive_task is None:
            self._arm_head_timer()
        elif not waiting:
            self._cancel_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial:
            # h11 lets a server answer before the request arrives: 408 says why, then close.
            self.logger.debug("request head not complete in %.1f s; 408 and close", self.header_timeout_s)
            headers = [*self.server_state.default_headers,
                       (b"content-type", b"application/json"),
                       (b"content-length", str(len(_TIMEOUT_BODY)).encode()),
                       (b"connection", b"close")]
            out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            out += self.conn.send(h11.Data(data=_TIMEOUT_BODY))
            out += self.conn.send(h11.EndOfMessage())
            self.transport.write(out)
        else:
            self.logger.debug("no request in %.1f s; closing the connection", self.header_timeout_s)
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def timed_protocol(header_timeout_s: float) -> type[TimedH11Protocol]:
    """A TimedH11Protocol subclass with this head timeout, to pass as `uvicorn.Config(http=...)`."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})
