"""A lean pooled HTTP/1.1 client for the gateway's one upstream, Triton's own HTTP on loopback: keep-alive
connections reused one request at a time, Content-Length and chunked answers. aiohttp's client spends ~4x the CPU
per request here, and this is the path whose added latency the front must keep small (perf/bench_front.py)."""
from __future__ import annotations

import asyncio


class UpstreamError(ConnectionError):
    """Triton closed the connection or answered something that is not HTTP/1.1."""


class _Conn(asyncio.Protocol):
    def __init__(self):
        self.transport = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.head = None  # (status, headers, header end) of the answer being read
        self.closed = False
        self.got_data = False

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(UpstreamError(f"Triton closed the connection ({exc or 'EOF'})"))

    def data_received(self, data):
        self.buf += data
        self.got_data = True
        if self.waiter is not None and not self.waiter.done():
            try:
                if (res := self._parse()) is not None:
                    self.waiter.set_result(res)
            except UpstreamError as e:
                self.waiter.set_exception(e)
                self.transport.close()

    def _parse(self):
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return None
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            try:
                status = int(lines[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                raise UpstreamError(f"not an HTTP answer: {lines[0][:80]!r}") from None
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            self.head = status, headers, end + 4
        status, headers, start = self.head
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body, used = _dechunk(self.buf, start)
            if body is None:
                return None
        else:
            n = int(headers.get("content-length", 0))
            if len(self.buf) < start + n:
                return None
            body, used = bytes(self.buf[start:start + n]), start + n
        del self.buf[:used]
        self.head = None
        return status, headers, body

    async def roundtrip(self, data: bytes):
        self.waiter = asyncio.get_running_loop().create_future()
        self.got_data = False
        self.transport.write(data)
        try:
            return await self.waiter
        finally:
            self.waiter = None


def _dechunk(buf: bytearray, pos: int):
    """(body, bytes used) of a complete chunked body starting at pos, (None, 0) while incomplete."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None, 0
        try:
            n = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        except ValueError:
            raise UpstreamError("bad chunk size from Triton") from None
        if n == 0:
            end = buf.find(b"\r\n\r\n", eol)  # trailers, then the blank line
            return (bytes(out), end + 4) if end >= 0 else (None, 0)
        if len(buf) < eol + 2 + n + 2:
            return None, 0
        out += buf[eol + 2:eol + 2 + n]
        pos = eol + 2 + n + 2


class Upstream:
    """request() -> (status, {lower-case header: value}, body) from host:port, over pooled connections."""

    def __init__(self, address: str, connect_timeout: float = 5.0):
        self.host, port = address.rsplit(":", 1)
        self.port, self.connect_timeout = int(port), connect_timeout
        self.idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(_Conn, self.host, self.port), self.connect_timeout)
        return conn

    async def request(self, method: str, target: str, headers: dict[str, str], body: bytes | None):
        head = [f"{method} {target} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in headers.items()]
        if body is not None or method == "POST":
            head.append(f"Content-Length: {len(body or b'')}\r\n")
        data = "".join(head).encode("utf-8", "surrogateescape") + b"\r\n" + (body or b"")  # bytes as received
        while True:
            conn = self._idle()
            reused = conn is not None
            conn = conn or await self._connect()
            try:
                res = await conn.roundtrip(data)
            except UpstreamError:
                conn.transport.close()
                if reused and not conn.got_data:  # a connection Triton had closed while idle: try another
                    continue
                raise
            except BaseException:  # cancelled: the answer would arrive on a connection nobody reads
                conn.transport.close()
                raise
            return self._done(conn, res)

    def _idle(self) -> _Conn | None:
        while self.idle:
            if not (c := self.idle.pop()).closed:
                return c
        return None

    def _done(self, conn: _Conn, res):
        if res[1].get("connection", "").lower() != "close" and not conn.closed:
            self.idle.append(conn)
        else:
            conn.transport.close()
        return res

    def close(self):
        for c in self.idle:
            c.transport.close()
        self.idle.clear()
