"""A lean streaming HTTP/1.1 client for the serving benchmark (mstar.bench.serve).

At tens of thousands of streamed tokens per second the client is as much a part of the
measurement as the server: httpx costs ~35 us of CPU per SSE event (anyio, httpcore, h11 and
its line decoder for every socket read), so one client process tops out near 28k events/s.
This one parses the response in the protocol's data_received (one callback per socket read,
no task switch per event): ~4x less CPU per event. Same requests, same per-line timing
(mstar.bench.serve._Tally); keep-alive connections, one per worker.
"""

from __future__ import annotations

import asyncio


class HTTPStream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time. The response body is parsed
    as it arrives (chunked or Content-Length or until close); a 200's body is split into lines
    handed to `on_line`, any other status's body is kept for the error message."""

    def __init__(self):
        self.transport = None
        self.closed = False
        self._buf = bytearray()
        self._fut: asyncio.Future | None = None
        self._on_line = None
        self._phase, self._mode, self._left = "done", None, 0
        self._status, self._keep, self._lines, self._err = 0, True, b"", bytearray()

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        fut = self._fut
        if fut is not None and not fut.done():
            if self._mode == "close" and self._phase == "body":
                self._finish()
            else:
                fut.set_exception(ConnectionError(f"connection closed by the server ({exc or 'EOF'})"))

    def data_received(self, data: bytes) -> None:
        if self._fut is None or self._fut.done():
            return
        self._buf += data
        try:
            self._parse()
        except Exception as e:  # noqa: BLE001 -- a bad response fails its request, not the run
            if not self._fut.done():
                self._fut.set_exception(e)
            self.transport.close()

    # -- requests
    def request(self, raw: bytes, on_line) -> asyncio.Future:
        """Send one request; the future resolves to (status, keep_alive, error body or None)."""
        self._fut = asyncio.get_running_loop().create_future()
        self._on_line = on_line
        self._phase, self._mode, self._left = "head", None, 0
        self._status, self._keep, self._lines, self._err = 0, True, b"", bytearray()
        self._buf.clear()
        self.transport.write(raw)
        return self._fut

    def _finish(self) -> None:
        if self._lines and self._status == 200:
            self._on_line(self._lines.decode("utf-8", "replace").rstrip("\r"))
            self._lines = b""
        self._phase = "done"
        err = None if self._status == 200 else bytes(self._err)
        self._fut.set_result((self._status, self._keep, err))

    def _body(self, data) -> None:
        if self._status != 200:
            self._err += data
            return
        parts = (self._lines + bytes(data)).split(b"\n")
        self._lines = parts.pop()
        on_line = self._on_line
        for ln in parts:
            on_line(ln.decode("utf-8", "replace").rstrip("\r"))

    def _parse(self) -> None:
        buf = self._buf
        while True:
            if self._phase == "head":
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    return
                head = bytes(buf[:i]).decode("latin-1").split("\r\n")
                del buf[:i + 4]
                ver, status = head[0].split(" ", 2)[:2]
                status = int(status)
                if 100 <= status < 200:
                    continue  # 100 Continue and friends: the real response follows
                hdrs = {}
                for h in head[1:]:
                    k, _, v = h.partition(":")
                    hdrs[k.strip().lower()] = v.strip().lower()
                self._status = status
                self._keep = ver == "HTTP/1.1" and "close" not in hdrs.get("connection", "")
                if "chunked" in hdrs.get("transfer-encoding", ""):
                    self._mode, self._left = "chunked", -1
                elif "content-length" in hdrs:
                    self._mode, self._left = "length", int(hdrs["content-length"])
                else:
                    self._mode, self._keep = "close", False
                self._phase = "body"
                if self._mode == "length" and self._left == 0:
                    self._finish()
                    return
            elif self._phase == "body":
                if self._mode == "chunked":
                    if self._left < 0:  # a chunk-size line
                        i = buf.find(b"\r\n")
                        if i < 0:
                            return
                        size = int(bytes(buf[:i]).split(b";")[0].strip(), 16)
                        del buf[:i + 2]
                        if size == 0:
                            self._phase = "trailer"
                            continue
                        self._left = size
                    if len(buf) < self._left + 2:
                        return
                    self._body(buf[:self._left])
                    del buf[:self._left + 2]
                    self._left = -1
                elif self._mode == "length":
                    take = min(len(buf), self._left)
                    if take:
                        self._body(buf[:take])
                        del buf[:take]
                        self._left -= take
                    if self._left == 0:
                        self._finish()
                    return
                else:  # until the server closes
                    if buf:
                        self._body(buf)
                        buf.clear()
                    return
            elif self._phase == "trailer":
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                line = bytes(buf[:i])
                del buf[:i + 2]
                if not line:
                    self._finish()
                    return
            else:
                return


class RawClient:
    """Per-worker keep-alive connections to one http:// server, for mstar.bench.serve's raw requests."""

    def __init__(self, base_url: str):
        from urllib.parse import urlsplit
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError("the lean client speaks plain http:// only (use --http-client httpx)")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.hosthdr = u.netloc

    async def connect(self) -> HTTPStream:
        _, proto = await asyncio.get_running_loop().create_connection(HTTPStream, self.host, self.port)
        return proto

    def raw_request(self, path: str, body: bytes, headers: dict) -> bytes:
        h = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.hosthdr}\r\nAccept: */*\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{h}\r\n").encode() + body
