"""A lean pooled HTTP/1.1 client for the gateway's one upstream, Triton's own HTTP on loopback: keep-alive
connections reused one request at a time, Content-Length and chunked answers. aiohttp's client spends ~4x the CPU
per request here, and this is the path whose added latency the front must keep small (perf/serving/bench_front.py): a
connection frames each answer and hands on its bytes as they came (send_raw, for the fast lane: a callback, no task,
no future); send() and request() split them into status, headers and body."""
from __future__ import annotations

import asyncio
import re

_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})[^\r\n]*\r\n")
_FIELD = re.compile(rb"([^:\r\n]*):([^\r\n]*)\r\n")


class UpstreamError(ConnectionError):
    """Triton closed the connection or answered something that is not HTTP/1.1."""


class _Conn(asyncio.Protocol):
    def __init__(self):
        self.transport = None
        self.buf = bytearray()
        self.callback = None  # of the request in flight: called once with its answer or an UpstreamError
        self.head = None  # (status, headers, header end) of the answer being read
        self.closed = False
        self.got_data = False

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True
        self._finish(UpstreamError(f"Triton closed the connection ({exc or 'EOF'})"))

    def data_received(self, data):
        self.buf += data
        self.got_data = True
        if self.callback is None:  # bytes nobody asked for must not reach the next request's client
            self.transport.close()
        else:
            try:
                if (res := self._parse()) is not None:
                    self._finish(res)
            except UpstreamError as e:
                self.transport.close()
                self._finish(e)

    def _finish(self, res):
        if (cb := self.callback) is not None:
            self.callback = None
            cb(res)

    def _parse(self):
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return None
            if (m := _STATUS.match(self.buf)) is None:
                raise UpstreamError(f"not an HTTP answer: {bytes(self.buf[:80])!r}")
            headers = {k.strip().lower().decode("latin-1"): v.strip().decode("latin-1")
                       for k, v in _FIELD.findall(self.buf, m.end(), end + 2)}
            self.head = int(m.group(1)), headers, end + 4
        status, headers, start = self.head
        if _chunked(headers):
            if (chunks := _chunks(self.buf, start)) is None:
                return None
            used = chunks[1]
        else:
            used = start + int(headers.get("content-length", 0))
            if len(self.buf) < used:
                return None
        res = bytes(self.buf[:used]), status, headers, start
        del self.buf[:used]
        self.head = None
        return res

    def start(self, data: bytes, callback):
        """Send a request; callback gets its answer or an UpstreamError, once. A connection that closed before the
        request went out (Triton killed between connect and send, or while idle) answers at once: uvloop raises on a
        write to it and asyncio drops the bytes, and either way connection_lost has come or never comes again."""
        self.callback, self.got_data = callback, False
        if self.closed or self.transport.is_closing():
            return self._finish(UpstreamError("Triton closed the connection before the request was sent"))
        self.transport.write(data)


def _chunked(headers: dict[str, str]) -> bool:
    return headers.get("transfer-encoding", "").lower() == "chunked"


def _chunks(buf, pos: int) -> tuple[list[tuple[int, int]], int] | None:
    """([start, end) of each chunk's data, bytes used) of a complete chunked body starting at pos; None while
    incomplete."""
    spans = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            n = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        except ValueError:
            raise UpstreamError("bad chunk size from Triton") from None
        if n == 0:
            end = buf.find(b"\r\n\r\n", eol)  # trailers, then the blank line
            return (spans, end + 4) if end >= 0 else None
        if len(buf) < eol + 2 + n + 2:
            return None
        spans.append((eol + 2, eol + 2 + n))
        pos = eol + 2 + n + 2


def _split(answer):
    """(status, headers, body) of an answer as a connection hands it on, or the exception it is."""
    if isinstance(answer, BaseException):
        return answer
    raw, status, headers, start = answer
    body = b"".join(raw[a:b] for a, b in _chunks(raw, start)[0]) if _chunked(headers) else raw[start:]
    return status, headers, body


class Upstream:
    """send() / request(): (status, {lower-case header: value}, body) from host:port, over pooled connections;
    send_raw(): the answer as it came."""

    def __init__(self, address: str, connect_timeout: float = 5.0):
        self.host, port = address.rsplit(":", 1)
        self.port, self.connect_timeout = int(port), connect_timeout
        self.idle: list[_Conn] = []
        self.draining = False  # drain(): no connection is pooled any more

    def send(self, method: str, target: str, headers: dict[str, str], body: bytes | None, done):
        """done((status, headers, body)) or done(exception: UpstreamError, OSError or TimeoutError), once. An answer
        nobody waits for any more is still read, and its connection pooled."""
        head = [f"{method} {target} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in headers.items()]
        if body is not None or method == "POST":
            head.append(f"Content-Length: {len(body or b'')}\r\n")
        data = "".join(head).encode("utf-8", "surrogateescape") + b"\r\n" + (body or b"")  # bytes as received
        self._send(data, lambda answer: done(_split(answer)))

    async def request(self, method: str, target: str, headers: dict[str, str], body: bytes | None):
        fut = asyncio.get_running_loop().create_future()

        def done(res):
            if not fut.done():
                fut.set_exception(res) if isinstance(res, BaseException) else fut.set_result(res)
        self.send(method, target, headers, body, done)
        return await fut

    def send_raw(self, data: bytes, done):
        """A whole HTTP/1.1 request as the client sent it (the fast lane has checked it); done((the answer's bytes
        as Triton sent them, status, {lower-case header: value}, where its body starts)) or done(exception), once."""
        self._send(data, done)

    def _send(self, data: bytes, done):
        if self.draining:  # Triton takes no new request once stopping (it resets new connections): say so first
            return done(ConnectionRefusedError("the server is stopping; retry on another replica"))
        while self.idle:
            if not (conn := self.idle.pop()).closed:
                return conn.start(data, lambda res: self._answered(conn, True, data, res, done))
        asyncio.ensure_future(self._connect_and_send(data, done))

    async def _connect_and_send(self, data: bytes, done):
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, self.host, self.port), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            return done(e)
        conn.start(data, lambda res: self._answered(conn, False, data, res, done))

    def _answered(self, conn: _Conn, reused: bool, data: bytes, res, done):
        if isinstance(res, UpstreamError):
            conn.transport.close()
            if reused and not conn.got_data:  # a connection Triton had closed while idle: try another
                return self._send(data, done)
            return done(res)
        if res[2].get("connection", "").lower() != "close" and not conn.closed and not conn.buf and not self.draining:
            self.idle.append(conn)
        else:
            conn.transport.close()
        done(res)

    def close(self):
        for c in self.idle:
            c.transport.close()
        self.idle.clear()

    def drain(self):
        """Triton is stopping: close the idle connections now and every other one after its answer (Triton 2.51
        waits for open HTTP connections, idle ones too, until its exit timeout); refuse new requests (a 503)."""
        self.draining = True
        self.close()
