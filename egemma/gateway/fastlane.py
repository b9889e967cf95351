"""The gateway's fast lane: the KServe v2 requests almost every client sends (GET or POST of /v2/..., HTTP/1.1,
plain headers, a Content-Length body within the limit) parsed here by an asyncio Protocol and passed to Triton as
they came, its answer back byte for byte, instead of through aiohttp's request machinery (twice the added latency
and CPU per proxied query: perf/RESULTS.md, "HTTP front"). Every connection starts here; at the first request that is
anything else (chunked, compressed, Expect, percent-escapes, over-long or odd headers, the health routes, the
OpenAI / TEI routes, another method or version) or that the gate refuses at its head (no API key, a body over the
limit) the connection is handed, with every byte it has sent, to aiohttp's handler for good, which answers it as
before. So the lane never has to reject malformed HTTP itself: it only passes what it understands. The same gate
(egemma.gateway.admission.admit: API key, body limit, what Triton crashes on) stands before Triton on both paths,
and the same idle and body deadlines; the lane's own refusals are in KServe's shape (egemma.gateway.errors)."""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import time

from egemma.gateway import metrics, retry
from egemma.gateway.admission import admit
from egemma.gateway.errors import STATUS, GatewayError, Protocol, from_exception, raw

_HEAD_LIMIT = 8192  # longer heads go to aiohttp, which passes Triton only the headers it uses (the lane: all)
_REQUEST_LINE = re.compile(rb"(GET|POST) (/v2(?:[/?][!-$&-~]{0,8000})?) HTTP/1\.1\r\n")  # '%' goes to aiohttp
_HEADERS = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*\r\n){0,128}")
_FIELD = re.compile(rb"([^:]+): *(.*?)[\t ]*\r\n")  # on a head _HEADERS has matched; Triton skips no tabs
_CONNECTION = re.compile(rb"\r\nconnection:[^\r]*", re.I)
_API_KEY = re.compile(rb"\r\napi-key:[^\r]*", re.I)
_HAND_OVER = {b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"}  # framing aiohttp knows
_SLOW_PATHS = ("/v2/health/live", "/v2/health/ready")  # the watchdog's verdict: aiohttp's routes
_PIPELINED = 64 << 10  # bytes of requests read ahead while one is at Triton; past it, reading pauses
log = logging.getLogger("egemma.gateway")


def parse_head(buf: bytes | bytearray) -> tuple[str, dict[bytes, bytes], int, int] | None | bool:
    """The request head at buf's start as the lane takes it: (path without the query, {lower-case name: value},
    where the body starts, its length); None while the head is incomplete; False for a request the lane does not
    take (aiohttp answers it)."""
    end = buf.find(b"\r\n\r\n", 0, _HEAD_LIMIT)
    if end < 0:
        return False if len(buf) >= _HEAD_LIMIT else None
    line = _REQUEST_LINE.match(buf)
    if line is None or _HEADERS.fullmatch(buf, line.end(), end + 2) is None:
        return False
    fields = _FIELD.findall(buf, line.end(), end + 2)
    headers = {k.lower(): v for k, v in fields}
    n = headers.get(b"content-length", b"0" if line.group(1) == b"GET" else None)
    if (n is None or not n.isdigit() or len(n) > 18 or n[:1] == b"0" and n != b"0"
            or len(headers) != len(fields) or not _HAND_OVER.isdisjoint(headers)
            or headers.get(b"connection", b"keep-alive").lower() not in (b"keep-alive", b"close")
            or (path := line.group(2).split(b"?", 1)[0].decode()) in _SLOW_PATHS):
        return False
    return path, headers, end + 4, int(n)


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
        self.loop = asyncio.get_running_loop()  # made by the loop's server: once, not per request
        self.busy = False  # a request is at Triton: the next one waits (one at a time, answers in order)
        self.reading_paused = self.writing_paused = self.advancing = self.handed = False
        self.timer, self.expires = None, None
        self.pending = None  # (path, headers, body start, body length): the request at the buffer's head
        self.path, self.t0, self.span = "", 0.0, None  # the request at Triton's: counted, traced when on
        self.close_after = False

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lanes.open.add(self)
        self._deadline(self.lanes.idle_timeout)

    def connection_lost(self, exc):
        self._leave()

    def _leave(self):
        """This lane is done with the connection: no more deadline, not counted."""
        self.lanes.gone(self)
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data):
        self.buf += data
        self._advance()

    def pause_writing(self):  # the client is not reading: take no new request until it does
        self.writing_paused = True

    def resume_writing(self):
        self.writing_paused = False
        self._advance()

    def _advance(self):
        """Serve the requests at the buffer's head, one at a time, while nothing waits (a loop, not recursion:
        pipelined requests refused on the spot answer synchronously); then let in more bytes only where they
        can be used (a client pipelining without reading stops being read)."""
        if self.advancing:
            return
        self.advancing = True
        try:
            while not (self.busy or self.writing_paused or self.handed or self.transport.is_closing()):
                if self.pending is None and (not self.buf or not self._head()):
                    break
                if self.handed or len(self.buf) < self.pending[2] + self.pending[3]:
                    break
                self._dispatch()
        except Exception:  # a bug must cost only this connection, never leave it hanging
            log.exception("fast lane: closing a connection after an unexpected error")
            self.transport.close()
        finally:
            self.advancing = False
        if not self.handed:
            pause = (self.busy or self.writing_paused) and len(self.buf) > _PIPELINED
            if pause != self.reading_paused and not self.transport.is_closing():
                self.reading_paused = pause
                self.transport.pause_reading() if pause else self.transport.resume_reading()

    def _deadline(self, seconds: float | None):
        """Close the connection unless the next request is complete within seconds (idle, mid-headers or
        mid-body, as aiohttp's keep-alive and the gateway's body deadline do). One timer, moved only to fire
        sooner (when it fires early it re-arms): requests do not churn timers."""
        self.expires = None if seconds is None else self.loop.time() + seconds
        if self.expires is not None and (self.timer is None or self.timer.when() > self.expires):
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(self.expires, self._expire)

    def _expire(self):
        self.timer = None
        if self.expires is None:
            return
        if self.loop.time() < self.expires:
            self.timer = self.loop.call_at(self.expires, self._expire)
        else:
            self.transport.close()

    def _head(self) -> bool:
        """Parse and admit the request head at the buffer's start into self.pending: False while it is incomplete,
        or after handing the connection over (also a request that is refused)."""
        head = parse_head(self.buf)
        if not head:
            return head is False and self._hand_over()
        path, headers, start, n = head
        try:
            admit(self.lanes.gw, path, headers.get)
        except GatewayError:  # aiohttp refuses it alike and reads on the body it refuses, so the client reads why
            return self._hand_over()
        self.pending = head
        if len(self.buf) < start + n:
            self._deadline(self.lanes.gw.body_timeout)
        return True

    def _dispatch(self):
        path, headers, start, n = self.pending
        request = bytes(self.buf[:start + n])
        del self.buf[:start + n]
        self.pending, self.busy = None, True
        self.path, self.t0 = path, time.perf_counter()
        self._deadline(None)
        self.close_after = headers.get(b"connection", b"").lower() == b"close"
        if b"connection" in headers:  # ours to keep: Triton's connection stays pooled whatever this client wants
            request = _CONNECTION.sub(b"", request[:start]) + request[start:]
            start = request.find(b"\r\n\r\n") + 4
        if n:  # a GET body too: never trust Triton to ignore it
            try:
                admit(self.lanes.gw, path, headers.get, request[start:])
            except GatewayError as e:
                return self._answered(e)
        if (tr := self.lanes.gw.tracing) is not None:
            self.span, request, start = tr.kserve(request[:4].strip().decode(), metrics.route_of(path), request,
                                                  start, headers)
        if self.lanes.gw.api_key is not None:  # admitted: the key as Triton's check wants it, whatever form it came in
            head = _API_KEY.sub(b"", request[:start - 4]) if b"api-key" in headers else request[:start - 4]
            request = head + b"\r\napi-key: " + self.lanes.gw.api_key + b"\r\n\r\n" + request[start:]
        retry.raw(self.lanes.gw, request, self._answered)

    def _hand_over(self) -> bool:
        """This connection to aiohttp's handler from here on, with what it has sent; False."""
        self.handed = True
        self._leave()
        if self.reading_paused:
            self.transport.resume_reading()
        h = self.lanes.handlers()
        self.transport.set_protocol(h)
        h.connection_made(self.transport)
        if self.buf:
            h.data_received(bytes(self.buf))
        return False

    def _answered(self, res):
        """Triton's answer (as Upstream.send_raw hands it on), or why there is none, to the client."""
        try:
            self._write(res)
        except Exception:
            log.exception("fast lane: closing a connection after an unexpected error")
            self.transport.close()
            return
        self._advance()

    def _write(self, res):
        if isinstance(res, BaseException):
            metrics.METRICS.refused((e := from_exception(res)).kind)
            data, h, status = raw(e, Protocol.KSERVE), {}, STATUS[Protocol.KSERVE][e.kind]
        else:
            data, status, h, _ = res
        metrics.done(self.path, status, self.t0, self.lanes.gw.tracing, self.span)  # the client gone or not
        self.span = None
        if self.transport.is_closing():
            return
        close = self.close_after or self.lanes.draining is not None or h.get("connection", "").lower() == "close"
        if close and "connection" not in h:
            end = data.find(b"\r\n\r\n")
            data = data[:end] + b"\r\nConnection: close" + data[end:]
        self.transport.write(data)
        self.busy = False
        if close:
            return self.transport.close()
        self._deadline(self.lanes.idle_timeout)
