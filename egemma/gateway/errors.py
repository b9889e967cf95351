"""The gateway's one error type: a Kind (what went wrong, in the client's terms), a message, and the request field
at fault; each protocol maps it once to a status code and its own body shape (KServe / Triton's {"error"}, OpenAI's
{"error": {message, type, param, code}}, TEI's {"error", "error_type"}). Every refusal the gateway writes, on its
aiohttp routes and its fast lane, comes from here."""
from __future__ import annotations

import asyncio
import enum
import http

import orjson

from egemma.gateway.upstream import UpstreamError


class Kind(enum.Enum):
    MALFORMED = "malformed"  # the body is not the JSON object (or the encoding) it must be
    VALIDATION = "validation"  # a field's value is not one this server takes
    EMPTY = "empty"  # an input with nothing to embed
    TOO_LARGE = "too_large"  # the body is over --max-request-bytes
    UNSUPPORTED_MEDIA = "unsupported_media"  # a Content-Encoding the gateway does not inflate
    UNAUTHORIZED = "unauthorized"  # no API key, or a wrong one
    NOT_FOUND = "not_found"  # no such route (or model)
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NOT_IMPLEMENTED = "not_implemented"  # a route of the protocol this server cannot serve
    OVERLOADED = "overloaded"  # too many connections, or Triton's queue is full
    UNHEALTHY = "unhealthy"  # Triton is not reachable or not ready (restarting)
    BACKEND = "backend"  # Triton failed to answer a request it took
    INTERNAL = "internal"  # a bug of the gateway's


class Protocol(enum.Enum):
    KSERVE = "kserve"
    OPENAI = "openai"
    TEI = "tei"


class GatewayError(Exception):
    """kind, the message, the request field at fault (param), an OpenAI error code where a client keys on one,
    headers the answer carries (a 405's Allow), and whether the connection must end after it (close: the request's
    framing is broken, so nothing after it on the connection can be read)."""

    def __init__(self, kind: Kind, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False):
        super().__init__(message)
        self.kind, self.param, self.code, self.headers, self.close = kind, param, code, headers or {}, close


_COMMON = {Kind.MALFORMED: 400, Kind.VALIDATION: 400, Kind.EMPTY: 400, Kind.TOO_LARGE: 413,
           Kind.UNSUPPORTED_MEDIA: 415, Kind.UNAUTHORIZED: 401, Kind.NOT_FOUND: 404, Kind.METHOD_NOT_ALLOWED: 405,
           Kind.NOT_IMPLEMENTED: 501, Kind.OVERLOADED: 503, Kind.UNHEALTHY: 503, Kind.BACKEND: 502,
           Kind.INTERNAL: 500}
# TEI's ErrorType -> status (router/src/http/server.rs): a field's bad value is a 422, a failed backend a 424
STATUS = {Protocol.KSERVE: _COMMON, Protocol.OPENAI: {**_COMMON, Kind.OVERLOADED: 429},
          Protocol.TEI: {**_COMMON, Kind.VALIDATION: 422, Kind.OVERLOADED: 429, Kind.BACKEND: 424}}
_TEI_TYPE = {Kind.EMPTY: "Empty", Kind.OVERLOADED: "Overloaded", Kind.UNHEALTHY: "Unhealthy",
             Kind.BACKEND: "Backend", Kind.INTERNAL: "Backend", Kind.NOT_IMPLEMENTED: "Backend"}  # else Validation
_OPENAI_CODE = {Kind.UNAUTHORIZED: "invalid_api_key", Kind.NOT_FOUND: "not_found"}


def protocol(path: str) -> Protocol:
    """Whose routes a path belongs to, and so the shape of its errors: /v2... KServe, /v1... OpenAI, else TEI."""
    return Protocol.KSERVE if path.startswith("/v2") else Protocol.OPENAI if path.startswith("/v1") else Protocol.TEI


def render(e: GatewayError, proto: Protocol) -> tuple[int, bytes]:
    """(status, JSON body) of e in proto's shape."""
    status = STATUS[proto][e.kind]
    if proto is Protocol.KSERVE:
        body = {"error": str(e)}
    elif proto is Protocol.OPENAI:
        body = {"error": {"message": str(e), "type": "invalid_request_error" if status < 500 else "server_error",
                          "param": e.param, "code": e.code or _OPENAI_CODE.get(e.kind)}}
    else:
        body = {"error": str(e), "error_type": _TEI_TYPE.get(e.kind, "Validation")}
    return status, orjson.dumps(body)


def headers(e: GatewayError) -> dict[str, str]:
    """Headers an error answer carries beside its body."""
    return {**e.headers, **({"WWW-Authenticate": 'Bearer realm="egemma"'} if e.kind is Kind.UNAUTHORIZED else {})}


def raw(e: GatewayError, proto: Protocol, close: bool = False) -> bytes:
    """A whole HTTP/1.1 answer, for writers below aiohttp (the fast lane, the connection cap)."""
    status, body = render(e, proto)
    extra = {**headers(e), **({"Connection": "close"} if close or e.close else {})}
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in extra.items())
            + "\r\n").encode() + body


def from_exception(exc: BaseException) -> GatewayError:
    """What a failure to get Triton's answer is to the client: a refusal of ours as it is, a broken answer from
    Triton a BACKEND error, no connection (refused, reset, timed out) UNHEALTHY, anything else INTERNAL (a bug)."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, UpstreamError):
        return GatewayError(Kind.BACKEND, f"Triton failed to answer: {exc}")
    if isinstance(exc, (OSError, asyncio.TimeoutError)):
        return GatewayError(Kind.UNHEALTHY, f"Triton is not reachable (restarting?): {type(exc).__name__}: {exc}")
    return GatewayError(Kind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
