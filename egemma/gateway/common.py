"""What the gateway's route modules share: its state (Gateway, read as request.app[GW]), JSON answers, errors as
answers, the request body as a JSON object, the watchdog's verdict, and the request options the OpenAI and TEI
routes pass on to Triton (checked here: tritonclient refuses a value of another type without a status)."""
from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from aiohttp import web

from egemma.gateway import health
from egemma.gateway.admission import read_body
from egemma.gateway.errors import GatewayError, Kind, Protocol, headers, render
from egemma.spec import HUB_ID, OptionError, check

DEFAULT_MAX_BODY = 3 << 20  # under the 4 MiB at which Triton 2.51's HTTP crashes on the GPU host
HEALTH_MAX_AGE = 15.0  # s: the watchdog writes a verdict every ~2-7 s; an older one vouches for nothing


@dataclass
class Gateway:
    grpc: object = field(default=None, init=False)  # tritonclient.grpc.aio.InferenceServerClient, made at startup
    triton_http: str  # host:port of Triton's own HTTP (loopback)
    triton_grpc: str  # host:port of Triton's gRPC, for `grpc`
    model_name: str = HUB_ID  # served model name for OpenAI / TEI
    aliases: tuple[str, ...] = ()
    max_body: int = DEFAULT_MAX_BODY  # bytes
    max_batch: int = 64
    health_file: str | None = None
    triton_metrics: str | None = None  # host:port of Triton's metrics, for TEI's GET /metrics
    body_timeout: float = 60.0  # s for a request's whole body to arrive
    api_key: bytes | None = None  # what inference routes require (egemma.gateway.admission), and Triton too
    retry_s: float = 30.0  # how long a request is tried again while the server restarts (egemma.gateway.retry)
    upstream: object = field(default=None, init=False)  # egemma.gateway.upstream.Upstream to triton_http
    draining: bool = field(default=False, init=False)  # SIGUSR1: the server is stopping
    tracing: object = field(default=None, init=False)  # egemma.gateway.tracing.Tracing of this worker, or None: off

    def drain(self):
        self.draining = True
        if self.upstream is not None:
            self.upstream.drain()

    @property
    def bearer(self) -> bytes:
        return b"Bearer " + (self.api_key or b"")

    @property
    def grpc_headers(self) -> dict[str, str] | None:
        """gRPC metadata for the gateway's own calls to Triton (its --grpc-restricted-protocol prefixes the
        header's name with triton-grpc-protocol-)."""
        return None if self.api_key is None else {"triton-grpc-protocol-api-key": self.api_key.decode()}


GW = web.AppKey("gw", Gateway)


def json_response(obj, status: int = 200) -> web.Response:
    """orjson: fp32 arrays as their shortest round-trip decimals, ~15x faster than json with float lists."""
    return web.Response(body=orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY), status=status,
                        content_type="application/json")


REFUSED = "egemma_refused"  # an error answer's Kind, as the response's user data: counted by egemma.gateway.metrics


def error_response(e: GatewayError, proto: Protocol) -> web.Response:
    status, body = render(e, proto)
    r = web.Response(status=status, body=body, content_type="application/json", headers=headers(e))
    r[REFUSED] = e.kind
    if e.close:
        r.force_close()
    return r


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object."""
    try:
        body = orjson.loads(await read_body(request, request.app[GW]))
    except orjson.JSONDecodeError as e:
        raise GatewayError(Kind.MALFORMED, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise GatewayError(Kind.MALFORMED, "the body must be a JSON object")
    return body


def verdict(gw: Gateway) -> tuple[bool, str]:
    return health.read(gw.health_file, HEALTH_MAX_AGE) if gw.health_file else (True, "no watchdog")


def readiness(gw: Gateway) -> tuple[bool, str]:
    """The watchdog's verdict, and not while the server stops (liveness stays the verdict alone)."""
    return (False, "draining: the server is stopping") if gw.draining else verdict(gw)


def options(body: dict, keys) -> dict:
    """The request options among keys that body gives (null: not given), for Triton's request parameters, each by
    the options' one rule (egemma.spec.check); GatewayError(VALIDATION) naming the field otherwise."""
    out = {}
    for k in keys:
        if (v := body.get(k)) is None:
            continue
        try:
            out[k] = check(k, v)
        except OptionError as e:
            raise GatewayError(Kind.VALIDATION, str(e), k) from None
    return out


def choice(body: dict, key: str, allowed: tuple[str, ...], default: str) -> str:
    """An enum field: absent or null is the default, else one of allowed as a string (never "" or [] for the
    default); GatewayError(VALIDATION) naming the field."""
    if (v := body.get(key)) is None:
        return default
    if not isinstance(v, str) or v not in allowed:
        raise GatewayError(Kind.VALIDATION, f"{key} must be one of {', '.join(map(repr, allowed))}, got "
                                            f"{orjson.dumps(v, default=repr).decode()[:100]}", key)
    return v
