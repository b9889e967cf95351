"""The one gate every request passes on both of the gateway's paths (its fast lane and aiohttp), `admit`: the API key
where the route needs one, the body limit, the body's encoding, and what Triton 2.51's own HTTP crashes on (or, for
compressed bodies, inflates without bound; tests/test_front.py sends each to a bare Triton): JSON nested deeper than
MAX_JSON_DEPTH, infer inputs whose shape asks for more elements than their JSON data can hold or has dims outside
[0, 2^63), duplicate keys, an Inference-Header-Content-Length that is not a byte count within the body; and what it
answers with a 500 or takes wrongly (egemma.gateway.kserve_types): a lone surrogate escape anywhere in the JSON, a
field or a `data` element of the wrong JSON type, a string parameter holding NUL."""
from __future__ import annotations

import hmac
import json
import math
import re
from typing import Callable

import numpy as np
from aiohttp import web

from egemma.gateway.errors import GatewayError, Kind
from egemma.gateway.kserve_types import SURROGATE_ESCAPE, check_request, lone_surrogate

MAX_JSON_DEPTH = 100  # what Triton adopted upstream (#8172); a KServe request needs ~10
ENCODINGS = (b"identity", b"gzip", b"deflate")  # what aiohttp inflates as the body arrives
_KEYED_KSERVE = ("/infer", "/generate", "/generate_stream")  # Triton's `inference` API category
_OPEN = ("/health", "/metrics")  # TEI's public routes: probes and Prometheus
Header = Callable[[bytes], "bytes | None"]  # a request header's raw value by lower-case name


def needs_key(path: str) -> bool:
    """Whether a route runs inference (or tells the model's facts, on the OpenAI and TEI side) and so needs the
    API key: KServe's infer / generate, every OpenAI route, TEI's but /health and /metrics; never health,
    metadata or metrics."""
    if path.startswith("/v2"):
        return path.endswith(_KEYED_KSERVE)
    return path not in _OPEN


def authorized(gw, header: Header, kserve: bool) -> bool:
    """The credential rule: one credential, given once: `Authorization: Bearer KEY`, or on KServe routes Triton's
    `api-key: KEY`, its surrounding spaces and tabs not part of it (HTTP's rule for a field value). Both headers,
    or one given twice (aio_header joins repeats), are refused whatever they hold. Constant-time compare."""
    given = [(v, want) for v, want in ((header(b"authorization"), gw.bearer),
                                       (header(b"api-key") if kserve else None, gw.api_key)) if v is not None]
    return len(given) == 1 and hmac.compare_digest(given[0][0].strip(b" \t"), given[0][1])


def limit(gw, n: int, size: str):
    """The body limit, the one place it is applied: GatewayError(TOO_LARGE) for a body of n bytes over it."""
    if n > gw.max_body:
        raise GatewayError(Kind.TOO_LARGE, f"request body {size} is over this server's limit of {gw.max_body} bytes "
                                           "(--max-request-bytes); send large batches over gRPC (tritonclient.grpc, "
                                           f"port {gw.triton_grpc.rsplit(':', 1)[-1]}), which takes them")


def content_length(v: bytes | None) -> int | None:
    """A Content-Length the HTTP parser has checked, without int()'s limit on digits: leading zeros may be any
    number."""
    return None if v is None else int(v.strip().lstrip(b"0") or b"0")


def admit(gw, path: str, header: Header, body: bytes | None = None) -> None:
    """GatewayError for a request the gateway must not serve (path decoded, without the query). Called when the
    head is complete (body None), before any of the body is read: the API key, the declared length, the
    encoding; and once the whole body is (inflated; KServe routes, a GET's body too): what Triton cannot be
    trusted with."""
    if body is not None:
        return check_kserve(path, header(b"inference-header-content-length"), body)
    if gw.api_key is not None and needs_key(path) and not authorized(gw, header, path.startswith("/v2")):
        raise GatewayError(Kind.UNAUTHORIZED, "this route needs the server's API key: `Authorization: Bearer KEY`"
                                              + (" or `api-key: KEY`" if path.startswith("/v2") else ""))
    if (n := content_length(header(b"content-length"))) is not None:
        limit(gw, n, f"of {n} bytes")
    if (enc := (header(b"content-encoding") or b"identity").strip().lower()) not in ENCODINGS:
        raise GatewayError(Kind.UNSUPPORTED_MEDIA, f"Content-Encoding {enc.decode('latin-1')!r} is not supported "
                                                   "(gzip, deflate)")


def aio_header(request: web.Request) -> Header:
    """admit's view of an aiohttp request's headers: a header given more than once as its values joined (the fast
    lane hands such a request to aiohttp)."""
    def get(name: bytes) -> bytes | None:
        v = request.headers.getall(name.decode(), None)
        return None if v is None else ", ".join(v).encode("utf-8", "surrogateescape")  # repeats as HTTP joins them
    return get


async def read_body(request: web.Request, gw) -> bytes:
    """The whole body (admitted by its head already), at most gw.max_body bytes, refused before more than that is
    read. aiohttp inflates gzip / deflate bodies as they arrive: the limit holds for the inflated body (a 3 MiB
    gzip body can hold 3 GB, which Triton would inflate whole)."""
    buf, plain = bytearray(), request.headers.get("Content-Encoding", "identity").strip().lower() == "identity"
    try:
        async for chunk in request.content.iter_any():
            buf += chunk
            limit(gw, len(buf), "(chunked)" if plain else "once decompressed")
    except web.RequestPayloadError as e:  # e.g. a body that is not the gzip it says
        why = getattr(e.__cause__, "message", None) or " ".join(str(e).split())
        # read to its end as far as aiohttp is concerned: else it reads on after the answer, meets the error again
        # and logs it as an "Unhandled exception"; the connection ends with the answer
        request.content.feed_eof()
        raise GatewayError(Kind.MALFORMED, f"malformed body: {why}", close=True) from None
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
        raise GatewayError(Kind.MALFORMED, f"duplicate key in a JSON object: {sorted(k for k, _ in pairs)}")
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
            raise GatewayError(Kind.VALIDATION, f"input {name!r}: shape {shape} has a dimension outside [0, 2^63)")
        p = i.get("parameters")
        if isinstance(p, dict) and ("binary_data_size" in p or "shared_memory_region" in p):
            continue  # data outside the JSON: Triton checks its size against the shape
        if (n := math.prod(shape)) > json_len:
            raise GatewayError(Kind.VALIDATION, f"input {name!r}: shape {shape} holds {n} elements, more than a "
                                                f"{json_len}-byte JSON request can carry")


def check_kserve(path: str, n: bytes | None, body: bytes) -> None:
    """GatewayError for a KServe request body to path that Triton cannot be trusted with (the module docstring
    lists them); n: its Inference-Header-Content-Length header."""
    if n is not None:
        n = n.strip(b" \t")
        if not (n.isascii() and n.isdigit() and len(n) <= 18) or int(n) > len(body):
            raise GatewayError(Kind.MALFORMED, "Inference-Header-Content-Length must be a byte count within the "
                                               f"{len(body)}-byte body, got {n.decode('latin-1')!r}")
        if int(n) == 0:
            return  # the whole body is one raw tensor: no JSON
        head = body[:int(n)]
    else:
        head = body
    if json_depth(head) > MAX_JSON_DEPTH:
        raise GatewayError(Kind.MALFORMED, f"request JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    escapes = SURROGATE_ESCAPE.search(head) is not None
    if path.endswith("/infer") or escapes:
        try:
            req = _DECODER.decode(head.decode("utf-8", "surrogateescape"))
        except (ValueError, RecursionError) as e:
            raise GatewayError(Kind.MALFORMED, f"request JSON is not valid: {e}") from None
        if escapes and lone_surrogate(req):
            raise GatewayError(Kind.MALFORMED, "request JSON holds a lone surrogate escape (e.g. \\ud800 without its "
                                               "pair), which is no Unicode text")
        if path.endswith("/infer"):
            check_request(req)
            check_inputs(req, len(head))
