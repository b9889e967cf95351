"""What the gateway's route modules share: its state (Gateway, read as request.app[GW]), JSON answers, errors as
answers, and the watchdog's verdict: a small JSON file the launcher's watchdog writes after every check and the
health routes answer with (Triton's own /v2/health/live stays 200 after a model process died, so it cannot be the
liveness probe)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

from egemma.gateway.errors import GatewayError, Protocol, headers, render
from egemma.spec import HUB_ID, MAX_BATCH

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
    max_batch: int = MAX_BATCH  # texts a call to Triton
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


def verdict(gw: Gateway) -> tuple[bool, str]:
    return read_verdict(gw.health_file, HEALTH_MAX_AGE) if gw.health_file else (True, "no watchdog")


def readiness(gw: Gateway) -> tuple[bool, str]:
    """The watchdog's verdict, and not while the server stops (liveness stays the verdict alone)."""
    return (False, "draining: the server is stopping") if gw.draining else verdict(gw)


def write_verdict(path: str | Path, ok: bool, why: str | None = None, restarts: int = 0):
    """The watchdog's: atomically, so a reader never sees half a file. restarts: the watchdog's so far (a metric)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"ok": ok, "why": why, "time": time.time(), "restarts": restarts}, f)
    os.replace(tmp, path)


def restarts(path: str | Path) -> int:
    """The watchdog's restarts the verdict file counts (0 while there is none)."""
    try:
        return int(json.loads(Path(path).read_text()).get("restarts", 0))
    except (OSError, ValueError):
        return 0


def read_verdict(path: str | Path, max_age: float) -> tuple[bool, str]:
    """(serving, why): False when the verdict is bad, missing, or older than max_age seconds (a watchdog that
    stopped checking vouches for nothing)."""
    try:
        v = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False, "no watchdog verdict yet"
    age = time.time() - float(v.get("time", 0))
    if age > max_age:
        return False, f"watchdog verdict is {age:.0f}s old"
    return bool(v.get("ok")), v.get("why") or "serving"
