"""The server's HTTP front: one asyncio process on the user-facing HTTP port(s) that proxies the KServe v2 routes to
Triton's own HTTP on a loopback port, every request bounded before it reaches Triton, and serves the OpenAI and TEI
routes (egemma.gateway.openai_api, egemma.gateway.tei_api) over one shared aio gRPC client. Plain KServe requests
take the fast lane (egemma.gateway.fastlane); the rest, and every route below, aiohttp.

  python -m egemma.gateway.app --port 8000 [--port 8080 ...] --triton-http 127.0.0.1:P --triton-grpc 127.0.0.1:Q
      [--host 127.0.0.1] [--max-request-bytes 3145728] [--workers 1] [--model-name google/embeddinggemma-300m]
      [--alias NAME ...] [--health-file PATH] [--triton-metrics 127.0.0.1:R] [--max-connections 1024]
      [--idle-timeout 60] [--body-timeout 60] [--api-key-file PATH] [--retry-seconds 30]

Triton 2.51's HTTP server dies on some single requests (tests/test_front.py keeps each one, against bare Triton);
what reaches it from here cannot be one of them:
  - a body over --max-request-bytes: 413 (on Content-Length at once, a chunked body as soon as it grows past; never
    buffered beyond the limit). Triton crashes on bodies of 4 MiB and more on the GPU host (upstream #5840);
  - gzip / deflate bodies are inflated as they arrive, under the same limit, and sent on plain (a 3 MiB gzip body
    holds 3 GB, which Triton would inflate whole);
  - JSON nested deeper than MAX_JSON_DEPTH (2.51 overflows its stack on ~100k-deep `data` or generate bodies);
  - an infer input whose shape holds more elements than its JSON data can (2.51 allocates shape x element size
    before reading `data` and aborts when that fails), dims outside [0, 2^63), duplicate JSON keys (Triton reads
    the first, a check here the last); an Inference-Header-Content-Length that is not a decimal within the body.
Connections: header lines over 8 KiB or 128 headers are a 400; a connection that sends no complete request
within --idle-timeout (also mid-headers) is closed, as is one whose body is not complete within --body-timeout;
over --max-connections per worker a new one gets a 503. Everything else, in both directions, passes unchanged
(Content-Type, Inference-Header-Content-Length, admin-key, Accept-Encoding; Triton enforces the admin key), so
tritonclient.http (JSON and binary tensors), curl and perf_analyzer work as against Triton itself.
/v2/health/live is the watchdog's verdict (egemma.gateway.common) when --health-file is given (Triton's own stays
200 after a model process died); /v2/health/ready needs that verdict and Triton's ready. --workers K runs K
processes on the same sockets (one process group; SIGTERM drains each). SIGUSR1 (the launcher's first step of a
stop) starts the drain: readiness and new KServe requests answer 503 from then on (the requests already at Triton
are answered), and the connections to Triton's HTTP close as soon as each is idle (Triton 2.51, stopping, waits
for every open HTTP connection until its exit timeout).


With --api-key-file, inference routes answer only to its key (egemma.gateway.admission.needs_key), which the
gateway passes on where it calls Triton itself (its HTTP proxy, its gRPC client; Triton checks it too).
Every route answers errors in its protocol's shape (egemma.gateway.errors), through one middleware that also
admits each request (egemma.gateway.admission: the API key, the body limit) before its handler runs (and tries
again one that a server restart failed, for up to --retry-seconds: egemma.gateway.retry); route
handlers raise GatewayError. Route modules read the app's state as request.app[GW], a Gateway
(egemma.gateway.common); its gRPC client and the HTTP pool to Triton are made when the app starts and closed at
cleanup."""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import resource
import signal
import sys
from pathlib import Path

from aiohttp import web

from egemma.gateway import metrics, openai_api, retry, serving, tei_api
from egemma.gateway.admission import admit, aio_header, read_body
from egemma.gateway.aioserver import event_loop_runner, exit_with_parent, listen, serve
from egemma.gateway.common import DEFAULT_MAX_BODY, GW, Gateway, error_response, readiness, verdict
from egemma.gateway.errors import GatewayError, Kind, from_exception, protocol
from egemma.gateway.fastlane import Lanes
from egemma.gateway.upstream import Upstream
from egemma.spec import HUB_ID

REQUEST_HEADERS = ("Content-Type", "Inference-Header-Content-Length", "admin-key", "Accept-Encoding")
RESPONSE_HEADERS = ("Content-Type", "Inference-Header-Content-Length", "Content-Encoding")
_ROUTER = {404: Kind.NOT_FOUND, 405: Kind.METHOD_NOT_ALLOWED}
log = logging.getLogger("egemma.gateway")


async def proxy(request: web.Request) -> web.Response:
    """A KServe v2 request, admitted, to Triton's own HTTP; its answer back as it is."""
    gw = request.app[GW]
    if request.method not in ("GET", "POST"):  # all that Triton's HTTP API uses
        raise GatewayError(Kind.METHOD_NOT_ALLOWED, f"method {request.method} is not part of the KServe v2 HTTP API",
                           headers={"Allow": "GET, POST"})
    headers = {k: v for k in REQUEST_HEADERS if (v := request.headers.get(k)) is not None}
    if gw.api_key is not None:  # admitted: Triton's own check wants its header
        headers["api-key"] = gw.api_key.decode()
    headers = headers if gw.tracing is None else gw.tracing.headers(headers)  # traced: the span's context to Triton
    body = None
    if request.body_exists:
        body = await read_body(request, gw)  # inflated: it goes on plain
        if body:  # a GET body too: never trust Triton to ignore it
            admit(gw, request.path, aio_header(request), body)
    try:
        status, h, data = await retry.call(gw, lambda: gw.upstream.request(request.method, request.rel_url.raw_path_qs,
                                                                           headers, body))
    except (OSError, asyncio.TimeoutError) as e:
        raise from_exception(e) from None
    return web.Response(status=status, body=data,
                        headers={k: v for k in RESPONSE_HEADERS if (v := h.get(k.lower())) is not None})


async def live(request: web.Request) -> web.Response:
    gw = request.app[GW]
    if not gw.health_file:
        return await proxy(request)
    ok, why = verdict(gw)
    return web.json_response({"live": ok, "why": why}, status=200 if ok else 503)


async def ready(request: web.Request) -> web.Response:
    ok, why = readiness(request.app[GW])
    return await proxy(request) if ok else web.json_response({"ready": False, "why": why}, status=503)


def _refusal(request: web.Request) -> GatewayError | None:
    """Why the request is not served before its body is read: no route (404 / 405, in the protocol's shape), or
    its head not admitted."""
    if (exc := request.match_info.http_exception) is not None:
        allow = {"Allow": ", ".join(sorted(exc.allowed_methods))} if exc.status == 405 else None
        return GatewayError(_ROUTER.get(exc.status, Kind.NOT_FOUND), f"{exc.reason}: {request.method} {request.path}",
                            headers=allow)
    try:
        admit(request.app[GW], request.path, aio_header(request))
    except GatewayError as e:
        return e
    return None


async def expect(request: web.Request):
    """Expect: 100-continue: a request that is refused anyway is refused before the client sends its body."""
    if (e := _refusal(request)) is not None:
        return metrics.refusal(error_response(e, protocol(request.path)))
    if request.headers.get("Expect", "").lower() == "100-continue":
        request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


@web.middleware
async def gate(request: web.Request, handler):
    """Every route's one handler style: the request admitted, its body given body_timeout to arrive (the
    connection closed otherwise), and any failure as an answer in its protocol's shape."""
    try:
        if (e := _refusal(request)) is not None:
            raise e
        if not request.body_exists or request.content.is_eof():  # no body, or all of it came with the headers
            return await handler(request)
        h = asyncio.get_running_loop().call_later(request.app[GW].body_timeout, _drop_if_unread, request)
        try:
            return await handler(request)
        finally:
            h.cancel()
    except web.HTTPException:  # what a handler answers on purpose (none here): as it is
        raise
    except Exception as e:
        if not isinstance(e, GatewayError):  # a bug of ours: logged, and still an answer in the protocol's shape
            log.exception("gateway %s %s", request.method, request.path)
        return error_response(from_exception(e), protocol(request.path))


def _drop_if_unread(request: web.Request):
    if not request.content.is_eof() and request.transport is not None:
        request.transport.close()


async def _clients(app: web.Application):
    import tritonclient.grpc.aio as grpcaio
    gw = app[GW]
    gw.grpc = grpcaio.InferenceServerClient(gw.triton_grpc, channel_args=retry.CHANNEL_ARGS)
    gw.upstream = Upstream(gw.triton_http)
    if gw.draining:
        gw.upstream.drain()
    yield
    gw.upstream.close()
    await gw.grpc.close()


def make_app(gw: Gateway) -> web.Application:
    """The KServe v2 routes (health, then the proxy for the rest of /v2), the OpenAI routes, the TEI routes."""
    app = web.Application(middlewares=[metrics.observe, gate])
    app[GW] = gw
    app.cleanup_ctx.append(_clients)
    serving.init(app)
    tei_api.init(app)
    routes = [("GET", "/v2/health/live", live), ("GET", "/v2/health/ready", ready),
              ("*", r"/v2{tail:(/.*)?}", proxy), *openai_api.ROUTES, *tei_api.ROUTES]
    for method, path, handler in routes:  # a GET route answers HEAD too, as aiohttp's add_get makes it
        add = app.router.add_get if method == "GET" else functools.partial(app.router.add_route, method)
        add(path, handler, expect_handler=expect)
    return app


def read_key(path: str | None) -> bytes | None:
    """The API key from its file (a mounted k8s Secret: one line; surrounding whitespace is not part of it)."""
    if path is None:
        return None
    key = Path(path).read_bytes().strip()
    if not key or not key.isascii() or any(c < 0x21 for c in key):
        raise SystemExit(f"the API key in {path} must be one word of printable ASCII")
    return key


def parser() -> argparse.ArgumentParser:  # the launcher passes these; docs/configuration.md lists each
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, action="append", required=True, help="a port to serve on (repeatable)")
    ap.add_argument("--triton-http", required=True, help="host:port of Triton's own HTTP")
    ap.add_argument("--triton-grpc", required=True, help="host:port of Triton's gRPC")
    ap.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY)
    ap.add_argument("--workers", type=int, default=1, help="processes serving the same sockets")
    ap.add_argument("--model-name", default=HUB_ID, help="served name for OpenAI / TEI")
    ap.add_argument("--alias", action="append", default=[], help="another accepted model name (repeatable)")
    ap.add_argument("--health-file", help="the watchdog's verdict file (egemma.gateway.common)")
    ap.add_argument("--triton-metrics", help="host:port of Triton's metrics, passed through at GET /metrics")
    ap.add_argument("--max-connections", type=int, default=1024, help="open connections per worker")
    ap.add_argument("--idle-timeout", type=float, default=60.0,
                    help="seconds a connection may wait for a complete request (headers) before it is closed")
    ap.add_argument("--body-timeout", type=float, default=Gateway.body_timeout,
                    help="seconds for a request's whole body")
    ap.add_argument("--api-key-file", help="a file holding the API key that inference routes require "
                                           "(Authorization: Bearer KEY; KServe also api-key: KEY)")
    ap.add_argument("--retry-seconds", type=float, default=Gateway.retry_s,
                    help="how long a request is retried in a restart")
    metrics.add_flags(ap)
    ap.add_argument("--exit-with-parent", type=int, metavar="PID",
                    help="exit when process PID (the launcher, our parent) dies, even by SIGKILL")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until serve() handles it: a drain must never kill a worker
    if a.exit_with_parent:
        exit_with_parent(a.exit_with_parent)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # connections are file descriptors
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    max_connections = min(a.max_connections, max(16, (hard - 64) // 2))  # each also holds one to Triton
    socks = [listen(a.host, p) for p in a.port]  # bound once, shared by the workers (one accept queue)
    gw = Gateway(triton_http=a.triton_http, triton_grpc=a.triton_grpc, model_name=a.model_name, retry_s=a.retry_seconds,
                 aliases=tuple(a.alias), max_body=a.max_request_bytes, health_file=a.health_file,
                 triton_metrics=a.triton_metrics, body_timeout=a.body_timeout, api_key=read_key(a.api_key_file))
    run, loop = event_loop_runner()
    metrics.setup(a.workers, a.stats_dir)  # before the fork: one shared map

    def worker(siblings: tuple[int, ...] = (), k: int = 0):
        metrics.start_worker(gw, a, k)
        run(serve(make_app(gw), socks, max_connections, a.idle_timeout, siblings, Lanes(gw, a.idle_timeout),
                  drain=gw.drain))
    workers = []
    for k in range(1, a.workers):
        if (pid := os.fork()) == 0:
            exit_with_parent(os.getppid())
            worker(k=k)
            os._exit(0)
        workers.append(pid)
    print(f"gateway: {', '.join(f'http://{a.host}:{p}' for p in a.port)} -> Triton HTTP {a.triton_http}, gRPC "
          f"{a.triton_grpc}; max request {a.max_request_bytes} bytes; {a.workers} worker(s) of at most "
          f"{max_connections} connections on {loop}; API key {'required' if gw.api_key else 'off'}",
          file=sys.stderr, flush=True)
    worker(tuple(workers))
    for pid in workers:  # draining too (serve() sent them SIGTERM)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # already reaped
            pass


if __name__ == "__main__":
    main()
