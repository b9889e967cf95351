"""What a KServe v2 HTTP request must pass before the gateway hands it to Triton 2.51's own HTTP, which crashes on
(or, for compressed bodies, inflates without bound) each kind refused here (tests/test_front.py sends them to a
bare Triton): bodies over the limit, also once inflated; JSON nested deeper than MAX_JSON_DEPTH; infer inputs whose
shape asks for more elements than their JSON data can hold or has dims outside [0, 2^63); duplicate keys; an
Inference-Header-Content-Length that is not a byte count within the body."""
from __future__ import annotations

import json
import math
import re

import numpy as np
from aiohttp import web

from egemma.gateway.upstream import UpstreamError

MAX_JSON_DEPTH = 100  # what Triton adopted upstream (#8172); a KServe request needs ~10


class Rejected(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def failure(exc: BaseException) -> tuple[int, str]:
    """(status, message) for a KServe request Triton did not answer: refused here (Rejected), Triton failed to
    answer (UpstreamError), or Triton not reachable (anything else: a connection error or timeout)."""
    if isinstance(exc, Rejected):
        return exc.status, str(exc)
    if isinstance(exc, UpstreamError):
        return 502, f"Triton failed to answer: {exc}"
    return 503, f"Triton is not reachable (restarting?): {type(exc).__name__}: {exc}"


def error_body(message: str) -> tuple[dict[str, str], bytes]:
    """Triton's own error shape: ({lower-case header: value}, body)."""
    return {"content-type": "application/json"}, json.dumps({"error": message}).encode()


def error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(message)[1], content_type="application/json")


def too_large(gw, size: str) -> Rejected:
    return Rejected(413, f"request body {size} is over this server's limit of {gw.max_body} bytes "
                         "(--max-request-bytes); send large batches over gRPC (tritonclient.grpc, port "
                         f"{gw.triton_grpc.rsplit(':', 1)[-1]}), which takes them")


def content_length(request: web.Request) -> int | None:
    """aiohttp's request.content_length without its int() of the raw header, which raises past 4300 digits: the
    parser has checked the digits and the value, but leading zeros may be any number."""
    n = request.headers.get("Content-Length")
    return None if n is None else int(n.strip().lstrip("0") or "0")


async def read_body(request: web.Request, gw) -> bytes:
    """The whole body, at most gw.max_body bytes, else Rejected(413) before more than that is read. aiohttp
    inflates gzip / deflate bodies as they arrive: the limit holds for the inflated body (a 3 MiB gzip body can
    hold 3 GB, which Triton would inflate whole)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise Rejected(415, f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    n = content_length(request)
    if n is not None and n > gw.max_body:
        raise too_large(gw, f"of {n} bytes")
    buf = bytearray()
    try:
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > gw.max_body:
                raise too_large(gw, "(chunked)" if encoding == "identity" else "once decompressed")
    except web.RequestPayloadError as e:  # e.g. a body that is not the gzip it says
        raise Rejected(400, f"malformed body: {e}") from None
    return bytes(buf)


_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """Nesting depth of JSON text, or a bound on it when it is at most MAX_JSON_DEPTH (the common case, counted
    without parsing)."""
    opened = raw.count(b"[") + raw.count(b"{")
    if opened <= MAX_JSON_DEPTH:
        return opened
    b = np.frombuffer(_STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    return int(np.cumsum(np.where((b == 91) | (b == 123), 1, -1)).max(initial=0))


def _no_duplicates(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        raise Rejected(400, f"duplicate key in a JSON object: {sorted(k for k, _ in pairs)}")
    return d


_DECODER = json.JSONDecoder(strict=False, object_pairs_hook=_no_duplicates)


def check_inputs(req, json_len: int):
    """Shapes Triton 2.51 mishandles: it allocates (product of dims) x element size for an input whose data is in
    the JSON before reading it, and reads dims as uint64 into int64."""
    inputs = req.get("inputs") if isinstance(req, dict) else None
    for i in inputs if isinstance(inputs, list) else ():
        shape = i.get("shape") if isinstance(i, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            continue  # Triton answers "Unable to parse 'shape'"
        name = i.get("name")
        if any(not 0 <= d < 1 << 63 for d in shape):
            raise Rejected(400, f"input {name!r}: shape {shape} has a dimension outside [0, 2^63)")
        p = i.get("parameters")
        if isinstance(p, dict) and ("binary_data_size" in p or "shared_memory_region" in p):
            continue  # data outside the JSON: Triton checks its size against the shape
        if (n := math.prod(shape)) > json_len:
            raise Rejected(400, f"input {name!r}: shape {shape} holds {n} elements, more than a {json_len}-byte "
                                "JSON request can carry")


def check_kserve(path: str, n: str | None, body: bytes) -> None:
    """Rejected for a request body to path (decoded, no query) that Triton cannot be trusted with (the module docstring
    lists them); n: its Inference-Header-Content-Length header."""
    if n is not None:
        n = n.strip(" \t")
        if not (n.isascii() and n.isdigit() and len(n) <= 18) or int(n) > len(body):
            raise Rejected(400, f"Inference-Header-Content-Length must be a byte count within the {len(body)}-byte "
                                f"body, got {n!r}")
        if int(n) == 0:
            return  # the whole body is one raw tensor: no JSON
        head = body[:int(n)]
    else:
        head = body
    if json_depth(head) > MAX_JSON_DEPTH:
        raise Rejected(400, f"request JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    if path.endswith("/infer"):
        try:
            req = _DECODER.decode(head.decode("utf-8", "surrogateescape"))
        except (ValueError, RecursionError) as e:
            raise Rejected(400, f"request JSON is not valid: {e}") from None
        check_inputs(req, len(head))
