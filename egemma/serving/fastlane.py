"""The gateway's fast lane: the KServe v2 requests almost every client sends (GET or POST of /v2/..., HTTP/1.1,
plain headers, a Content-Length body within the limit) parsed and proxied here, in a few dozen lines of asyncio
Protocol, instead of through aiohttp's request machinery (which cost ~0.3 ms of CPU per proxied query,
perf/RESULTS.md run 27). Every connection starts here; at the first request that is anything else (chunked,
compressed, Expect, percent-escapes, over-long or odd headers, the health routes, the OpenAI / TEI routes, another
method or version) the connection is handed, with every byte it has sent, to aiohttp's handler for good, which
answers it as before. So the lane never has to reject malformed HTTP itself: it only passes what it understands.
The same guards (egemma.serving.guard) stand before Triton on both paths, and the same idle and body deadlines."""
from __future__ import annotations

import asyncio
import http
import re
import socket

from egemma.serving.guard import Rejected, check_kserve, error_body
from egemma.serving.upstream import UpstreamError

_HEAD_LIMIT = 8192  # longer heads go to aiohttp, which passes Triton only the headers it uses (the lane: all)
_REQUEST_LINE = re.compile(rb"(GET|POST) (/v2(?:[/?][!-$&-~]{0,8000})?) HTTP/1\.1\r\n")  # '%' goes to aiohttp
_HEADERS = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*\r\n){0,128}")
_FIELD = re.compile(rb"([^:]+):[\t ]*(.*?)[\t ]*\r\n")  # on a head _HEADERS has matched
_HAND_OVER = {b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"}  # framing aiohttp knows
_SLOW_PATHS = ("/v2/health/live", "/v2/health/ready")  # the watchdog's verdict: aiohttp's routes
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}


class Lanes:
    """The fast-lane connections of one worker: protocol() makes one; handlers is aiohttp's protocol factory
    (web.Server), set before the first connection."""

    def __init__(self, gw, idle_timeout: float):
        self.gw, self.idle_timeout = gw, idle_timeout
        self.handlers = None
        self.open: set[_Lane] = set()
        self.draining: asyncio.Event | None = None  # set once the last connection is gone

    def protocol(self) -> asyncio.Protocol:
        return _Lane(self)

    def gone(self, lane: _Lane):
        self.open.discard(lane)
        if self.draining is not None and not self.open:
            self.draining.set()

    async def drain(self, timeout: float):
        """Close idle connections now, busy ones once their answer is out (or after timeout)."""
        self.draining = asyncio.Event()
        for c in list(self.open):
            if not c.busy:
                c.transport.close()
        if self.open:
            try:
                await asyncio.wait_for(self.draining.wait(), timeout)
            except asyncio.TimeoutError:
                for c in list(self.open):
                    c.transport.close()


class _Lane(asyncio.Protocol):
    def __init__(self, lanes: Lanes):
        self.lanes, self.buf, self.transport = lanes, bytearray(), None
        self.busy, self.paused, self.timer, self.expires = False, False, None, None
        self.pending = None  # (method, path, headers, body start, body length): a request awaiting its body

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lanes.open.add(self)
        self._deadline(self.lanes.idle_timeout)

    def connection_lost(self, exc):
        self.lanes.gone(self)
        self._deadline(None)
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data):
        self.buf += data
        if self.busy:
            if len(self.buf) > self.lanes.gw.max_body + _HEAD_LIMIT and not self.paused:  # pipelining, not reading
                self.paused = True
                self.transport.pause_reading()
        elif self.pending is not None:
            if len(self.buf) >= self.pending[3] + self.pending[4]:
                self._dispatch()
        else:
            self._next()

    def _deadline(self, seconds: float | None):
        """Close the connection unless the next request is complete within seconds (idle, mid-headers or
        mid-body, as aiohttp's keep-alive and the gateway's body deadline do). One timer, moved only to fire
        sooner (when it fires early it re-arms): requests do not churn timers."""
        loop = asyncio.get_running_loop()
        self.expires = None if seconds is None else loop.time() + seconds
        if self.expires is not None and (self.timer is None or self.timer.when() > self.expires):
            if self.timer is not None:
                self.timer.cancel()
            self.timer = loop.call_at(self.expires, self._expire)

    def _expire(self):
        self.timer = None
        if self.expires is None:
            return
        if (loop := asyncio.get_running_loop()).time() < self.expires:
            self.timer = loop.call_at(self.expires, self._expire)
        else:
            self.transport.close()

    def _next(self):
        """Serve the request at the head of the buffer if it is complete, else wait for it, or hand over."""
        end = self.buf.find(b"\r\n\r\n", 0, _HEAD_LIMIT)
        if end < 0:
            if len(self.buf) >= _HEAD_LIMIT:
                self._hand_over()
            return
        line = _REQUEST_LINE.match(self.buf)
        if line is None or _HEADERS.fullmatch(self.buf, line.end(), end + 2) is None:
            return self._hand_over()
        fields = _FIELD.findall(self.buf, line.end(), end + 2)
        headers = {k.lower(): v for k, v in fields}
        n = headers.get(b"content-length", b"0" if line.group(1) == b"GET" else None)
        if (n is None or not n.isdigit() or n[:1] == b"0" and n != b"0" or int(n) > self.lanes.gw.max_body
                or len(headers) != len(fields) or not _HAND_OVER.isdisjoint(headers)
                or headers.get(b"connection", b"keep-alive").lower() not in (b"keep-alive", b"close")
                or (path := line.group(2).split(b"?", 1)[0].decode()) in _SLOW_PATHS):
            return self._hand_over()
        method, n = line.group(1), int(n)
        self.pending = method, path, headers, end + 4, n
        if len(self.buf) >= end + 4 + n:
            self._dispatch()
        else:
            self._deadline(self.lanes.gw.body_timeout)

    def _dispatch(self):
        method, path, headers, start, n = self.pending
        request = bytes(self.buf[:start + n])
        del self.buf[:start + n]
        self.pending, self.busy = None, True
        self._deadline(None)
        self.close_after = headers.get(b"connection", b"").lower() == b"close"
        if method == b"POST" and n:
            try:
                n = headers.get(b"inference-header-content-length")
                check_kserve(path, None if n is None else n.decode("latin-1"), request[start:])
            except Rejected as e:
                return self._answered(e)
        self.lanes.gw.upstream.send_raw(request, self._answered)

    def _hand_over(self):
        """This connection to aiohttp's handler from here on, with what it has sent."""
        self.lanes.gone(self)
        self._deadline(None)
        if self.timer is not None:
            self.timer.cancel()
        h = self.lanes.handlers()
        self.transport.set_protocol(h)
        h.connection_made(self.transport)
        if self.buf:
            h.data_received(bytes(self.buf))

    def _answered(self, res):
        """Triton's answer (its bytes as sent, {lower-case header: value}), or why there is none, to the client."""
        if self.transport.is_closing():
            return
        if isinstance(res, BaseException):
            if isinstance(res, Rejected):
                status, message = res.status, str(res)
            elif isinstance(res, UpstreamError):
                status, message = 502, f"Triton failed to answer: {res}"
            else:
                status, message = 503, f"Triton is not reachable (restarting?): {type(res).__name__}: {res}"
            h, body = error_body(message)
            res = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {h['content-type']}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body, {}
        data, h = res
        close = self.close_after or self.lanes.draining is not None or h.get("connection", "").lower() == "close"
        if close and "connection" not in h:
            end = data.find(b"\r\n\r\n")
            data = data[:end] + b"\r\nConnection: close" + data[end:]
        self.transport.write(data)
        if close:
            return self.transport.close()
        self.busy = False
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        self._deadline(self.lanes.idle_timeout)
        if self.buf:
            self._next()
