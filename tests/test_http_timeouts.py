"""TimedH11Protocol against a real uvicorn server on a loopback port: slow or silent clients are
closed, normal and keep-alive requests are not."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from mstar.runtime.serving.http_timeouts import TimedH11Protocol, timed_protocol

HEAD_TIMEOUT = 0.5
KEEP_ALIVE = 1.5  # longer than HEAD_TIMEOUT, to tell the two apart
REQUEST = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


async def _app(scope, receive, send):
    if scope["type"] != "http":  # lifespan
        return
    body = json.dumps({"path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def addr():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, http=timed_protocol(HEAD_TIMEOUT), timeout_keep_alive=KEEP_ALIVE,
                            lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(5)
    sock.close()


def _connect(addr) -> socket.socket:
    return socket.create_connection(addr, timeout=HEAD_TIMEOUT + KEEP_ALIVE + 2)


def _read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _read_response(f) -> bytes:
    """One response with a Content-Length body from `s.makefile("rb")`, the connection left open."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = f.readline()
        assert line, f"connection closed after {head!r}"
        head += line
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + f.read(length)


def _assert_408(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["message"] and {k: v for k, v in err.items() if k != "message"} == {
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}


def test_silent_connection_is_closed(addr):
    with _connect(addr) as s:
        t0 = time.monotonic()
        assert _read_until_closed(s) == b""  # closed without a response
        took = time.monotonic() - t0
    assert HEAD_TIMEOUT * 0.8 <= took <= HEAD_TIMEOUT + 1, took


def test_half_head_gets_408(addr):
    with _connect(addr) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n")
        data = _read_until_closed(s)
        took = time.monotonic() - t0
    _assert_408(data)
    assert took <= HEAD_TIMEOUT + 1, took


def test_trickled_head_is_cut_off(addr):
    # Bytes keep arriving, but the head never completes: the deadline does not move.
    with _connect(addr) as s:
        t0 = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\n")
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(50):
                time.sleep(0.1)
                s.sendall(b"X-Drip: 1\r\n")
        took = time.monotonic() - t0
    assert took <= HEAD_TIMEOUT + 1, took


def test_normal_request(addr):
    r = httpx.get(f"http://{addr[0]}:{addr[1]}/hello", timeout=5)
    assert r.status_code == 200 and r.json() == {"path": "/hello"}


def test_keep_alive_two_requests_and_idle_gap(addr):
    with _connect(addr) as s, s.makefile("rb") as f:
        s.sendall(REQUEST)
        assert _read_response(f).startswith(b"HTTP/1.1 200 ")
        # Idle between requests for longer than the head timeout: keep-alive rules the gap.
        time.sleep(HEAD_TIMEOUT * 2)
        s.sendall(REQUEST)
        assert _read_response(f).startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        assert f.read() == b""  # then uvicorn's keep-alive timeout closes it
        took = time.monotonic() - t0
    assert KEEP_ALIVE * 0.8 <= took <= KEEP_ALIVE + 1, took


def test_keep_alive_second_head_stalls(addr):
    with _connect(addr) as s, s.makefile("rb") as f:
        s.sendall(REQUEST)
        assert _read_response(f).startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        s.sendall(b"GET /y HTTP/1.1\r\n")
        data = f.read()
        took = time.monotonic() - t0
    _assert_408(data)
    assert took <= HEAD_TIMEOUT + 1, took


def test_pipelined_requests(addr):
    with _connect(addr) as s, s.makefile("rb") as f:
        s.sendall(REQUEST + REQUEST)
        assert _read_response(f).startswith(b"HTTP/1.1 200 ")
        assert _read_response(f).startswith(b"HTTP/1.1 200 ")


def test_factory():
    cls = timed_protocol(2.5)
    assert issubclass(cls, TimedH11Protocol) and cls.header_timeout_s == 2.5
    with pytest.raises(ValueError):
        timed_protocol(0)
